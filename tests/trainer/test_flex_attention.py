"""Flex attention on packed batches: transformers' ``flex_attention`` builds a ``BlockMask`` from the packed
``position_ids``, and a packed batch's loss and gradients equal those of its documents run one by one.

torch 2.13 has no flex backward pass on the CPU, so the trainer refuses flex off CUDA. Here the same
higher-order op runs through torch's unfused reference implementation (``calibration.flex_reference``: it
evaluates the block mask's ``mask_mod`` over the whole score matrix, with autograd): what is checked is the
mask transformers builds from the trainer's batches, which the fused CUDA kernel applies tile by tile.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.trainer import test_chat_data as chat_data  # noqa: E402


@pytest.fixture
def flex_reference_on_cpu() -> Iterator[None]:
    from calibration.flex_reference import flex_reference_on_cpu

    with flex_reference_on_cpu():
        yield


@pytest.mark.usefixtures("flex_reference_on_cpu")
def test_packed_loss_and_gradients_under_flex_equal_the_documents_one_by_one(tmp_path: Path) -> None:
    """The SDPA/eager equality test (tests/trainer/test_chat_data.py), same tolerance, with flex attention."""
    assert chat_data.tiny_llama("flex_attention", 258).config._attn_implementation == "flex_attention"
    chat_data.test_packed_loss_and_gradients_equal_the_documents_one_by_one("flex_attention", tmp_path)


@pytest.mark.slow
def test_the_fused_cpu_kernel_attends_within_documents_as_sdpa_does(tmp_path: Path) -> None:
    """Forward only (what torch compiles for the CPU): the fused flex kernel (inductor's C++ template), with the
    BlockMask transformers builds from a packed batch, gives SDPA's logits under its dense block-diagonal mask."""
    texts = ["first document, short.", "the second one is a little longer than that.", "third!", "x" * 40]
    path = chat_data.write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    batches = chat_data.batches_of(path, chat_data.byte_level_tokenizer(), tmp_path, 32, text_field="text")
    _, packed = next(batches.iterate())
    flex, sdpa = chat_data.tiny_llama("flex_attention", 258).float(), chat_data.tiny_llama("sdpa", 258).float()
    with torch.no_grad():
        torch.testing.assert_close(flex(**packed).logits, sdpa(**packed).logits)
        crossing = {"input_ids": packed["input_ids"]}  # control: attending across documents differs
        assert not torch.allclose(flex(**crossing).logits, sdpa(**packed).logits)


def test_torch_has_no_flex_backward_on_the_cpu() -> None:
    """Why the trainer refuses flex off CUDA: torch's own refusal (when torch lifts it, this fails: revisit
    ``memfit_trainer.preflight`` and the planner's ``runs_attention``)."""
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.randn(1, 2, 128, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(query, query, query)


@pytest.fixture(scope="module")
def valid_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.trainer.hostile_configs import valid_document

    return valid_document(tmp_path_factory.mktemp("valid"))


@pytest.mark.parametrize(
    ("devices", "triton", "problem"),
    [
        ("cpu", True, "no backward pass on the CPU"),
        ("cuda", False, "with Triton, which is not installed"),
        ("cuda", True, None),
    ],
)
@pytest.mark.slow
def test_preflight_says_where_flex_cannot_train(
    devices: str, triton: bool, problem: str | None, valid_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.machinery
    import importlib.util

    from memfit.contract.trainer_config import TrainerConfig
    from memfit_trainer import preflight

    document = copy.deepcopy(valid_config)
    document["training"]["attention"] = "flex"
    document["devices"] = devices
    find_spec = importlib.util.find_spec
    installed = importlib.machinery.ModuleSpec("triton", None) if triton else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: installed if name == "triton" else find_spec(name))
    said = preflight._flex_problem(TrainerConfig.model_validate(document))
    assert said == problem if problem is None else problem in str(said)
