from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.plan import PlanCandidate, PlanMemory, PlanResult, PlanThroughput, RejectedCandidate, Strategy
from memfit.api.vocabulary import (
    EIGHT_BIT_OPTIMIZERS,
    Attention,
    Method,
    Offload,
    PlannedMethod,
    PlannedPrecision,
    Precision,
)
from memfit.memory.activations import ActivationEstimate, estimate_activations
from memfit.memory.estimate import (
    LoraSettings,
    StaticMemory,
    activation_setup,
    peak_memory,
    static_memory,
)
from memfit.model_shape import ModelShape
from memfit.planner.advice import advise
from memfit.planner.throughput import estimate_throughput

GIB = 1024**3
MAX_CANDIDATES = 50
"""Feasible candidates reported (fastest first)."""
MAX_REJECTED = 25
"""Nearest misses reported: the closest attempt of each pool x layout x method, closest first."""


class PlanningError(ValueError):
    """The request cannot be planned at all (e.g. a pool it names does not exist)."""


@dataclass(frozen=True, slots=True)
class _Evaluated:
    template: Strategy
    micro_batch_size: int
    gradient_accumulation_steps: int
    memory: PlanMemory
    capacity: PoolCapacity
    trainable: int
    limit: int
    miss_ratio: float
    excluded: bool = False

    @property
    def fits(self) -> bool:
        return self.miss_ratio <= 1 and not self.excluded

    @property
    def reason(self) -> str | None:
        """Why it does not fit (None when it does)."""
        if self.excluded:
            return "excluded: it ran out of memory before"
        return None if self.fits else _shortfall_reason(self.memory, self.limit, self.capacity)

    @property
    def strategy(self) -> Strategy:
        return replace(self.template, micro_batch_size=self.micro_batch_size,
                       gradient_accumulation_steps=self.gradient_accumulation_steps)  # fmt: skip


@dataclass
class _Search:
    """The fixed inputs of one planning run, its caches and what it found."""

    spec: FineTuneJobSpec
    shape: ModelShape
    lora: LoraSettings
    exclude: Collection[str]
    fits: list[tuple[_Evaluated, PlanThroughput]] = field(default_factory=list)
    nearest_misses: dict[tuple[str, int, int, str], _Evaluated] = field(default_factory=dict)
    static: dict[tuple[str, int, Offload, Offload, int, int, str], StaticMemory] = field(default_factory=dict)
    activations: dict[tuple[str, str, bool, int, Attention], ActivationEstimate] = field(default_factory=dict)

    @property
    def sequence_length(self) -> int:
        return self.spec.training.sequence_length

    def static_memory(self, template: Strategy) -> StaticMemory:
        key = (template.method, template.zero_stage, template.offload_optimizer, template.offload_parameters,
               template.nodes, template.gpus_per_node, template.precision)  # fmt: skip
        if key not in self.static:
            self.static[key] = static_memory(self.shape, template, self.lora)
        return self.static[key]

    def activation_estimate(self, template: Strategy, micro_batch_size: int) -> ActivationEstimate:
        key = (template.method, template.precision, template.gradient_checkpointing, micro_batch_size,
               template.attention)  # fmt: skip
        if key not in self.activations:
            strategy = replace(template, micro_batch_size=micro_batch_size)
            setup = activation_setup(self.shape, strategy, self.sequence_length, self.lora)
            self.activations[key] = estimate_activations(self.shape, setup)
        return self.activations[key]


def plan_job(spec: FineTuneJobSpec, pools: Sequence[GPUPool], exclude: Collection[str] = ()) -> PlanResult:
    """Plan ``spec`` on ``pools``; ``exclude`` holds strategy summaries known to fail (after an OOM)."""
    started = time.perf_counter()
    shape = spec.model.architecture.shape()
    lora = LoraSettings(spec.lora.rank, tuple(spec.lora.target_modules), spec.lora.dropout > 0)
    search = _Search(spec, shape, lora, frozenset(exclude))
    capacities = _selected_pools(spec, pools)
    for method in _methods(spec):  # auto: stop at the highest-fidelity method that fits anywhere
        for capacity in capacities:
            _search_pool(search, capacity, method)
        if search.fits:
            break

    ranked = sorted(search.fits, key=lambda fit: -fit[1].tokens_per_second)
    candidates = [_to_candidate(search, evaluated, throughput) for evaluated, throughput in ranked[:MAX_CANDIDATES]]
    misses = sorted(search.nearest_misses.values(), key=lambda miss: miss.miss_ratio)[:MAX_REJECTED]
    rejected = [_to_rejected(search, miss) for miss in misses]
    chosen = candidates[0] if candidates else None
    advice = [] if chosen else advise(spec, shape, rejected, pools)
    return PlanResult(
        chosen=chosen,
        candidates=candidates,
        feasible_count=len(ranked),
        rejected=rejected,
        planning_seconds=round(time.perf_counter() - started, 6),
        advice=advice,
    )


