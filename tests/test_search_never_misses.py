"""A search that never misses a plan: wherever pinning some strategy knobs gives a plan, the unpinned search
gives one at least as fast by its own estimate (tokens/s of the plan it chooses).

Over a grid of jobs (full, LoRA, QLoRA) and pools (GPU count, host memory, NVMe), each pinned variant of a job
(an engine, a ZeRO stage, offloads, recomputation, a technique, bf16 masters, a sequence-parallel degree) is
planned on the smallest GPU where it fits (found by bisection over the pool's GPU memory: below the unpinned
job's boundary, a pinned plan there is a plan the search missed) and on the smallest GPU where the unpinned
job fits. The method is pinned in both, so the method preference does not enter. Two allowances, both the
planner's documented choices: bf16 master weights change the numerics and are chosen only where nothing fits
with fp32 (a pinned plan with bf16 masters asks only that the unpinned job has some plan); a plan with
memory-saving techniques must be MIN_TECHNIQUE_GAIN faster than the best of its method without them, so a
pinned plan using one may be up to that much faster.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from memfit.api.base import to_camel
from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.plan import PlanCandidate
from memfit.api.techniques import TECHNIQUES
from memfit.api.vocabulary import MasterWeights
from memfit.planner.report import MIN_TECHNIQUE_GAIN
from memfit.planner.search import best_plan
from tests.planning_fixtures import job

RESOLUTION_GIB = 1 / 8
"""How close the bisection comes to the smallest GPU memory where a job fits."""
LADDER_RATIO = 1.25
"""On the fast grid, GPU sizes this far apart between the unpinned job's boundaries are checked too (a miss
shows first where a pinned plan gets faster: the wide grid, and the fast one for pinned techniques, find every
such size, at ten times the cost)."""
LARGEST_GIB = 256.0
"""The largest GPU memory tried: a pinned variant that does not fit there is left out, and its plan there is
the fastest it can be."""

PINS: tuple[dict[str, Any], ...] = (
    {"engine": "deepspeed"},
    {"engine": "fsdp2"},
    {"zeroStage": 0},
    {"zeroStage": 1},
    {"zeroStage": 2},
    {"zeroStage": 3},
    {"offloadOptimizer": "cpu"},
    {"offloadParameters": "cpu"},
    {"offloadOptimizer": "cpu", "offloadParameters": "cpu"},
    {"engine": "fsdp2", "zeroStage": 3, "offloadParameters": "cpu"},
    {"engine": "fsdp2", "zeroStage": 2, "offloadOptimizer": "cpu", "offloadParameters": "cpu"},
    {"engine": "deepspeed", "zeroStage": 3, "offloadParameters": "cpu"},
    {"engine": "deepspeed", "zeroStage": 1, "offloadOptimizer": "cpu"},
    {"engine": "deepspeed", "zeroStage": 2, "offloadOptimizer": "cpu"},
    {"offloadOptimizer": "nvme"},
    {"offloadOptimizer": "nvme", "offloadParameters": "nvme"},
    {"gradientCheckpointing": True},
    {"gradientCheckpointing": False},
    {"chunkedLoss": True},
    {"activationOffloading": True},
    {"masterWeights": "bf16"},
    {"sequenceParallel": 2},
    {"sequenceParallel": 2, "gradientCheckpointing": True},
)


@dataclass(frozen=True)
class Job:
    preset: str
    method: str
    batch: int
    sequence: int

    def spec(self, pins: dict[str, Any]) -> FineTuneJobSpec:
        return job(self.preset, self.method, batch=self.batch, sequence=self.sequence, strategy=pins)


@dataclass(frozen=True)
class Pool:
    gpus: int
    cpu_gib: float
    nvme_gib: float = 0

    def of(self, gpu_gib: float) -> GPUPool:
        """This pool with GPUs of ``gpu_gib`` (an A100's speed: bf16, so QLoRA runs)."""
        return GPUPool.model_validate({"metadata": {"name": "pool"}, "spec": {
            "gpuProduct": "NVIDIA-A100-SXM4-80GB", "gpuMemoryGiB": gpu_gib, "gpusPerNode": self.gpus, "nodes": 1,
            "cpuMemoryGiBPerNode": self.cpu_gib, "nvmeGiBPerNode": self.nvme_gib}})  # fmt: skip


Pins = tuple[tuple[str, Any], ...]
"""A job's pinned strategy fields, hashable (for the cache)."""


@cache
def planned(job: Job, pins: Pins, pool: Pool, gpu_gib: float) -> PlanCandidate | None:
    return best_plan(job.spec(dict(pins)), [pool.of(gpu_gib)])


def tokens_per_second(plan: PlanCandidate | None) -> float:
    return 0.0 if plan is None else plan.throughput.tokens_per_second


def smallest_gib(job: Job, pins: Pins, pool: Pool, speed: float) -> float:
    """The smallest GPU memory (to RESOLUTION_GIB) where the job's plan reaches ``speed`` (any: a little above
    0), by bisection: a larger GPU never makes the best plan slower."""
    low, high = 0.0, LARGEST_GIB
    while high - low > RESOLUTION_GIB:
        middle = (low + high) / 2
        if tokens_per_second(planned(job, pins, pool, middle)) < speed:
            low = middle
        else:
            high = middle
    return high


def boundaries(job: Job, pins: Pins, pool: Pool) -> tuple[float, float] | None:
    """The smallest GPU where the job fits, and the smallest where it is as fast as on the largest (None: it
    fits nowhere)."""
    fastest = tokens_per_second(planned(job, pins, pool, LARGEST_GIB))
    if not fastest:
        return None
    return smallest_gib(job, pins, pool, sys.float_info.min), smallest_gib(job, pins, pool, fastest)


def ladder(low: float, high: float) -> set[float]:
    """GPU sizes from ``low`` to ``high``, LADDER_RATIO apart."""
    return {low * LADDER_RATIO**step for step in range(int(math.log(high / low, LADDER_RATIO)) + 1)}


def thresholds(job: Job, pins: Pins, pool: Pool, low: float, high: float) -> set[float]:
    """Every GPU size (to RESOLUTION_GIB) between ``low`` and ``high`` where the job's plan gets faster: where
    a plan the unpinned search misses shows first."""
    if tokens_per_second(planned(job, pins, pool, low)) == tokens_per_second(planned(job, pins, pool, high)):
        return set()
    if high - low <= RESOLUTION_GIB:
        return {high}
    middle = (low + high) / 2
    return thresholds(job, pins, pool, low, middle) | thresholds(job, pins, pool, middle, high)


def gpu_sizes(job: Job, pins: Pins, pool: Pool, every_threshold: bool) -> set[float]:
    """Where to compare a pinned variant with the unpinned job: every size where the pinned plan gets faster,
    or (cheaper) where either first fits and first reaches its best, and a ladder between the unpinned job's
    two (empty: the variant fits nowhere)."""
    pinned = boundaries(job, pins, pool)
    if pinned is None:
        return set()
    if every_threshold:
        return thresholds(job, pins, pool, RESOLUTION_GIB, LARGEST_GIB)
    unpinned = boundaries(job, (), pool)
    return {*pinned, *(ladder(*unpinned) if unpinned else ())}


def pins_a_technique(pins: dict[str, Any]) -> bool:
    """Whether ``pins`` turn a memory-saving technique on: the search's pruning of them is the subtlest, so
    even the fast grid compares them wherever their plan gets faster."""
    return any(pins.get(to_camel(technique.knob)) for technique in TECHNIQUES)


def uses_techniques(plan: PlanCandidate) -> bool:
    return any(getattr(plan.strategy, technique.knob) for technique in TECHNIQUES)


def missed(pinned: PlanCandidate, unpinned: PlanCandidate | None, pins: dict[str, Any]) -> bool:
    """Whether the unpinned search missed what the pinned one found (with the two allowances above)."""
    if unpinned is None:
        return True
    if "masterWeights" in pins or pinned.strategy.master_weights != unpinned.strategy.master_weights:
        return False  # bf16 masters where fp32 ones fit: other numerics, not a faster plan of the same
    allowance = MIN_TECHNIQUE_GAIN if uses_techniques(pinned) else 1.0
    return unpinned.throughput.tokens_per_second * allowance < pinned.throughput.tokens_per_second * (1 - 1e-9)


def describe(plan: PlanCandidate | None) -> str:
    if plan is None:
        return "nothing"
    return f"{plan.strategy.identity()} at {plan.throughput.tokens_per_second:,.1f} tokens/s"


def misses(job: Job, pool: Pool, every_threshold: bool = False) -> Iterator[str]:
    """Every pinned plan that the unpinned search does not match, in words; empty when the search misses none."""
    checked = 0
    for pins in PINS:
        try:
            job.spec(pins)
        except ValueError:
            continue  # the spec refuses these pins for this method (the rule table's to say)
        key = tuple(sorted(pins.items()))
        sizes = gpu_sizes(job, key, pool, every_threshold or pins_a_technique(pins))
        checked += bool(sizes)
        for gpu_gib in sorted(sizes):
            pinned, unpinned = planned(job, key, pool, gpu_gib), planned(job, (), pool, gpu_gib)
            if pinned is not None and missed(pinned, unpinned, pins):
                yield (
                    f"{job} on {pool} with {gpu_gib:g} GiB GPUs, pinned {pins}: {describe(pinned)}; "
                    f"unpinned: {describe(unpinned)}"
                )
    assert checked, f"no pinned variant of {job} fits {pool}: the case checks nothing"


LLAMA_70B_QLORA = Job("llama-2-70b", "qlora", batch=2, sequence=2048)
LLAMA_8B_FULL = Job("llama-3.1-8b", "full", batch=8, sequence=2048)
LLAMA_8B_LORA = Job("llama-3.1-8b", "lora", batch=8, sequence=2048)
LLAMA_8B_QLORA = Job("llama-3.1-8b", "qlora", batch=8, sequence=2048)
LLAMA_1B_LORA = Job("llama-3.2-1b", "lora", batch=4, sequence=4096)
QWEN_HALF_B_FULL = Job("qwen2.5-0.5b", "full", batch=16, sequence=1024)

ONE_GPU = Pool(gpus=1, cpu_gib=512)
TWO_GPUS = Pool(gpus=2, cpu_gib=512)
TWO_GPUS_SMALL_HOST_NVME = Pool(gpus=2, cpu_gib=96, nvme_gib=2000)
EIGHT_GPUS = Pool(gpus=8, cpu_gib=1024)

FAST = {
    "70b-qlora-2-gpus": (LLAMA_70B_QLORA, TWO_GPUS),
    "8b-lora-1-gpu": (LLAMA_8B_LORA, ONE_GPU),
    "1b-lora-8-gpus": (LLAMA_1B_LORA, EIGHT_GPUS),
    "half-b-full-8-gpus": (QWEN_HALF_B_FULL, EIGHT_GPUS),
}
WIDE = {
    f"{job.preset}-{job.method}-{pool.gpus}-gpus-{pool.cpu_gib:g}-gib-host-{pool.nvme_gib:g}-gib-nvme": (job, pool)
    for job, pool in itertools.product(
        (LLAMA_70B_QLORA, LLAMA_8B_FULL, LLAMA_8B_LORA, LLAMA_8B_QLORA, LLAMA_1B_LORA, QWEN_HALF_B_FULL),
        (ONE_GPU, TWO_GPUS, TWO_GPUS_SMALL_HOST_NVME, EIGHT_GPUS),
    )
    if (job, pool) not in FAST.values()
}


@pytest.mark.parametrize("case", list(FAST))
@pytest.mark.slow
def test_the_search_misses_no_pinned_plan(case: str) -> None:
    job, pool = FAST[case]
    assert list(misses(job, pool)) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", list(WIDE))
def test_the_search_misses_no_pinned_plan_on_the_wide_grid(case: str) -> None:
    job, pool = WIDE[case]
    assert list(misses(job, pool, every_threshold=True)) == []


def test_70b_qlora_plans_on_two_24_gb_gpus_without_pins() -> None:
    """PEFT's FSDP+QLoRA guide trains Llama-2-70B on 2 x 24 GB with the parameters on the CPU: only fsdp2's
    CPU offload fits it, which the search must find by itself."""
    rtx_pair = GPUPool.model_validate({"metadata": {"name": "rtx"}, "spec": {"gpuProduct": "NVIDIA-GeForce-RTX-4090",
                                       "gpusPerNode": 2, "nodes": 1, "cpuMemoryGiBPerNode": 256}})  # fmt: skip
    plan = best_plan(LLAMA_70B_QLORA.spec({}), [rtx_pair])
    assert plan is not None
    strategy = plan.strategy
    assert (strategy.engine, strategy.offload_parameters, strategy.gpus) == ("fsdp2", "cpu", 2)
    assert strategy.master_weights == MasterWeights.FP32


@pytest.mark.parametrize("pins", [{"offloadParameters": "cpu"}, {"zeroStage": 3}])
def test_qlora_pins_that_fsdp2_runs_are_not_refused_while_the_engine_is_open(pins: dict[str, Any]) -> None:
    """DeepSpeed cannot partition or offload 4-bit weights, fsdp2 can: with the engine undecided the spec is
    accepted (and planned on fsdp2); with DeepSpeed pinned it is refused."""
    assert best_plan(LLAMA_70B_QLORA.spec(pins), [TWO_GPUS.of(24)]) is not None
    with pytest.raises(ValueError, match="DeepSpeed"):
        LLAMA_70B_QLORA.spec({**pins, "engine": "deepspeed"})
