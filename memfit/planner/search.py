from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.plan import (
    PlanCandidate,
    PlanMemory,
    PlanResult,
    PlanThroughput,
    RejectedCandidate,
    Strategy,
    strategy_conflicts,
)
from memfit.api.vocabulary import Attention, Method, Offload, PlannedMethod, PlannedPrecision, Precision
from memfit.memory.activations import ActivationEstimate, estimate_activations
from memfit.memory.estimate import (
    LoraSettings,
    StaticMemory,
    activation_setup,
    peak_memory,
    static_memory,
    step_total,
)
from memfit.model_shape import ModelShape
from memfit.planner.advice import Untried, advise
from memfit.planner.layouts import layouts
from memfit.planner.throughput import estimate_throughput, step_seconds

GIB = 1024**3
MAX_CANDIDATES = 50
"""Feasible candidates reported (the best of each method always among them)."""
METHOD_PREFERENCE: tuple[PlannedMethod, ...] = (Method.FULL, Method.LORA, Method.QLORA)
"""`method: auto` takes the method that changes the model least among those that fit."""
MAX_REJECTED = 25
"""Nearest misses reported: the closest attempt of each pool x layout x method, closest first."""


class PlanningError(ValueError):
    """The request cannot be planned at all (e.g. a pool it names does not exist)."""


@dataclass(frozen=True, slots=True)
class _Evaluated:
    template: Strategy
    micro_batch_size: int
    gradient_accumulation_steps: int
    static: StaticMemory
    activations: ActivationEstimate
    capacity: PoolCapacity
    trainable: int
    limit: int
    miss_ratio: float
    excluded: bool = False

    @property
    def fits(self) -> bool:
        return self.miss_ratio <= 1 and not self.excluded

    @property
    def memory(self) -> PlanMemory:
        """The full breakdown (the search itself needs only the totals: built for what is reported)."""
        return peak_memory(self.static, self.activations, self.gradient_accumulation_steps)

    @property
    def reason(self) -> str | None:
        """Why it does not fit (None when it does)."""
        if self.excluded:
            return "excluded: it ran out of memory before"
        return None if self.fits else _shortfall_reason(self.memory, self.limit, self.capacity)

    @property
    def strategy(self) -> Strategy:
        t = self.template  # built field by field: dataclasses.replace is several times slower (inner loop)
        return Strategy(
            method=t.method, pool=t.pool, nodes=t.nodes, gpus_per_node=t.gpus_per_node, zero_stage=t.zero_stage,
            offload_optimizer=t.offload_optimizer, offload_parameters=t.offload_parameters,
            gradient_checkpointing=t.gradient_checkpointing, micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps, precision=t.precision,
            optimizer=t.optimizer, attention=t.attention, chunked_loss=t.chunked_loss,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Fit:
    evaluated: _Evaluated
    tokens_per_second: float
    step_seconds: float

    @property
    def method(self) -> str:
        return self.evaluated.template.method

    @property
    def throughput(self) -> PlanThroughput:
        return PlanThroughput.model_construct(tokens_per_second=self.tokens_per_second, step_seconds=self.step_seconds)


@dataclass
class _Search:
    """The fixed inputs of one planning run, its caches and what it found."""

    spec: FineTuneJobSpec
    shape: ModelShape
    lora: LoraSettings
    exclude: Collection[str]
    fits: list[_Fit] = field(default_factory=list)
    nearest_misses: dict[tuple[str, int, int, str], _Evaluated] = field(default_factory=dict)
    static: dict[tuple[str, int, Offload, Offload, int, int, str], StaticMemory] = field(default_factory=dict)
    activations: dict[tuple[str, str, bool, int, Attention, bool], ActivationEstimate] = field(default_factory=dict)
    untried: set[Untried] = field(default_factory=set)
    """Parts of the search where no candidate could be evaluated at all, and why (for the advice)."""

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
               template.attention, template.chunked_loss)  # fmt: skip
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
    for method in _methods(spec):  # auto: every method, so that the best of each can be shown
        if _pinned_conflicts(search, method):
            continue
        for capacity in capacities:
            _search_pool(search, capacity, method)

    ranked = sorted(search.fits, key=_preference)
    candidates = [_to_candidate(search, fit.evaluated, fit.throughput) for fit in _reported(ranked)]
    misses = sorted(search.nearest_misses.values(), key=_ratio)[:MAX_REJECTED]
    rejected = [_to_rejected(search, miss) for miss in misses]
    chosen = candidates[0] if candidates else None
    advice = [] if chosen else advise(spec, rejected, pools, search.untried, _lighter(search, capacities))
    return PlanResult(
        chosen=chosen,
        why_chosen=_why_chosen(spec, ranked) if ranked else None,
        candidates=candidates,
        feasible_count=len(ranked),
        rejected=rejected,
        planning_seconds=round(time.perf_counter() - started, 6),
        advice=advice,
    )