def _selected_pools(spec: FineTuneJobSpec, pools: Sequence[GPUPool]) -> list[PoolCapacity]:
    wanted = spec.resources.pool
    if not pools:
        raise PlanningError("no GPUPool is declared: give an inventory (memfit plan --inventory POOLS.yaml)")
    if wanted is None:
        return [pool_capacity(p) for p in pools]
    selected = [pool_capacity(p) for p in pools if p.metadata.name == wanted]
    if not selected:
        names = ", ".join(p.metadata.name for p in pools)
        raise PlanningError(f"resources.pool {wanted!r} is not a declared GPUPool; declared pools: {names}")
    return selected


def layouts(capacity: PoolCapacity, max_gpus: int | None, global_batch: int) -> Iterator[tuple[int, int]]:
    """(nodes, GPUs per node) to try: part of one node in powers of two, or whole nodes. The GPU count
    must divide the global batch so that micro-batch x accumulation x GPUs equals it exactly."""
    per_node = capacity.gpus_per_node
    options = [(1, g) for g in (1, 2, 4, 8, 16) if g < per_node]
    options += [(nodes, per_node) for nodes in range(1, capacity.nodes + 1)]
    for nodes, gpus in options:
        total = nodes * gpus
        if (max_gpus is None or total <= max_gpus) and global_batch % total == 0:
            yield nodes, gpus


def _methods(spec: FineTuneJobSpec) -> list[PlannedMethod]:
    """auto prefers the method that changes the model least: full, then LoRA, then QLoRA."""
    method = spec.method
    if method is Method.AUTO:
        return [Method.FULL, Method.LORA, Method.QLORA]
    return [method]


def _precisions(spec: FineTuneJobSpec, capacity: PoolCapacity) -> list[PlannedPrecision]:
    pinned = spec.training.precision
    if pinned is Precision.AUTO:
        return [Precision.BF16 if capacity.bf16 else Precision.FP16]
    if pinned is Precision.BF16 and not capacity.bf16:
        return []  # the GPU cannot run it; reported by advise() if nothing else fits
    return [pinned]


def _zero_options(
    spec: FineTuneJobSpec, method: PlannedMethod, capacity: PoolCapacity, gpus: int
) -> Iterator[tuple[int, Offload, Offload]]:
    """(stage, optimizer offload, parameter offload) combinations DeepSpeed supports for ``method``,
    without the ones that duplicate another: with several GPUs ZeRO-1 communicates as much as ZeRO-0
    and holds less; on one GPU nothing is partitioned, so the stages differ only by what they offload."""
    pinned = spec.strategy
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    devices = [Offload.NONE, Offload.CPU] + ([Offload.NVME] if capacity.nvme_bytes_per_node else [])
    eight_bit = spec.training.optimizer in EIGHT_BIT_OPTIMIZERS
    for stage in stages:
        if method == Method.QLORA and stage == 3:
            continue
        if pinned.zero_stage is None and (stage == 0 if gpus > 1 else stage == 2):
            continue
        for opt in _pinned_or(pinned.offload_optimizer, devices):
            # Offload needs ZeRO; adapters' states are too small to be worth moving; 8-bit states stay on GPU.
            if opt != Offload.NONE and (
                stage == 0 or (method != Method.FULL and pinned.offload_optimizer is None) or eight_bit
            ):
                continue
            for params in _pinned_or(pinned.offload_parameters, devices if stage == 3 else [Offload.NONE]):
                if method == Method.QLORA and params != Offload.NONE:
                    continue
                single_gpu_duplicate = (
                    gpus == 1
                    and pinned.zero_stage is None
                    and ((stage == 1 and opt == Offload.NONE) or (stage == 3 and params == Offload.NONE))
                )
                if not single_gpu_duplicate:
                    yield stage, opt, params


