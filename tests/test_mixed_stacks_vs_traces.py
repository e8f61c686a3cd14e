"""Every stored profile whose decoder layers are not all alike, composed into the step of its own model cut to its
first layers, against a trace of that step (``calibration.mixed_stack_trace``): full fine-tuning and LoRA, without
and with gradient checkpointing, one packed row of 2048 tokens at real widths.

The profile traces one layer of each type; the cut model holds every type at several depths, as the model builds
it there (Gemma 4's global layers' own widths, Llama 4's NoPE layers), so a layer built otherwise deeper in the
stack than the profile traced it is checked too. The traces are stored (``tests/data/memtrace/mixed_stacks.json``,
rewritten by ``python -m calibration.mixed_stack_trace``); one is traced afresh (``slow``) to catch the stored
records drifting from the models' code.

The plan's ``activationPeak`` is that composed peak: for Llama 4 Scout in 4 layers, checkpointed (issue 40), the
plan's ``activations`` is their share at the moment the step binds (its last layer's backward, two MoE layers
gathered), less than the peak at the loss, which a trace of the activations alone shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from calibration.mixed_stack_trace import (
    DEFAULT_OUT,
    activations_of,
    cut_layers,
    layer_types_of,
    mixed_stack_names,
    setup_of,
    trace_case,
    traced_setups,
)
from memfit.api.finetunejob import FineTuneJob
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.catalog.model_configs import CONFIGS_DIR, stored_profile
from memfit.memory.activations import ActivationSetup
from memfit.memory.profiled_activations import profiled_activations
from memfit.planner.search import plan_job
from memfit.profiled_model import ProfiledModel
from memfit_trainer.activation_profile import text_config, trace
from tests.planning_fixtures import A100_NODE

RECORDS: list[dict[str, Any]] = json.loads(Path(DEFAULT_OUT).read_text())
ABOVE, BELOW = 0.05, 0.02
"""The composed peak within 5% of the traced one, and never below it by more than 2%."""
FRESH = ("llama-4-scout", False, True)
"""The case traced afresh: Llama 4 Scout checkpointed, full fine-tuning (issue 40)."""


def _name(record: dict[str, Any]) -> str:
    setup = "lora" if record["lora"] else "full"
    return f"{record['model']}-{setup}{'-checkpointed' if record['gradient_checkpointing'] else ''}"


def test_every_mixed_stack_is_traced_in_every_setup_it_trains_from_its_own_config() -> None:
    traced = sorted((r["model"], r["lora"], r["gradient_checkpointing"]) for r in RECORDS)
    assert traced == sorted((name, *setup) for name in mixed_stack_names() for setup in traced_setups(name))
    assert {"llama-4-scout", "gemma-4-31b", "gpt-oss-20b", "qwen3.5-27b"} <= {r["model"] for r in RECORDS}
    for record in RECORDS:
        profile = stored_profile(record["model"])
        assert profile is not None
        stale = f"{_name(record)}: traced from another config; run python -m calibration.mixed_stack_trace"
        assert record["config_sha256"] == profile.config_sha256, stale
        assert tuple(record["layer_types"]) == cut_layers(layer_types_of(record["model"])), stale


@pytest.mark.parametrize("record", RECORDS, ids=_name)
def test_the_composed_peak_is_within_5_percent_of_the_whole_model_trace_and_never_2_percent_below(
    record: dict[str, Any],
) -> None:
    profile = stored_profile(record["model"])
    assert profile is not None
    layers = tuple(record["layer_types"])
    cut = ProfiledModel(profile.model_copy(update={"layer_types": layers, "num_layers": len(layers)}))
    activations = activations_of(record["model"])
    setup = ActivationSetup(
        Method.LORA if record["lora"] else Method.FULL,
        Precision.BF16,
        record["gradient_checkpointing"],
        micro_batch_size=1,
        sequence_length=record["tokens"],
        attention=Attention(activations.attention),
        lora_rank=activations.lora_rank,
    )
    error = profiled_activations(cut, setup).peak / record["peak"] - 1
    assert -BELOW <= error <= ABOVE, f"{_name(record)}: {error:+.2%}"


@pytest.mark.slow
def test_a_stored_trace_is_what_the_model_traces_now() -> None:
    pytest.importorskip("transformers")
    model, lora, checkpointing = FRESH
    stored = next(r for r in RECORDS if (r["model"], r["lora"], r["gradient_checkpointing"]) == FRESH)
    assert trace_case(model, lora, checkpointing) == stored, "drifted: run python -m calibration.mixed_stack_trace"


@pytest.mark.slow
def test_llama_4_scout_in_4_layers_checkpointed_is_planned_at_the_activation_peak_its_step_traces() -> None:
    """Issue 40's case: full fine-tuning at real width, 1 x 2048 tokens, ZeRO-3, every other technique off."""
    pytest.importorskip("transformers")
    layers = ("chunked_attention", "chunked_attention", "chunked_attention", "full_attention")
    profile = stored_profile("llama-4-scout")
    assert profile is not None
    cut = ProfiledModel(profile.model_copy(update={"layer_types": layers, "num_layers": len(layers)}))
    spec = FineTuneJob.model_validate(scout_job(layers)).spec
    plan = plan_job(spec, [A100_NODE], model=cut)
    assert plan.chosen is not None and plan.chosen.strategy.gradient_checkpointing
    traced = trace(text_config(scout_config()), layers, 2048, "sdpa", setup_of("llama-4-scout", False, True)).peak
    planned = plan.chosen.memory.per_gpu
    assert planned.activation_peak is not None
    assert -BELOW <= planned.activation_peak / traced - 1 <= ABOVE, (planned.activation_peak, traced)
    assert planned.activations < planned.activation_peak  # the binding moment's share, not the peak


def scout_config() -> dict[str, Any]:
    return dict(json.loads((CONFIGS_DIR / "llama-4-scout.json").read_text(encoding="utf-8")))


def scout_job(layers: tuple[str, ...]) -> dict[str, Any]:
    strategy = {"zeroStage": 3, "gradientCheckpointing": True, "microBatchSize": 1, "chunkedLoss": False,
                "activationOffloading": False, "tiledMlp": False, "attention": "sdpa"}  # fmt: skip
    return {
        "apiVersion": "memfit.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "scout"},
        "spec": {
            "model": {"name": "llama-4-scout", "architecture": {"preset": "llama-4-scout"}},
            "dataset": {"source": {"pvc": "data", "path": "train.jsonl"}, "format": "jsonl", "textField": "text"},
            "method": "full",
            "training": {"globalBatchSize": 8, "sequenceLength": 2048},
            "resources": {"maxGPUs": 8},
            "strategy": strategy,
            "output": {"pvc": "output", "path": "run/"},
        },
    }