def _lighter(search: _Search, capacities: list[PoolCapacity]) -> dict[str, PlanCandidate | None]:
    """When the pinned method fits nowhere: the best plan of each lighter one, or its nearest miss (None
    where it cannot be tried; why joins ``search.untried``)."""
    spec = search.spec
    if spec.method is Method.AUTO:
        return {}  # every method was searched
    lighter: dict[str, PlanCandidate | None] = {}
    for method in METHOD_PREFERENCE[METHOD_PREFERENCE.index(spec.method) + 1 :]:
        alternative = _Search(spec, search.shape, search.lora, search.exclude)
        if not _pinned_conflicts(alternative, method):
            for capacity in capacities:
                _search_pool(alternative, capacity, method)
        search.untried |= alternative.untried
        if alternative.fits:
            best = max(alternative.fits, key=lambda fit: fit.tokens_per_second)
            lighter[method] = _to_candidate(alternative, best.evaluated, best.throughput)
        elif alternative.nearest_misses:
            lighter[method] = _to_rejected(alternative, min(alternative.nearest_misses.values(), key=_ratio))
        else:
            lighter[method] = None
    return lighter


def _ratio(miss: _Evaluated) -> float:
    return miss.miss_ratio


def _preference(fit: _Fit) -> tuple[int, float]:
    """The planner's order: the method that changes the model least, then the fastest."""
    return METHOD_PREFERENCE.index(fit.evaluated.template.method), -fit.tokens_per_second


def _reported(ranked: list[_Fit]) -> list[_Fit]:
    """The first MAX_CANDIDATES of ``ranked``, with the best of every method among them."""
    heads: dict[str, int] = {}
    for index, fit in enumerate(ranked):
        heads.setdefault(fit.method, index)
    rest = [index for index in range(len(ranked)) if index not in heads.values()]
    kept = sorted({*heads.values(), *rest[: max(0, MAX_CANDIDATES - len(heads))]})
    return [ranked[index] for index in kept]


def speed_ratio(faster: float, slower: float) -> str:
    """``faster`` against ``slower`` in words: "35% faster", "2.1x faster", "6% slower", "as fast"."""
    ratio = faster / slower
    if ratio >= 2:
        return f"{ratio:.1f}x faster"
    if ratio >= 1.005:
        return f"{ratio - 1:.0%} faster"
    return f"{1 - ratio:.0%} slower" if ratio <= 0.995 else "as fast"


def _why_chosen(spec: FineTuneJobSpec, ranked: list[_Fit]) -> str:
    """One sentence: why the first of ``ranked`` won."""
    best = ranked[0]
    method = best.method
    same = [fit for fit in ranked if fit.method == method]
    if len(same) == 1:
        within = f"the only {method} plan that fits"
    else:
        ratio = speed_ratio(best.tokens_per_second, same[1].tokens_per_second)
        versus = "as fast as the next" if ratio == "as fast" else f"{ratio} than the next"
        within = f"the fastest of the {len(same)} {method} plans that fit ({versus})"
    if spec.method is not Method.AUTO:
        return f"method {method} is pinned, and this is {within}."
    higher = METHOD_PREFERENCE[: METHOD_PREFERENCE.index(method)]
    sentence = "method auto takes the method that changes the model least (full, then lora, then qlora)"
    if higher:
        sentence += f" and no {' or '.join(higher)} plan fits"
    sentence += f"; this is {within}"
    others: dict[str, _Fit] = {}
    for fit in ranked:
        if fit.method != method:
            others.setdefault(fit.method, fit)
    for other, fit in others.items():
        ratio = speed_ratio(fit.tokens_per_second, best.tokens_per_second)
        sentence += f"; the best {other} plan would be {ratio} ({fit.tokens_per_second:,.0f} tokens/s est.)"
    return sentence + "."


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