def _pinned_or(pinned: Offload | None, options: list[Offload]) -> list[Offload]:
    return [pinned] if pinned is not None else options


def _micro_batches(spec: FineTuneJobSpec, per_gpu_batch: int) -> list[int]:
    """Largest first: divisors of the per-GPU batch (accumulation makes up the rest)."""
    pinned = spec.strategy.micro_batch_size
    if pinned is not None:
        return [pinned] if per_gpu_batch % pinned == 0 else []
    return [b for b in range(per_gpu_batch, 0, -1) if per_gpu_batch % b == 0]


def _search_pool(search: _Search, capacity: PoolCapacity, method: PlannedMethod) -> None:
    spec = search.spec
    limit = int(capacity.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100))
    attention = spec.strategy.attention or Attention.SDPA
    pinned_ckpt = spec.strategy.gradient_checkpointing
    checkpointing = [pinned_ckpt] if pinned_ckpt is not None else [False, True]
    for nodes, per_node in layouts(capacity, spec.resources.max_gpus, spec.training.global_batch_size):
        per_gpu_batch = spec.training.global_batch_size // (nodes * per_node)
        micro_batches = _micro_batches(spec, per_gpu_batch)
        if not micro_batches:
            continue
        for precision in _precisions(spec, capacity):
            fitted: dict[tuple[int, Offload, Offload, bool], int] = {}  # knobs -> largest micro-batch that fits
            for stage, opt, params in _zero_options(spec, method, capacity, nodes * per_node):
                for ckpt in checkpointing:
                    if _dominated(fitted, stage, opt, params, ckpt, micro_batches[0]):
                        continue
                    template = Strategy(
                        method=method, pool=capacity.name, nodes=nodes, gpus_per_node=per_node,
                        zero_stage=stage, offload_optimizer=opt, offload_parameters=params,
                        gradient_checkpointing=ckpt, micro_batch_size=1, gradient_accumulation_steps=1,
                        precision=precision, optimizer=spec.training.optimizer, attention=attention,
                    )  # fmt: skip
                    micro = _largest_fitting_micro_batch(
                        search, capacity, limit, template, micro_batches, per_gpu_batch
                    )
                    if micro is not None:
                        fitted[(stage, opt, params, ckpt)] = micro


def _dominated(fitted: dict[tuple[int, Offload, Offload, bool], int], stage: int, opt: Offload, params: Offload,
               ckpt: bool,
               largest_micro: int) -> bool:  # fmt: skip
    """Options that can only be slower than one that already fits: NVMe offload where CPU offload fits
    (same GPU memory, slower traffic), and recomputation where the largest micro-batch fits without."""
    if opt == Offload.NVME and (stage, Offload.CPU, params, ckpt) in fitted:
        return True
    if params == Offload.NVME and (stage, opt, Offload.CPU, ckpt) in fitted:
        return True
    return ckpt and fitted.get((stage, opt, params, False)) == largest_micro


