from __future__ import annotations

import heapq
import itertools
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
from memfit.api.vocabulary import (
    Attention,
    Engine,
    MasterWeights,
    Method,
    Offload,
    PlannedMethod,
    PlannedPrecision,
    Precision,
)
from memfit.memory.activations import ActivationEstimate, ActivationSetup, estimate_activations
from memfit.memory.estimate import (
    LoraSettings,
    StaticMemory,
    activation_setup,
    peak_memory,
    static_memory,
    step_total,
)
from memfit.memory.setup import StaticSetup
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
        t = self.template
        return _rebuilt(t, self.micro_batch_size, self.gradient_accumulation_steps, t.chunked_loss,
                        t.activation_offloading, t.optimizer_in_backward)  # fmt: skip


def _rebuilt(t: Strategy, micro: int, accumulation: int, chunked_loss: bool, activation_offloading: bool,
             optimizer_in_backward: bool) -> Strategy:  # fmt: skip
    """``t`` with these knobs, built field by field: dataclasses.replace is several times slower (inner loop)."""
    return Strategy(
        method=t.method, pool=t.pool, nodes=t.nodes, gpus_per_node=t.gpus_per_node, zero_stage=t.zero_stage,
        offload_optimizer=t.offload_optimizer, offload_parameters=t.offload_parameters,
        gradient_checkpointing=t.gradient_checkpointing, micro_batch_size=micro,
        gradient_accumulation_steps=accumulation, precision=t.precision, optimizer=t.optimizer,
        attention=t.attention, chunked_loss=chunked_loss, activation_offloading=activation_offloading,
        master_weights=t.master_weights, engine=t.engine, optimizer_in_backward=optimizer_in_backward,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Fit:
    evaluated: _Evaluated
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


@dataclass
class _Search:
    """The fixed inputs of one planning run, its caches and what it found."""

    spec: FineTuneJobSpec
    shape: ModelShape
    lora: LoraSettings
    exclude: Collection[str]
    fits: list[_Fit] = field(default_factory=list)
    nearest_misses: dict[tuple[str, int, int, str], _Evaluated] = field(default_factory=dict)
    static: dict[StaticSetup, StaticMemory] = field(default_factory=dict)
    activations: dict[ActivationSetup, ActivationEstimate] = field(default_factory=dict)
    master_weights: MasterWeights = MasterWeights.FP32
    """The masters this pass plans with (bf16 only where nothing fits with fp32, or pinned)."""
    options: dict[tuple[str, str, bool, bool, Engine], tuple[tuple[int, Offload, Offload], ...]] = field(
        default_factory=dict
    )
    variants: dict[tuple[bool, bool, Engine], list[_Variant]] = field(default_factory=dict)
    fastest: dict[str, list[float]] = field(default_factory=dict)
    """Per method, a min-heap of the MAX_CANDIDATES best speeds of plans without techniques found so far:
    knobs whose best case is slower than all of them cannot be reported, and are not evaluated."""

    def zero_options(
        self, method: PlannedMethod, precision: PlannedPrecision, capacity: PoolCapacity, gpus: int, engine: Engine
    ) -> tuple[tuple[int, Offload, Offload], ...]:
        """_zero_options, once per distinct input (it depends on the pool only through its NVMe)."""
        key = (method, precision, capacity.nvme_bytes_per_node > 0, gpus == 1, engine)
        options = self.options.get(key)
        if options is None:
            options = self.options[key] = tuple(_zero_options(self, method, precision, capacity, gpus, engine))
        return options

    def technique_variants(self, zero_stage: int, checkpointing: bool, engine: Engine) -> list[_Variant]:
        key = (zero_stage == 3, checkpointing, engine)
        variants = self.variants.get(key)
        if variants is None:
            variants = self.variants[key] = _technique_variants(self.spec, zero_stage, checkpointing, engine)
        return variants

    def outpaced(self, plain: Strategy, largest_micro: int, capacity: PoolCapacity) -> bool:
        """Whether MAX_CANDIDATES plans of the method are faster than these knobs could be (their largest
        micro-batch without accumulation and without techniques is their best case)."""
        heap = self.fastest.get(plain.method)
        if heap is None or len(heap) < MAX_CANDIDATES:
            return False
        best_case = _rebuilt(plain, largest_micro, 1, plain.chunked_loss, plain.activation_offloading,
                             plain.optimizer_in_backward)  # fmt: skip
        trainable = self.static_memory(plain).trainable
        step = step_seconds(self.shape, best_case, capacity, self.sequence_length, trainable)
        return best_case.gpus * largest_micro * self.sequence_length / step < heap[0]

    def found(self, fit: _Fit) -> None:
        self.fits.append(fit)
        if fit.techniques is not None:
            return  # _worth_their_cost may drop it: only plans without techniques raise the bar
        heap = self.fastest.setdefault(fit.method, [])
        if len(heap) < MAX_CANDIDATES:
            heapq.heappush(heap, fit.tokens_per_second)
        elif fit.tokens_per_second > heap[0]:
            heapq.heapreplace(heap, fit.tokens_per_second)

    untried: set[Untried] = field(default_factory=set)
    """Parts of the search where no candidate could be evaluated at all, and why (for the advice)."""

    @property
    def sequence_length(self) -> int:
        return self.spec.training.sequence_length

    def static_memory(self, template: Strategy) -> StaticMemory:
        setup = StaticSetup.of(template)
        static = self.static.get(setup)
        if static is None:
            static = self.static[setup] = static_memory(self.shape, setup, self.lora)
        return static

    def activation_estimate(self, template: Strategy, micro_batch_size: int) -> ActivationEstimate:
        setup = activation_setup(self.shape, template, self.sequence_length, self.lora, micro_batch_size)
        estimate = self.activations.get(setup)
        if estimate is None:
            estimate = self.activations[setup] = estimate_activations(self.shape, setup)
        return estimate


def plan_job(spec: FineTuneJobSpec, pools: Sequence[GPUPool], exclude: Collection[str] = ()) -> PlanResult:
    """Plan ``spec`` on ``pools``; ``exclude`` holds strategy summaries known to fail (after an OOM)."""
    started = time.perf_counter()
    capacities = selected_pools(spec, pools)
    search = _search(spec, capacities, exclude)
    ranked = _ranked(search)
    candidates = [_to_candidate(search, fit.evaluated, fit.throughput, fit.techniques) for fit in _reported(ranked)]
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


def best_plan(spec: FineTuneJobSpec, pools: Sequence[GPUPool]) -> PlanCandidate | None:
    """The plan ``plan_job`` would choose, without the report around it (no misses, no advice)."""
    search = _search(spec, selected_pools(spec, pools), ())
    ranked = _ranked(search)
    return _to_candidate(search, ranked[0].evaluated, ranked[0].throughput, ranked[0].techniques) if ranked else None


def _search(spec: FineTuneJobSpec, capacities: list[PoolCapacity], exclude: Collection[str]) -> _Search:
    """Search every method on every pool. Master weights stay fp32 unless the spec pins them: bf16 masters
    change the numerics, so they are planned only where no plan fits with fp32 masters."""
    shape = spec.model.architecture.shape()
    lora = LoraSettings(spec.lora.rank, tuple(spec.lora.target_modules), spec.lora.dropout > 0)
    pinned = spec.strategy.master_weights
    masters = pinned or MasterWeights.FP32
    search = _search_methods(_Search(spec, shape, lora, frozenset(exclude), master_weights=masters), capacities)
    if not search.fits and pinned is None:
        bf16 = _Search(spec, shape, lora, frozenset(exclude), master_weights=MasterWeights.BF16)
        bf16 = _search_methods(bf16, capacities)
        search = bf16 if bf16.fits else search
    return search


def _ranked(search: _Search) -> list[_Fit]:
    return sorted(_worth_their_cost(search.fits), key=_preference)


def _search_methods(search: _Search, capacities: list[PoolCapacity]) -> _Search:
    for method in _methods(search.spec):  # auto: every method, so that the best of each can be shown
        if _pinned_conflicts(search, method):
            continue
        for capacity in capacities:
            _search_pool(search, capacity, method)
    return search


MIN_TECHNIQUE_GAIN = 1.05
"""A plan whose memory-saving techniques cost speed (recomputed LM head, PCIe copies, other numerics) must be
at least this much faster than the best plan of its method without them: below it the estimated gain is
within the throughput model's own uncertainty."""


def _worth_their_cost(fits: list[_Fit]) -> list[_Fit]:
    """Drop the plans whose techniques buy less than MIN_TECHNIQUE_GAIN over the best plan of their method
    that uses none (where there is one: a technique that makes the method fit at all is always kept)."""
    plain: dict[str, float] = {}
    for fit in fits:
        if fit.techniques is None:
            plain[fit.method] = max(plain.get(fit.method, 0.0), fit.tokens_per_second)
    return [
        fit
        for fit in fits
        if fit.techniques is None
        or fit.method not in plain
        or fit.tokens_per_second >= MIN_TECHNIQUE_GAIN * plain[fit.method]
    ]


def _lighter(search: _Search, capacities: list[PoolCapacity]) -> dict[str, PlanCandidate | None]:
    """When the pinned method fits nowhere: the best plan of each lighter one, or its nearest miss (None
    where it cannot be tried; why joins ``search.untried``)."""
    spec = search.spec
    if spec.method is Method.AUTO:
        return {}  # every method was searched
    lighter: dict[str, PlanCandidate | None] = {}
    for method in METHOD_PREFERENCE[METHOD_PREFERENCE.index(spec.method) + 1 :]:
        alternative = _Search(spec, search.shape, search.lora, search.exclude, master_weights=search.master_weights)
        if not _pinned_conflicts(alternative, method):
            for capacity in capacities:
                _search_pool(alternative, capacity, method)
        search.untried |= alternative.untried
        if alternative.fits:
            best = max(alternative.fits, key=lambda fit: fit.tokens_per_second)
            lighter[method] = _to_candidate(alternative, best.evaluated, best.throughput, best.techniques)
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
    bought = f"; it uses {best.techniques}" if best.techniques else ""
    if spec.method is not Method.AUTO:
        return f"method {method} is pinned, and this is {within}{bought}."
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
    return sentence + bought + "."


def selected_pools(spec: FineTuneJobSpec, pools: Sequence[GPUPool]) -> list[PoolCapacity]:
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
                                  pinned.offload_parameters, spec.training.optimizer, pinned.chunked_loss,
                                  gradient_checkpointing=pinned.gradient_checkpointing,
                                  activation_offloading=pinned.activation_offloading,
                                  master_weights=search.master_weights, engine=pinned.engine,
                                  optimizer_in_backward=pinned.optimizer_in_backward,
                                  clips_gradients=spec.training.max_grad_norm > 0)  # fmt: skip

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
    search: _Search,
    method: PlannedMethod,
    precision: PlannedPrecision,
    capacity: PoolCapacity,
    gpus: int,
    engine: Engine,
) -> Iterator[tuple[int, Offload, Offload]]:
    """(stage, optimizer offload, parameter offload) combinations that run as planned on ``engine`` (no
    strategy_conflicts), without the ones that duplicate another: with several GPUs ZeRO-1 communicates
    as much as ZeRO-0 and holds less; on one GPU DeepSpeed partitions nothing, so its stages differ only by
    what they offload (FSDP2's still differ: resharding after forward frees the gathered copies)."""
    spec = search.spec
    pinned = spec.strategy
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    devices = [Offload.NONE, Offload.CPU] + ([Offload.NVME] if capacity.nvme_bytes_per_node else [])
    optimizer = spec.training.optimizer
    for stage in stages:
        if pinned.zero_stage is None and engine == Engine.DEEPSPEED and (stage == 0 if gpus > 1 else stage == 2):
            continue
        for opt in _pinned_or(pinned.offload_optimizer, devices):
            # Adapters' states are too small to be worth moving (unless the spec says so).
            if opt != Offload.NONE and method != Method.FULL and pinned.offload_optimizer is None:
                continue
            for params in _pinned_or(pinned.offload_parameters, devices if stage == 3 else [Offload.NONE]):
                if strategy_conflicts(method, precision, stage, opt, params, optimizer, pinned.chunked_loss,
                                      master_weights=search.master_weights, engine=engine,
                                      optimizer_in_backward=pinned.optimizer_in_backward):  # fmt: skip
                    continue
                single_gpu_duplicate = (
                    gpus == 1
                    and engine == Engine.DEEPSPEED
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
    engines = [spec.strategy.engine] if spec.strategy.engine is not None else [Engine.FSDP2, Engine.DEEPSPEED]
    batch = spec.training.global_batch_size
    tried = False
    # Most GPUs first: their faster plans raise the bar (search.outpaced) for the slower ones early.
    for nodes, per_node in reversed(list(layouts(capacity, spec.resources.max_gpus, batch))):
        per_gpu_batch = batch // (nodes * per_node)
        micro_batches = _micro_batches(spec, per_gpu_batch)
        if not micro_batches:
            continue
        tried = True
        for precision, engine in itertools.product(precisions, engines):
            fitted: dict[tuple[int, Offload, Offload, bool], int] = {}  # knobs -> largest micro-batch that fits
            options = search.zero_options(method, precision, capacity, nodes * per_node, engine)
            for stage, opt, params in options:
                for ckpt in checkpointing:
                    variants = search.technique_variants(stage, ckpt, engine)
                    if not variants or (fitted and _dominated(fitted, stage, opt, params, ckpt, micro_batches[0])):
                        continue
                    chunked, offloaded, in_backward = variants[0]
                    plain = Strategy(
                        method=method, pool=capacity.name, nodes=nodes, gpus_per_node=per_node,
                        zero_stage=stage, offload_optimizer=opt, offload_parameters=params,
                        gradient_checkpointing=ckpt, micro_batch_size=1, gradient_accumulation_steps=1,
                        precision=precision, optimizer=spec.training.optimizer, attention=attention,
                        chunked_loss=chunked, activation_offloading=offloaded, master_weights=search.master_weights,
                        engine=engine, optimizer_in_backward=in_backward,
                    )  # fmt: skip
                    if search.outpaced(plain, micro_batches[0], capacity):
                        continue
                    micro = _fit_knobs(search, capacity, limit, plain, variants[1:], micro_batches, per_gpu_batch)
                    if micro is not None:
                        fitted[(stage, opt, params, ckpt)] = micro
    if not tried:
        search.untried.add(Untried(pool=capacity.name, method=None, cause=Untried.no_layout(spec)))


_Variant = tuple[bool, bool, bool]
"""(chunked loss, activation offloading, optimizer in backward)."""


def _technique_variants(spec: FineTuneJobSpec, zero_stage: int, checkpointing: bool, engine: Engine) -> list[_Variant]:
    """Combinations of the memory-saving techniques (the pinned value, or off then on), cheapest first: the
    chunked loss (a recomputed LM head), then activation offloading (PCIe copies, checkpointed layers only),
    then both; each without, then with the optimizer step in backward (no time: the same work moved into the
    backward), which runs where the job allows it: fsdp2, no gradient clipping (accumulation 1:
    :func:`_largest_fitting_micro_batch`)."""
    pinned = spec.strategy
    chunked = [pinned.chunked_loss] if pinned.chunked_loss is not None else [False, True]
    offloaded = [pinned.activation_offloading] if pinned.activation_offloading is not None else [False, True]
    allowed = engine == Engine.FSDP2 and spec.training.max_grad_norm == 0
    in_backward = [pinned.optimizer_in_backward] if pinned.optimizer_in_backward is not None else [False, allowed]
    return [(c, o, b) for o in offloaded for c in chunked for b in dict.fromkeys(in_backward)
            if not (c and zero_stage == 3) and not (o and not checkpointing)]  # fmt: skip


def _fit_knobs(
    search: _Search,
    capacity: PoolCapacity,
    limit: int,
    plain: Strategy,
    variants: list[_Variant],
    micro_batches: list[int],
    per_gpu_batch: int,
) -> int | None:
    """The largest micro-batch one knob combination fits, recording the fits: ``plain`` first, then each
    technique variant (chunked loss, activation offloading, optimizer in backward), only where the ones before
    it fall short of the largest micro-batch, recorded only where it fits a larger one: a technique is chosen
    where it makes a plan fit, or a faster one. They shrink activations and gradients, neither of which is in
    the model states' floor, so none is tried where the floor does not fit."""
    bf16_masters = plain.master_weights == MasterWeights.BF16 and search.spec.strategy.master_weights is None
    best = _largest_fitting_micro_batch(search, capacity, limit, plain, micro_batches, per_gpu_batch,
                                        chosen=_Chosen((), None, bf16_masters) if bf16_masters else None)  # fmt: skip
    if best == micro_batches[0] or not variants or _states_short(search, capacity, limit, plain):
        return best
    larger = [micro for micro in micro_batches if micro > (best or 0)]
    if not _fits_gpu(search, limit, _rebuilt(plain, 1, 1, *variants[-1]), larger[-1], per_gpu_batch):
        return best  # not even every technique together fits a larger micro-batch (they only save GPU memory)
    without = best
    for chunked, offloaded, in_backward in variants:
        variant = _rebuilt(plain, 1, 1, chunked, offloaded, in_backward)
        added = _Chosen(_added_techniques(plain, variant), without, bf16_masters)
        micro = _largest_fitting_micro_batch(search, capacity, limit, variant, micro_batches, per_gpu_batch,
                                             must_beat=best or 0, chosen=added)  # fmt: skip
        best = micro if micro is not None else best
        if best == micro_batches[0]:
            break
    return best


def _fits_gpu(search: _Search, limit: int, template: Strategy, micro: int, per_gpu_batch: int) -> bool:
    static = search.static_memory(template)
    return step_total(static, search.activation_estimate(template, micro), per_gpu_batch // micro) <= limit


def _states_short(search: _Search, capacity: PoolCapacity, limit: int, template: Strategy) -> bool:
    """Whether the model states alone (no activation at all) overflow the GPU or the host."""
    static = search.static_memory(template)
    return _shortfall_ratio_of(static.floor, static.cpu_per_node, static.nvme_per_node, limit, capacity) > 1


def _added_techniques(plain: Strategy, variant: Strategy) -> tuple[str, ...]:
    names = []
    if variant.chunked_loss and not plain.chunked_loss:
        names.append("chunked loss")
    if variant.activation_offloading and not plain.activation_offloading:
        names.append("activation offloading")
    if variant.optimizer_in_backward and not plain.optimizer_in_backward:
        names.append("optimizer step in backward")
    return tuple(names)


@dataclass(frozen=True, slots=True)
class _Chosen:
    """The techniques the planner added to a plan (beyond what the spec pins), and what for."""

    names: tuple[str, ...]
    without: int | None
    """The largest micro-batch of the same knobs without them (None: nothing fits without)."""
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


def _dominated(fitted: dict[tuple[int, Offload, Offload, bool], int], stage: int, opt: Offload, params: Offload,
               ckpt: bool,
               largest_micro: int) -> bool:  # fmt: skip
    """Options that can only be slower than one that already fits: NVMe offload where CPU offload fits
    (same GPU memory, slower traffic); and, where a lighter option fits the largest micro-batch (nothing
    to gain in memory), recomputation, any offload, or a higher ZeRO stage (more communication, or as much
    where accumulation does not multiply it)."""
    if opt == Offload.NVME and (stage, Offload.CPU, params, ckpt) in fitted:
        return True
    if params == Offload.NVME and (stage, opt, Offload.CPU, ckpt) in fitted:
        return True
    lighter = [(stage, opt, params, False)] if ckpt else []
    if opt != Offload.NONE:
        lighter.append((stage, Offload.NONE, params, ckpt))
    if params != Offload.NONE:
        lighter.append((stage, opt, Offload.NONE, ckpt))
    lighter += [(lower, opt, Offload.NONE, ckpt) for lower in range(1, stage)]
    return any(fitted.get(knobs) == largest_micro for knobs in lighter)


def _largest_fitting_micro_batch(
    search: _Search,
    capacity: PoolCapacity,
    limit: int,
    template: Strategy,
    micro_batches: list[int],
    per_gpu_batch: int,
    must_beat: int | None = None,
    chosen: _Chosen | None = None,
) -> int | None:
    """Find the largest micro-batch that fits and record it (returning it), or the nearest miss.
    ``per_gpu_batch`` (sequences per GPU per optimizer step) sets the accumulation of each micro-batch;
    with ``must_beat`` (0: any) a fit is recorded only when its micro-batch is larger, and nothing is tried
    where the host falls short (another attempt of the same knobs recorded that miss)."""
    if template.optimizer_in_backward:  # a gradient must be final when made: one micro-batch per step
        micro_batches = [micro for micro in micro_batches if micro == per_gpu_batch]
        if not micro_batches:
            return None
    static = search.static_memory(template)
    trainable = static.trainable
    if must_beat is not None:
        if _shortfall_ratio_of(0, static.cpu_per_node, static.nvme_per_node, 1, capacity) > 1:
            return None  # the host falls short whatever the micro-batch: the plain attempt recorded the miss
        micro_batches = [micro for micro in micro_batches if micro > must_beat]  # only these can be recorded

    excluded = search.exclude

    def attempt(micro: int) -> _Evaluated:
        accumulation = per_gpu_batch // micro
        activations = search.activation_estimate(template, micro)
        total = step_total(static, activations, accumulation)
        cpu = static.cpu_per_node + static.ranks_per_node * activations.host_bytes
        ratio = _shortfall_ratio_of(total, cpu, static.nvme_per_node, limit, capacity)
        evaluated = _Evaluated(template, micro, accumulation, static, activations, capacity, trainable, limit, ratio)
        if excluded and evaluated.strategy.summary() in excluded:
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
    if not micro_batches:
        return None

    # Memory grows with the micro-batch, except that accumulating (more than one micro-batch per step)
    # keeps gradients alive. So: the no-accumulation micro-batch first, then the smallest (when it
    # does not fit, no accumulating one does), then bisect between them.
    best: _Evaluated | None = None
    largest = attempt(micro_batches[0])
    if largest.fits:
        return _record_fit(search, largest, must_beat, chosen)
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
        return _record_fit(search, best, must_beat, chosen)
    if known is None or smallest.miss_ratio < known.miss_ratio:
        search.nearest_misses[key] = smallest
    return None


def _record_fit(search: _Search, fit: _Evaluated, must_beat: int | None, chosen: _Chosen | None) -> int | None:
    if must_beat is not None and fit.micro_batch_size <= must_beat:
        return None
    strategy = fit.strategy
    step = step_seconds(search.shape, strategy, fit.capacity, search.sequence_length, fit.trainable)
    tokens = strategy.gpus * strategy.micro_batch_size * strategy.gradient_accumulation_steps * search.sequence_length
    techniques = chosen.describe(fit.micro_batch_size) if chosen else None
    search.found(_Fit(fit, tokens / step, step, techniques))
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


def _to_candidate(
    search: _Search, evaluated: _Evaluated, throughput: PlanThroughput, techniques: str | None
) -> PlanCandidate:
    return PlanCandidate(**_candidate_fields(search, evaluated, throughput), techniques=techniques)


def _to_rejected(search: _Search, miss: _Evaluated) -> RejectedCandidate:
    throughput = estimate_throughput(search.shape, miss.strategy, miss.capacity, search.sequence_length, miss.trainable)
    return RejectedCandidate(**_candidate_fields(search, miss, throughput), reason=miss.reason)
