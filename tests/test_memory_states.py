"""Model-state memory against the published anchors: the ZeRO paper and DeepSpeed's own estimators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.api.plan import Strategy
from memfit.catalog.models import MODEL_PRESETS
from memfit.memory.states import NF4_BYTES_PER_PARAMETER, model_states, zero3_working_set

ANCHORS = json.loads((Path(__file__).parent / "data" / "reference_anchors.json").read_text())
SHAPE = MODEL_PRESETS["llama-2-7b"]
P = SHAPE.parameter_count
PAPER_KEYS = {1: "p_os", 2: "p_os_g", 3: "p_os_g_p"}


def strategy(
    stage: int, gpus: int, offload_optimizer: str = "none", offload_parameters: str = "none", **kw
) -> Strategy:
    fields = dict(method="full", pool="p", nodes=1, gpus_per_node=gpus, zero_stage=stage,
                  offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                  gradient_checkpointing=False, micro_batch_size=1, gradient_accumulation_steps=1,
                  precision="bf16", optimizer="adamw", attention="sdpa")  # fmt: skip
    fields.update(kw)
    return Strategy(**fields)


def paper_bytes_per_parameter(stage: int, gpus: int) -> float:
    """Our weights + 16-bit gradients + optimizer states per parameter, without what the paper leaves
    out: the fp32 gradient partition of the step and ZeRO-3's gathered working set."""
    states = model_states(SHAPE, strategy(stage, gpus), 0, ())
    extra = (zero3_working_set(SHAPE) + SHAPE.largest_layer_parameters) * 2 if stage == 3 else 0
    return (states.parameters + states.gradients + states.optimizer_states - extra) / P


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_figure_1(stage: int) -> None:
    figure = ANCHORS["zero_paper"]["figure1"]
    key = PAPER_KEYS.get(stage, "baseline")
    predicted_gb = paper_bytes_per_parameter(stage, figure["nd"]) * figure["psi"] / 1e9
    assert predicted_gb == pytest.approx(figure["exact_gb"][key], rel=1e-3)
    assert round(predicted_gb, 1) == pytest.approx(figure["printed_gb"][key], abs=0.051)


@pytest.mark.parametrize("model", ["7.5B", "128B", "1T"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_paper_table_1(model: str, stage: int) -> None:
    table = ANCHORS["zero_paper"]["table1"]
    psi = table["models"][model]["psi"]
    printed = table["models"][model]["printed_gb"][PAPER_KEYS[stage]]
    for gpus, value in zip(table["nd"], printed, strict=True):
        predicted = paper_bytes_per_parameter(stage if gpus > 1 else 0, gpus) * psi / 1e9
        # The paper rounds half-up in the 7.5B columns and truncates in the others.
        assert predicted == pytest.approx(value, rel=0.01, abs=0.006), (model, stage, gpus)


def test_qlora_keeps_the_base_in_4_bits_and_the_rest_in_the_compute_dtype() -> None:
    shape = MODEL_PRESETS["llama-3.1-8b"]
    states = model_states(shape, strategy(0, 1, method="qlora"), 16, ("all-linear",))
    adapters = shape.lora_parameters(16, ("all-linear",))
    unquantized = shape.parameter_count - shape.quantizable_parameters  # embeddings, LM head, norms
    expected = shape.quantizable_parameters * NF4_BYTES_PER_PARAMETER + (unquantized + adapters) * 2
    assert states.parameters == pytest.approx(expected, abs=1)
    assert states.optimizer_states == adapters * 12  # fp32 masters and Adam moments of the adapters
    assert 4.12 < NF4_BYTES_PER_PARAMETER * 8 < 4.13  # 4-bit codes + double-quantized absmax


def test_lora_trains_only_adapters() -> None:
    states = model_states(SHAPE, strategy(0, 1, method="lora"), 8, ("q_proj", "v_proj"))
    adapters = SHAPE.num_layers * 8 * (2 * (4096 + 4096))
    assert states.gradients == adapters * 2
    assert states.optimizer_states == adapters * 12
    assert states.parameters == (P + adapters) * 2
