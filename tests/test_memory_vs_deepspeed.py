"""Model-state memory against DeepSpeed's own estimators (the installed code) and its documented tables."""

from __future__ import annotations

import pytest

from memfit.api.plan import Strategy
from memfit.memory.estimate import model_states
from memfit.memory.setup import NO_ADAPTERS
from tests.test_memory_states import ANCHORS, SHAPE, P, strategy

pytest.importorskip("deepspeed")
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # noqa: E402


def gpu_states(s: Strategy) -> int:
    states = model_states(SHAPE, s, NO_ADAPTERS)
    return states.parameters + states.gradients + states.step_gradients + states.optimizer_states


@pytest.mark.parametrize("gpus", [1, 4, 8])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeed_estimator(gpus: int, offload: bool) -> None:
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=gpus, cpu_offload=offload)
    ours = gpu_states(strategy(2, gpus, "cpu" if offload else "none"))
    assert ours == pytest.approx(ds_gpu, abs=8)


@pytest.mark.parametrize("gpus", [1, 8])
@pytest.mark.parametrize("offload", [("none", "none"), ("cpu", "none"), ("cpu", "cpu")])
def test_zero3_matches_deepspeed_estimator_plus_prefetched_layer(gpus: int, offload: tuple[str, str]) -> None:
    """DeepSpeed's estimator counts the largest module (weights + gradient) on top of the shards.
    memfit also counts the next layer ZeRO-3 prefetches with the small persistent parameters, and,
    without offload, the 16-bit gradient partition stage3.py keeps (``grad_partitions_flat_buffer``),
    which the estimator leaves out of its 18 bytes per parameter (2 weights + 16 optimizer and fp32
    gradient)."""
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        P, SHAPE.largest_layer_parameters, num_gpus_per_node=gpus,
        cpu_offload=offload[0] == "cpu", cpu_offload_params=offload[1] == "cpu",
    )  # fmt: skip
    ours = gpu_states(strategy(3, gpus, *offload))
    prefetched = 2 * (SHAPE.layer_parameters + SHAPE.norm_parameters)
    gradient_partition = 2 * P // gpus if offload[0] == "none" else 0
    assert ours - prefetched - gradient_partition == pytest.approx(ds_gpu, abs=8)


def test_documented_deepspeed_rows_are_what_the_estimators_compute() -> None:
    """The anchor chain: DeepSpeed's documented tables equal its code (bar the row the docs left stale
    after DeepSpeed changed the ZeRO-2 formula), and the code equals memfit's model above."""
    docs = ANCHORS["deepspeed_docs"]
    rows = docs["zero3_cold"]["rows"]
    inputs = docs["zero3_cold"]["inputs"]
    for row in rows:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            int(inputs["total_params"]), int(inputs["largest_layer_params"]),
            num_gpus_per_node=inputs["num_gpus_per_node"], num_nodes=inputs["num_nodes"],
            cpu_offload=row["offload_optimizer"] == "cpu", cpu_offload_params=row["offload_param"] == "cpu",
            zero_init=bool(row["zero_init"]),
        )  # fmt: skip
        assert gpu / 2**30 == pytest.approx(row["per_gpu_gb"], abs=0.006)
        assert cpu / 2**30 == pytest.approx(row["per_cpu_gb"], abs=0.006)