def _methods(spec: FineTuneJobSpec) -> list[PlannedMethod]:
    """The methods to plan: the pinned one, or for auto all of them (METHOD_PREFERENCE decides)."""
    method = spec.method
    if method is Method.AUTO:
        return list(METHOD_PREFERENCE)
    return [method]


def _pinned_conflicts(search: _Search, method: PlannedMethod) -> bool:
    """Whether the spec's pinned knobs rule ``method`` out under every ZeRO stage, recording why: the
    conflicts that hold whatever the stage if there are any, else each stage's."""
    spec, pinned = search.spec, search.spec.strategy

    def conflicts(stage: int | None) -> list[str]:
        return strategy_conflicts(method, spec.training.precision, stage, pinned.offload_optimizer,
                                  pinned.offload_parameters, spec.training.optimizer,
                                  pinned.chunked_loss)  # fmt: skip

    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    per_stage = [conflicts(stage) for stage in stages]
    if not all(per_stage):
        return False
    causes = conflicts(pinned.zero_stage) or [cause for stage_causes in per_stage for cause in stage_causes]
    search.untried.update(Untried(pool=None, method=method, cause=cause) for cause in causes)
    return True


def _precisions(search: _Search, capacity: PoolCapacity, method: PlannedMethod) -> list[PlannedPrecision]:
    """The precision ``method`` runs in on the pool's GPUs: bf16 where they have it, else fp16, unless
    pinned; QLoRA only in bf16 (the trainer refuses it otherwise)."""
    pinned = search.spec.training.precision
    available: PlannedPrecision = Precision.BF16 if capacity.bf16 else Precision.FP16
    precision: PlannedPrecision = available if pinned is Precision.AUTO else pinned
    if precision == Precision.BF16 and not capacity.bf16:
        search.untried.add(Untried(pool=capacity.name, method=None, cause=Untried.BF16_PINNED))
        return []
    if method == Method.QLORA and precision != Precision.BF16:  # pinned fp16/fp32: _pinned_conflicts said so
        search.untried.add(Untried(pool=capacity.name, method=method, cause=Untried.QLORA_NEEDS_BF16))
        return []
    return [precision]


