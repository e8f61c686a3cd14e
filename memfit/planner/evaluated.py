"""What the search evaluates: one strategy's memory against its pool (``Evaluated``), the plans that fit
(``Fit``), and why one does not (``Shortfall``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import PlanMemory, PlanThroughput, Strategy
from memfit.memory.activations import ActivationEstimate
from memfit.memory.estimate import StaticMemory, peak_memory
from memfit.units import GIB


class Shortfall(StrEnum):
    """What a candidate that does not fit falls short of (its largest ratio to its limit), or that it is
    excluded."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"
    EXCLUDED = "excluded"

    @property
    def on_host(self) -> bool:
        return self in (Shortfall.CPU, Shortfall.NVME)


def node_ram(gpu: int, cpu: int, capacity: PoolCapacity, ranks_per_node: int | None = None) -> int:
    """Bytes of a node's RAM a plan uses: its host memory, and on a CPU pool its ranks' memory too
    (``ranks_per_node``, else every rank the pool's nodes hold: a layout with fewer is counted as if full)."""
    ranks = capacity.gpus_per_node if ranks_per_node is None else ranks_per_node
    return cpu + (gpu * ranks if capacity.cpu_only else 0)


def shortfall_ratio(gpu: int, cpu: int, nvme: int, limit: int, capacity: PoolCapacity) -> float:
    """How far over its limits (GPU, CPU, NVMe) a plan is: the worst ratio; at most 1 when it fits."""
    nvme_capacity = capacity.nvme_bytes_per_node
    nvme_ratio = nvme / nvme_capacity if nvme_capacity else (float("inf") if nvme else 0.0)
    return max(gpu / limit, node_ram(gpu, cpu, capacity) / capacity.cpu_memory_bytes_per_node, nvme_ratio)


def shortfall_of(memory: PlanMemory, limit: int, capacity: PoolCapacity) -> Shortfall:
    """Which limit a plan that does not fit is furthest over (the GPU where two tie)."""
    gpu, ram = memory.per_gpu.total, node_ram(memory.per_gpu.total, memory.per_node.cpu, capacity)
    worst = shortfall_ratio(gpu, memory.per_node.cpu, memory.per_node.nvme, limit, capacity)
    if worst == gpu / limit:
        return Shortfall.GPU
    return Shortfall.CPU if worst == ram / capacity.cpu_memory_bytes_per_node else Shortfall.NVME


def describe_shortfall(shortfall: Shortfall, memory: PlanMemory, limit: int, capacity: PoolCapacity) -> str:
    if shortfall == Shortfall.EXCLUDED:
        return "excluded: it ran out of memory before"
    if shortfall == Shortfall.GPU:
        gpu = memory.per_gpu.total
        return (
            f"GPU memory: needs {gpu / GIB:.1f} GiB per GPU, {limit / GIB:.1f} GiB usable "
            f"({capacity.gpu_memory_bytes / GIB:.1f} GiB less headroom)"
        )
    if shortfall == Shortfall.CPU:
        has = capacity.cpu_memory_bytes_per_node / GIB
        needs = node_ram(memory.per_gpu.total, memory.per_node.cpu, capacity) / GIB
        ranks = " (its ranks' memory included)" if capacity.cpu_only else ""
        return f"CPU memory: needs {needs:.1f} GiB per node{ranks}, the pool has {has:.1f} GiB"
    has = capacity.nvme_bytes_per_node / GIB
    return f"NVMe: needs {memory.per_node.nvme / GIB:.1f} GiB per node, the pool has {has:.1f} GiB"


@dataclass(frozen=True, slots=True)
class Evaluated:
    """One micro-batch of one knob combination on one pool, with its memory against the pool's limits."""

    template: Strategy
    """The knobs and placement (its micro-batch and accumulation are not this evaluation's)."""
    micro_batch_size: int
    gradient_accumulation_steps: int
    static: StaticMemory
    activations: ActivationEstimate
    capacity: PoolCapacity
    trainable: int
    limit: int
    """Usable GPU bytes (the pool's GPU memory less the job's headroom)."""
    miss_ratio: float
    """Its worst ratio to a limit (at most 1: it fits)."""
    excluded: bool = False
    """It ran out of memory before (status.excludedStrategies)."""

    @property
    def fits(self) -> bool:
        return self.miss_ratio <= 1 and not self.excluded

    @property
    def memory(self) -> PlanMemory:
        """The full breakdown (the search itself needs only the totals: built for what is reported)."""
        return peak_memory(self.static, self.activations, self.gradient_accumulation_steps)

    @property
    def shortfall(self) -> Shortfall | None:
        """Why it does not fit (None when it does)."""
        if self.excluded:
            return Shortfall.EXCLUDED
        return None if self.fits else shortfall_of(self.memory, self.limit, self.capacity)

    @property
    def reason(self) -> str | None:
        """Why it does not fit, in words (None when it does)."""
        shortfall = self.shortfall
        return None if shortfall is None else describe_shortfall(shortfall, self.memory, self.limit, self.capacity)

    @property
    def strategy(self) -> Strategy:
        return self.template.replaced(
            micro_batch_size=self.micro_batch_size, gradient_accumulation_steps=self.gradient_accumulation_steps
        )


@dataclass(frozen=True, slots=True)
class Fit:
    """An evaluation that fits, with its estimated speed."""

    evaluated: Evaluated
    tokens_per_second: float
    step_seconds: float
    techniques: str | None = None
    """What the plan's memory-saving techniques bought it (None: it uses none)."""

    @property
    def method(self) -> str:
        return self.evaluated.template.method

    @property
    def throughput(self) -> PlanThroughput:
        return PlanThroughput.model_construct(tokens_per_second=self.tokens_per_second, step_seconds=self.step_seconds)


@dataclass(frozen=True, slots=True)
class Chosen:
    """The techniques the planner added to a plan (beyond what the spec pins), and what for."""

    names: tuple[str, ...]
    without: int | None
    """The largest micro-batch without them, of the same knobs or of as-fast ones (less offload or recomputation,
    a lower ZeRO stage) on the same GPUs (None: nothing fits without)."""
    bf16_masters: bool
    """bf16 master weights, chosen because nothing fits with fp32 masters."""

    def describe(self, micro: int) -> str | None:
        parts = []
        if self.names:
            gain = "makes it fit" if self.without is None else f"micro-batch {micro} ({self.without} without)"
            parts.append(f"{' and '.join(self.names)}: {gain}")
        if self.bf16_masters:
            parts.append("bf16 master weights: nothing fits with fp32 masters")
        return "; ".join(parts) or None
