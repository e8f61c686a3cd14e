"""A job whose LoRA adapters peft would refuse to build is refused at validation, not in the trainer."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.planning_fixtures import job


def test_dropout_on_fused_experts_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"lora.dropout 0.05 cannot apply to the adapters on gate, w1, w2, w3"):
        job("mixtral-8x7b", "lora", lora={"dropout": 0.05, "targetModules": ["all-linear"]})


@pytest.mark.parametrize(
    ("method", "lora"),
    [
        ("lora", {"dropout": 0.0, "targetModules": ["all-linear"]}),
        ("lora", {"dropout": 0.05, "targetModules": ["q_proj", "v_proj"]}),
        ("full", {"dropout": 0.05, "targetModules": ["all-linear"]}),  # no adapters are built
    ],
)
def test_adapters_peft_builds_are_accepted(method: str, lora: dict[str, object]) -> None:
    assert job("mixtral-8x7b", method, lora=lora).lora.dropout == lora["dropout"]


def test_dense_models_keep_their_dropout_on_every_linear() -> None:
    assert job("llama-3.1-8b", "lora", lora={"dropout": 0.05, "targetModules": ["all-linear"]}).lora.dropout == 0.05