def _zero_options(
    spec: FineTuneJobSpec, method: PlannedMethod, precision: PlannedPrecision, capacity: PoolCapacity, gpus: int
) -> Iterator[tuple[int, Offload, Offload]]:
    """(stage, optimizer offload, parameter offload) combinations that run as planned (no
    strategy_conflicts), without the ones that duplicate another: with several GPUs ZeRO-1 communicates
    as much as ZeRO-0 and holds less; on one GPU nothing is partitioned, so the stages differ only by
    what they offload."""
    pinned = spec.strategy
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    devices = [Offload.NONE, Offload.CPU] + ([Offload.NVME] if capacity.nvme_bytes_per_node else [])
    optimizer = spec.training.optimizer
    for stage in stages:
        if pinned.zero_stage is None and (stage == 0 if gpus > 1 else stage == 2):
            continue
        for opt in _pinned_or(pinned.offload_optimizer, devices):
            # Adapters' states are too small to be worth moving (unless the spec says so).
            if opt != Offload.NONE and method != Method.FULL and pinned.offload_optimizer is None:
                continue
            for params in _pinned_or(pinned.offload_parameters, devices if stage == 3 else [Offload.NONE]):
                if strategy_conflicts(method, precision, stage, opt, params, optimizer, pinned.chunked_loss):
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
    precisions = _precisions(search, capacity, method)
    if not precisions:
        return
    limit = int(capacity.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100))
    attention = spec.strategy.attention or Attention.SDPA
    pinned_ckpt = spec.strategy.gradient_checkpointing
    checkpointing = [pinned_ckpt] if pinned_ckpt is not None else [False, True]
    pinned_chunked = spec.strategy.chunked_loss
    batch = spec.training.global_batch_size
    tried = False
    for nodes, per_node in layouts(capacity, spec.resources.max_gpus, batch):
        per_gpu_batch = batch // (nodes * per_node)
        micro_batches = _micro_batches(spec, per_gpu_batch)
        if not micro_batches:
            continue
        tried = True
        for precision in precisions:
            fitted: dict[tuple[int, Offload, Offload, bool], int] = {}  # knobs -> largest micro-batch that fits
            for stage, opt, params in _zero_options(spec, method, precision, capacity, nodes * per_node):
                for ckpt in checkpointing:
                    if _dominated(fitted, stage, opt, params, ckpt, micro_batches[0]):
                        continue
                    template = Strategy(
                        method=method, pool=capacity.name, nodes=nodes, gpus_per_node=per_node,
                        zero_stage=stage, offload_optimizer=opt, offload_parameters=params,
                        gradient_checkpointing=ckpt, micro_batch_size=1, gradient_accumulation_steps=1,
                        precision=precision, optimizer=spec.training.optimizer, attention=attention,
                        chunked_loss=bool(pinned_chunked),
                    )  # fmt: skip
                    micro = _largest_fitting_micro_batch(
                        search, capacity, limit, template, micro_batches, per_gpu_batch
                    )
                    if pinned_chunked is None and stage != 3 and micro != micro_batches[0]:
                        # The chunked loss costs a recomputed LM head: only where it makes this knob
                        # combination fit, or fit a larger micro-batch.
                        chunked = _largest_fitting_micro_batch(
                            search, capacity, limit, replace(template, chunked_loss=True), micro_batches,
                            per_gpu_batch, must_beat=micro or 0,
                        )  # fmt: skip
                        micro = chunked if chunked is not None else micro
                    if micro is not None:
                        fitted[(stage, opt, params, ckpt)] = micro
    if not tried:
        search.untried.add(Untried(pool=capacity.name, method=None, cause=Untried.no_layout(spec)))


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
    must_beat: int | None = None,
) -> int | None:
    """Find the largest micro-batch that fits and record it (returning it), or the nearest miss.
    ``per_gpu_batch`` (sequences per GPU per optimizer step) sets the accumulation of each micro-batch;
    with ``must_beat`` (0: any) a fit is recorded only when its micro-batch is larger, and nothing is tried
    where the host falls short (another attempt of the same knobs recorded that miss)."""
    static = search.static_memory(template)
    trainable = static.trainable
    if must_beat is not None and _shortfall_ratio_of(0, static.cpu_per_node, static.nvme_per_node, 1, capacity) > 1:
        return None  # the host falls short whatever the micro-batch: the plain attempt recorded the miss

    def attempt(micro: int) -> _Evaluated:
        accumulation = per_gpu_batch // micro
        activations = search.activation_estimate(template, micro)
        total = step_total(static, activations, accumulation)
        ratio = _shortfall_ratio_of(total, static.cpu_per_node, static.nvme_per_node, limit, capacity)
        evaluated = _Evaluated(template, micro, accumulation, static, activations, capacity, trainable, limit, ratio)
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
        return _record_fit(search, largest, must_beat)
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
        return _record_fit(search, best, must_beat)
    if known is None or smallest.miss_ratio < known.miss_ratio:
        search.nearest_misses[key] = smallest
    return None


def _record_fit(search: _Search, fit: _Evaluated, must_beat: int | None = None) -> int | None:
    if must_beat is not None and fit.micro_batch_size <= must_beat:
        return None
    strategy = fit.strategy
    step = step_seconds(search.shape, strategy, fit.capacity, search.sequence_length, fit.trainable)
    tokens = strategy.gpus * strategy.micro_batch_size * strategy.gradient_accumulation_steps * search.sequence_length
    search.fits.append(_Fit(fit, tokens / step, step))
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