def _largest_fitting_micro_batch(
    search: _Search,
    capacity: PoolCapacity,
    limit: int,
    template: Strategy,
    micro_batches: list[int],
    per_gpu_batch: int,
) -> int | None:
    """Find the largest micro-batch that fits and record it (returning it), or the nearest miss.
    ``per_gpu_batch`` (sequences per GPU per optimizer step) sets the accumulation of each micro-batch."""
    static = search.static_memory(template)
    trainable = static.trainable

    def attempt(micro: int) -> _Evaluated:
        accumulation = per_gpu_batch // micro
        memory = peak_memory(static, search.activation_estimate(template, micro), accumulation)
        ratio = _shortfall_ratio(memory, limit, capacity)
        evaluated = _Evaluated(template, micro, accumulation, memory, capacity, trainable, limit, ratio)
        if search.exclude and evaluated.strategy.summary() in search.exclude:
            return replace(evaluated, miss_ratio=float("inf"), excluded=True)
        return evaluated

    key = (capacity.name, template.nodes, template.gpus_per_node, template.method)
    known = search.nearest_misses.get(key)
    floor = _shortfall_ratio_of(static.floor, static.cpu_per_node, static.nvme_per_node, limit, capacity)
    if floor > 1:  # the model states alone do not fit: only the nearest miss of the group is kept
        if known is None or floor < known.miss_ratio:
            smallest = attempt(micro_batches[-1])
            if known is None or smallest.miss_ratio < known.miss_ratio:
                search.nearest_misses[key] = smallest
        return None

    # Memory grows with the micro-batch, except that accumulating (more than one micro-batch per step)
    # keeps gradients alive. So: the no-accumulation micro-batch first, then the smallest (when it
    # does not fit, no accumulating one does), then bisect between them.
    best: _Evaluated | None = None
    largest = attempt(micro_batches[0])
    if largest.fits:
        return _record_fit(search, largest)
    smallest = attempt(micro_batches[-1]) if len(micro_batches) > 1 else largest
    if smallest.fits:
        best = smallest
        low, high = 1, len(micro_batches) - 2
        while low <= high:
            middle = (low + high) // 2
            result = attempt(micro_batches[middle])
            if result.fits:
                best, high = result, middle - 1
            else:
                low = middle + 1
    if best is not None:
        return _record_fit(search, best)
    if known is None or smallest.miss_ratio < known.miss_ratio:
        search.nearest_misses[key] = smallest
    return None


def _record_fit(search: _Search, fit: _Evaluated) -> int:
    throughput = estimate_throughput(search.shape, fit.strategy, fit.capacity, search.sequence_length, fit.trainable)
    search.fits.append((fit, throughput))
    return fit.micro_batch_size


def _shortfall_ratio(memory: PlanMemory, limit: int, capacity: PoolCapacity) -> float:
    """How far over its limits (GPU, CPU, NVMe) the plan is: the worst ratio; at most 1 when it fits."""
    return _shortfall_ratio_of(memory.per_gpu.total, memory.per_node.cpu, memory.per_node.nvme, limit, capacity)


def _shortfall_ratio_of(gpu: int, cpu: int, nvme: int, limit: int, capacity: PoolCapacity) -> float:
    nvme_capacity = capacity.nvme_bytes_per_node
    nvme_ratio = nvme / nvme_capacity if nvme_capacity else (float("inf") if nvme else 0.0)
    return max(gpu / limit, cpu / capacity.cpu_memory_bytes_per_node, nvme_ratio)


def _shortfall_reason(memory: PlanMemory, limit: int, capacity: PoolCapacity) -> str:
    gpu, cpu, nvme = memory.per_gpu.total, memory.per_node.cpu, memory.per_node.nvme
    worst = _shortfall_ratio(memory, limit, capacity)
    if worst == gpu / limit:
        return (f"GPU memory: needs {gpu / GIB:.1f} GiB per GPU, {limit / GIB:.1f} GiB usable "
                f"({capacity.gpu_memory_bytes / GIB:.1f} GiB less headroom)")  # fmt: skip
    if worst == cpu / capacity.cpu_memory_bytes_per_node:
        has = capacity.cpu_memory_bytes_per_node / GIB
        return f"CPU memory: needs {cpu / GIB:.1f} GiB per node, the pool has {has:.1f} GiB"
    return f"NVMe: needs {nvme / GIB:.1f} GiB per node, the pool has {capacity.nvme_bytes_per_node / GIB:.1f} GiB"


def _candidate_fields(search: _Search, evaluated: _Evaluated, throughput: PlanThroughput) -> dict[str, Any]:
    return {
        "strategy": evaluated.strategy,
        "parameter_count": search.shape.parameter_count,
        "trainable_parameter_count": evaluated.trainable,
        "memory": evaluated.memory,
        "gpu_memory_bytes": evaluated.capacity.gpu_memory_bytes,
        "fits": evaluated.fits,
        "throughput": throughput,
    }


def _to_candidate(search: _Search, evaluated: _Evaluated, throughput: PlanThroughput) -> PlanCandidate:
    return PlanCandidate(**_candidate_fields(search, evaluated, throughput))


def _to_rejected(search: _Search, miss: _Evaluated) -> RejectedCandidate:
    throughput = estimate_throughput(search.shape, miss.strategy, miss.capacity, search.sequence_length, miss.trainable)
    return RejectedCandidate(**_candidate_fields(search, miss, throughput), reason=miss.reason)
