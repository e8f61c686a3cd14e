"""A CPU-offload plan's pod asks for the host memory DeepSpeed pins, as PyTorch's pinned allocator rounds it.

Pinned memory is page-locked: the kernel can neither swap it nor reclaim it, and the pod's cgroup is charged
for all of it. tests/test_pinned_vs_deepspeed.py checks the buffers against what DeepSpeed pins.
"""

from __future__ import annotations

import math

import pytest

from memfit.api.finetunejob import FineTuneJob
from memfit.memory.engines.deepspeed import host_pinned_bytes, zero_pinned_buffers
from memfit.memory.estimate import HOST_BYTES_PER_RANK
from memfit.memory.setup import StaticSetup
from memfit.planner.search import lora_settings
from memfit_operator import objects
from tests.operator.test_objects import IMAGE, job, mebibytes, plan_for  # noqa: F401  (job: the fixture)


@pytest.mark.parametrize(
    "strategy",
    [
        {"zero_stage": 3, "offload_optimizer": "cpu"},
        {"zero_stage": 3, "offload_optimizer": "cpu", "offload_parameters": "cpu"},
    ],
    ids=["zero3-optimizer", "zero3-optimizer-and-parameters"],
)
def test_the_pods_memory_request_holds_every_ranks_rounded_pins(job: FineTuneJob, strategy: dict[str, object]) -> None:  # noqa: F811
    job_, plan, pool = plan_for(job, **strategy)
    shape = job_.spec.planned_model()
    setup = StaticSetup.of(plan.strategy)
    buffers = zero_pinned_buffers(shape, setup, lora_settings(job_.spec, shape).adapters)
    rounded, unrounded = host_pinned_bytes(buffers), sum(nbytes * count for nbytes, count in buffers)
    assert rounded > math.ceil(unrounded)  # Llama 2 70B's partitions are no powers of two
    ranks = plan.strategy.gpus_per_node
    # Beside the pins: each rank's pageable optimizer states (Adam's two fp32 moments of its partition) and its
    # runtime.
    states = 8 * shape.parameter_count / plan.strategy.gpus
    assert plan.memory.per_node.cpu >= ranks * (rounded + states + HOST_BYTES_PER_RANK)
    container = objects.trainer_pod(job_, plan, pool, 1, 0, IMAGE)["spec"]["containers"][0]
    assert mebibytes(container["resources"]["requests"]["memory"]) >= plan.memory.per_node.cpu
