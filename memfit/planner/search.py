"""The planner's search: every way to run a job on every pool, evaluated for memory and speed.

Order (:func:`plan_job`): every method the spec allows (all three for ``auto``), on every pool, over the pool's
layouts (nodes x GPUs per node whose data-parallel ranks divide the batch) with the most GPUs first, then each
precision and engine, sequence-parallel degree (:func:`_splits`: whole sequences per GPU, then each split over
2, 4... GPUs), ZeRO stage and offload (:func:`_zero_options`: the combinations the rule table allows, without
duplicates, lightest first: :func:`_stage_order`), with and without recomputation. For each such knob
combination the largest micro-batch that fits is found (:func:`_largest_fitting_micro_batch`: the
no-accumulation micro-batch, then the smallest, then a bisection between them), plain first, then with the
memory-saving techniques (:mod:`memfit.api.techniques`), each kept where it fits a larger micro-batch than
plain (:func:`_fit_knobs`). Master weights stay fp32 unless pinned: bf16 masters change the numerics, so a
second pass plans them only where nothing fits with fp32.

Pruning, none of which can drop a plan the report would show (``tests/test_search_never_misses.py`` checks
that no pinned plan is faster than the unpinned search's):

* what another option dominates (:func:`_to_beat`): NVMe offload where the host holds CPU offload's states;
  recomputation, offload, a higher ZeRO stage or sequence-parallel degree at shares of a sequence per GPU an
  as-fast option fits without techniques (one that needs a technique to fit them pays for it, and may be
  slower), and so anywhere it fits the largest; a higher degree where a lower one's model states overflow or
  its best case was outpaced, and at shares a lower degree can take (:func:`_splits`);
* knob combinations whose best case (largest micro-batch, no accumulation) is slower than MAX_CANDIDATES
  plans of the method already found (:meth:`_Search.outpaced`);
* techniques where the model states alone overflow (they shrink activations and gradients only), where even
  all of them together fit no larger micro-batch, and any variant that adds a technique to one at micro-batches
  that one already fits (a technique only costs);
* below a group's nearest miss, only the nearest miss of each pool x layout x method is kept.

The report (ranking, the techniques worth their cost, why the first won) is :mod:`memfit.planner.report`;
the records evaluated are :mod:`memfit.planner.evaluated`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.knobs import Knobs
from memfit.api.knobs import conflicts as knob_conflicts
from memfit.api.plan import PlanCandidate, PlanResult, Strategy, current_identity
from memfit.api.runtime import IMAGE_RUNTIME, Runtime
from memfit.api.techniques import TECHNIQUES
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
from memfit.memory.activations import ActivationEstimate
from memfit.memory.estimate import StaticMemory, activation_setup, static_memory, step_total
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import LoraSettings, StaticSetup
from memfit.model_facts import model_facts
from memfit.planned_model import PlannedModel, lora_dropout
from memfit.planner.advice import Untried, advise
from memfit.planner.attention import KERNEL_NEEDS, can_plan, missing_package, planned_attention, runs_attention
from memfit.planner.defaults import DEFAULT_CHANGES, DefaultChange
from memfit.planner.evaluated import Chosen, Evaluated, Fit, shortfall_ratio
from memfit.planner.layouts import batch_degrees, layouts
from memfit.planner.packing import pinned_packing_problem, planned_packing
from memfit.planner.report import (
    MAX_CANDIDATES,
    MAX_REJECTED,
    METHOD_PREFERENCE,
    nearest_first,
    ranked,
    reported,
    to_candidate,
    to_miss,
    why_chosen,
)
from memfit.planner.throughput import step_seconds, tokens_per_step


class PlanningError(ValueError):
    """The request cannot be planned at all (e.g. a pool it names does not exist)."""


Variant = tuple[bool, ...]
"""Whether each of TECHNIQUES is on, in their order."""
_KnobKey = tuple[int, Offload, Offload, bool, int]
"""ZeRO stage, optimizer offload, parameter offload, recomputation, sequence-parallel degree: what
:func:`_to_beat` compares."""


@dataclass(frozen=True, slots=True)
class _Largest:
    """The largest micro-batch one knob combination fits (None: none): as it is, and with the techniques the
    search may add."""

    plain: int | None
    any: int | None
    host_short: bool
    """Its model states overflow the host (only there can NVMe offload fit what CPU offload does not)."""
    states_short: bool = False
    """Its model states alone overflow the GPU or the host: so they do at any sequence-parallel degree, which
    splits activations only."""
    outpaced: bool = False
    """Not evaluated: its best case is slower than the plans already found (:meth:`_Search.outpaced`), and so is
    a higher degree's (finer shares of a sequence per GPU, and all-to-alls)."""


_OUTPACED = _Largest(plain=None, any=None, host_short=False, outpaced=True)


def _with_techniques(template: Strategy, variant: Variant) -> Strategy:
    return template.replaced(**{technique.knob: on for technique, on in zip(TECHNIQUES, variant, strict=True)})


@dataclass
class _Search:
    """The fixed inputs of one planning run, its caches and what it found."""

    spec: FineTuneJobSpec
    shape: PlannedModel
    lora: LoraSettings
    exclude: Collection[str]
    """Identities of strategies known to fail (status.excludedStrategies)."""
    master_weights: MasterWeights = MasterWeights.FP32
    """The masters this pass plans with (bf16 only where nothing fits with fp32, or pinned)."""
    runtime: Runtime = IMAGE_RUNTIME
    """The kernel packages the trainer has (only their kernels are planned)."""
    fits: list[Fit] = field(default_factory=list)
    nearest_misses: dict[tuple[str, int, int, str], Evaluated] = field(default_factory=dict)
    options: dict[
        tuple[PlannedMethod, PlannedPrecision, bool, bool, Engine], tuple[tuple[int, Offload, Offload], ...]
    ] = field(default_factory=dict)
    fastest: dict[str, list[float]] = field(default_factory=dict)
    """Per method, a min-heap of the MAX_CANDIDATES best speeds of plans without techniques found so far:
    knobs whose best case is slower than all of them cannot be reported, and are not evaluated."""
    untried: set[Untried] = field(default_factory=set)
    """Parts of the search where no candidate could be evaluated at all, and why (for the advice)."""
    split_kernels: dict[tuple[PlannedMethod, Attention, int, bool], Attention | None] = field(default_factory=dict)
    """:func:`_split_attention` per method, planned kernel, degree and whether the pool runs flash."""

    @property
    def sequence_length(self) -> int:
        return self.spec.training.sequence_length

    @property
    def facts(self) -> dict[str, Any]:
        """The model facts the rules read (``Knobs``: heads, linear or windowed attention, dense MLPs)."""
        return model_facts(self.shape)

    @cached_property
    def pinned(self) -> Knobs:
        """What the spec decides, with this pass's master weights (accumulation is the search's to choose) and
        the model's facts."""
        spec_knobs = replace(self.spec.knobs(), master_weights=self.master_weights, gradient_accumulation_steps=None)
        return replace(spec_knobs, **self.facts)

    def zero_options(
        self, method: PlannedMethod, precision: PlannedPrecision, capacity: PoolCapacity, gpus: int, engine: Engine
    ) -> tuple[tuple[int, Offload, Offload], ...]:
        """_zero_options, once per distinct input (it depends on the pool only through its NVMe)."""
        inputs = (method, precision, capacity.nvme_bytes_per_node > 0, gpus == 1, engine)
        options = self.options.get(inputs)
        if options is None:
            options = self.options[inputs] = tuple(_zero_options(self, *inputs))
        return options

    def technique_variants(
        self, zero_stage: int, checkpointing: bool, engine: Engine, precision: PlannedPrecision, sequence_parallel: int
    ) -> tuple[Variant, ...]:
        """_technique_variants of these knobs (cached across searches: its arguments are the key)."""
        knobs = Knobs(
            zero_stage=zero_stage,
            gradient_checkpointing=checkpointing,
            engine=engine,
            precision=precision,
            master_weights=self.master_weights,
            sequence_parallel=sequence_parallel,
            clips_gradients=self.spec.training.max_grad_norm > 0,
            **self.facts,
        )
        pinned = tuple(getattr(self.spec.strategy, technique.knob) for technique in TECHNIQUES)
        return _technique_variants(pinned, self.shape.untraced_techniques, knobs)

    def outpaced(self, plain: Strategy, largest_micro: int, per_gpu_batch: int, capacity: PoolCapacity) -> bool:
        """Whether MAX_CANDIDATES plans of the method are faster than these knobs could be (their largest
        micro-batch, without accumulation unless pinned or split finer, and without techniques is their best
        case)."""
        heap = self.fastest.get(plain.method)
        if heap is None or len(heap) < MAX_CANDIDATES:
            return False
        accumulation = per_gpu_batch // largest_micro
        best_case = plain.replaced(micro_batch_size=largest_micro, gradient_accumulation_steps=accumulation)
        trainable = self.static_memory(plain).trainable
        step = step_seconds(self.shape, best_case, capacity, self.sequence_length, trainable)
        return tokens_per_step(best_case, self.sequence_length) / step < heap[0]

    def found(self, fit: Fit) -> None:
        self.fits.append(fit)
        if fit.techniques is not None:
            return  # report.ranked may drop it: only plans without techniques raise the bar
        heap = self.fastest.setdefault(fit.method, [])
        if len(heap) < MAX_CANDIDATES:
            heapq.heappush(heap, fit.tokens_per_second)
        elif fit.tokens_per_second > heap[0]:
            heapq.heapreplace(heap, fit.tokens_per_second)

    def split_attention(
        self, capacity: PoolCapacity, method: PlannedMethod, attention: Attention, degree: int
    ) -> Attention | None:
        """_split_attention, once per distinct input (it depends on the pool only through the kernels it runs)."""
        inputs = (method, attention, degree, can_plan(Attention.FLASH, capacity, self.runtime))
        if inputs not in self.split_kernels:
            self.split_kernels[inputs] = _split_attention(self, capacity, method, attention, degree)
        return self.split_kernels[inputs]

    def static_memory(self, template: Strategy) -> StaticMemory:
        return _static_memory(self.shape, StaticSetup.of(template), self.lora)

    def activation_estimate(self, template: Strategy, micro_batch_size: int) -> ActivationEstimate:
        setup = activation_setup(self.shape, template, self.sequence_length, self.lora, micro_batch_size)
        return _model_activations(self.shape, setup)


# The memory model is pure and its inputs are immutable: a search asks it the same questions for each pool and
# pass, and the operator and the bench ask again for the same jobs, so each answer is worked out once.
_static_memory = lru_cache(maxsize=1 << 12)(static_memory)
_model_activations = lru_cache(maxsize=1 << 14)(model_activations)


def plan_job(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    exclude: Collection[str] = (),
    model: PlannedModel | None = None,
    runtime: Runtime = IMAGE_RUNTIME,
) -> PlanResult:
    """Plan ``spec`` on ``pools``; ``exclude`` holds the identities of strategies known to fail (after an
    out-of-memory failure: ``Strategy.identity``). ``model``: the model as its profile describes it
    (``memfit.profiled_model``), else the sizes ``spec.model.architecture`` types (:func:`planned_model`).
    ``runtime``: the kernel packages the trainer has (default: what memfit's trainer image carries)."""
    started = time.perf_counter()
    capacities = selected_pools(spec, pools, runtime)
    exclude = {current_identity(known) for known in exclude}
    search = _search(spec, capacities, exclude, planned_model(spec, model, runtime), runtime)
    fits = ranked(search.fits)
    candidates = [to_candidate(search.shape, fit) for fit in reported(fits)]
    nearest = nearest_first(list(search.nearest_misses.values()))[:MAX_REJECTED]
    misses = [to_miss(search.shape, search.sequence_length, miss) for miss in nearest]
    chosen = candidates[0] if candidates else None
    advice = []
    if chosen is None:
        unpinned = _unpinned_splits(search, capacities)
        defaults = _fitting_defaults(search, capacities)
        advice = advise(spec, misses, pools, search.untried, _lighter(search, capacities), unpinned, defaults)
    return PlanResult(
        chosen=chosen,
        why_chosen=why_chosen(spec, fits) if fits else None,
        candidates=candidates,
        feasible_count=len(fits),
        rejected=[miss.candidate for miss in misses],
        planning_seconds=round(time.perf_counter() - started, 6),
        advice=advice,
        model_parameters=search.shape.parameter_count,
        model_basis=search.shape.basis,
    )


def planned_model(spec: FineTuneJobSpec, model: PlannedModel | None, runtime: Runtime = IMAGE_RUNTIME) -> PlannedModel:
    """``model`` (a profile's) if given, else the typed sizes; PlanningError when the job gives neither, or pins
    what the model's description cannot estimate, LoRA targets peft cannot build on it, or packing it cannot
    keep apart."""
    try:
        model = spec.planned_model(model)
    except ValueError as error:
        raise PlanningError(str(error)) from None
    problem = spec.profile_problem(model) or pinned_packing_problem(
        spec.dataset.packing, spec.strategy.attention, model_facts(model), runtime
    )
    if problem is not None:
        raise PlanningError(problem)
    return model


def best_plan(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    model: PlannedModel | None = None,
    runtime: Runtime = IMAGE_RUNTIME,
) -> PlanCandidate | None:
    """The plan ``plan_job`` would choose, without the report around it (no misses, no advice)."""
    search = _search(spec, selected_pools(spec, pools, runtime), (), planned_model(spec, model, runtime), runtime)
    fits = ranked(search.fits)
    return to_candidate(search.shape, fits[0]) if fits else None


def selected_pools(spec: FineTuneJobSpec, pools: Sequence[GPUPool], runtime: Runtime) -> list[PoolCapacity]:
    """The pools the job may use; PlanningError where it names none, or pins what none of them runs or the
    trainer lacks."""
    wanted = spec.resources.pool
    if not pools:
        raise PlanningError("no GPUPool is declared: give an inventory (memfit plan --inventory POOLS.yaml)")
    selected = [pool_capacity(p) for p in pools if wanted is None or p.metadata.name == wanted]
    if not selected:
        names = ", ".join(p.metadata.name for p in pools)
        raise PlanningError(f"resources.pool {wanted!r} is not a declared GPUPool; declared pools: {names}")
    pinned = spec.strategy.attention
    if pinned is not None and not runtime.runs(pinned):
        raise PlanningError(f"strategy.attention {pinned}: {missing_package(pinned)}")
    if pinned in KERNEL_NEEDS and not any(runs_attention(pinned, capacity) for capacity in selected):
        products = ", ".join(sorted({f"{capacity.name} ({capacity.product})" for capacity in selected}))
        raise PlanningError(
            f"strategy.attention {pinned}: {KERNEL_NEEDS[pinned]}, and no pool the job may use has them: {products}; "
            "leave strategy.attention out (SDPA)"
        )
    return selected


def _search(
    spec: FineTuneJobSpec,
    capacities: list[PoolCapacity],
    exclude: Collection[str],
    shape: PlannedModel,
    runtime: Runtime,
) -> _Search:
    """Search every method on every pool. Master weights stay fp32 unless the spec pins them: bf16 masters
    change the numerics, so they are planned only where no plan fits with fp32 masters."""
    lora = lora_settings(spec, shape)
    pinned = spec.strategy.master_weights
    masters = pinned or MasterWeights.FP32
    excluded = frozenset(exclude)
    search = _search_methods(_Search(spec, shape, lora, excluded, masters, runtime), capacities)
    if not search.fits and pinned is None:
        bf16 = _Search(spec, shape, lora, excluded, MasterWeights.BF16, runtime)
        bf16 = _search_methods(bf16, capacities)
        search = bf16 if bf16.fits else search
    return search


def lora_settings(spec: FineTuneJobSpec, model: PlannedModel) -> LoraSettings:
    """The job's adapters as the memory model reads them, with the dropout the trainer applies."""
    return LoraSettings.of(spec.lora, lora_dropout(model, tuple(spec.lora.target_modules), spec.lora.dropout))


def _search_methods(search: _Search, capacities: list[PoolCapacity]) -> _Search:
    for method in _methods(search.spec):  # auto: every method, so that the best of each can be shown
        if _method_refused(search, method) or _pinned_conflicts(search, method):
            continue
        for capacity in capacities:
            _search_pool(search, capacity, method)
    return search


def _lighter(search: _Search, capacities: list[PoolCapacity]) -> dict[str, PlanCandidate | None]:
    """When the pinned method fits nowhere: the best plan of each lighter one, or its nearest miss (None
    where it cannot be tried; why joins ``search.untried``)."""
    spec = search.spec
    if spec.method is Method.AUTO:
        return {}  # every method was searched
    lighter: dict[str, PlanCandidate | None] = {}
    for method in METHOD_PREFERENCE[METHOD_PREFERENCE.index(spec.method) + 1 :]:
        alternative = _Search(spec, search.shape, search.lora, search.exclude, search.master_weights, search.runtime)
        if not (_method_refused(alternative, method) or _pinned_conflicts(alternative, method)):
            for capacity in capacities:
                _search_pool(alternative, capacity, method)
        search.untried |= alternative.untried
        if alternative.fits:
            lighter[method] = to_candidate(search.shape, ranked(alternative.fits)[0])  # as if it were pinned
        elif alternative.nearest_misses:
            nearest = nearest_first(list(alternative.nearest_misses.values()))[0]
            lighter[method] = to_miss(search.shape, search.sequence_length, nearest).candidate
        else:
            lighter[method] = None
    return lighter


SPLITTING_PINS = {"sequence_parallel": "strategy.sequenceParallel", "tiled_mlp": "strategy.tiledMlp"}
"""The knobs that split a sequence's activations (over GPUs; into tiles), by their spec names."""


def _unpinned_splits(search: _Search, capacities: list[PoolCapacity]) -> tuple[list[str], PlanCandidate] | None:
    """When nothing fits and the spec pins the knobs that split a sequence's activations (one pinned off, or
    sequence parallelism at a degree): the plan the planner finds with them unpinned, if one fits (the one
    ``plan_job`` would choose), and the pins it sets otherwise."""
    spec = search.spec
    values = {name: getattr(spec.strategy, name) for name in SPLITTING_PINS}
    pinned = [name for name, value in values.items() if value is not None and value is not True]  # 1 == True
    if not pinned:
        return None
    unpinned = spec.model_copy(update={"strategy": spec.strategy.model_copy(update=dict.fromkeys(pinned))})
    fits = _search(unpinned, capacities, search.exclude, search.shape, search.runtime).fits
    if not fits:
        return None
    chosen = to_candidate(search.shape, ranked(fits)[0])
    return [SPLITTING_PINS[name] for name in pinned if getattr(chosen.strategy, name) != values[name]], chosen


def _fitting_defaults(search: _Search, capacities: list[PoolCapacity]) -> list[tuple[DefaultChange, PlanCandidate]]:
    """When nothing fits: each default of the job (:data:`DEFAULT_CHANGES`) whose change alone fits it, with the
    plan ``plan_job`` would then choose."""
    found = []
    for change in DEFAULT_CHANGES:
        if change.applies(search.spec):
            fits = _search(change.applied(search.spec), capacities, search.exclude, search.shape, search.runtime).fits
            if fits:
                found.append((change, to_candidate(search.shape, ranked(fits)[0])))
    return found


def _methods(spec: FineTuneJobSpec) -> list[PlannedMethod]:
    """The methods to plan: the pinned one, or for auto all of them (METHOD_PREFERENCE decides)."""
    method = spec.method
    if method is Method.AUTO:
        return list(METHOD_PREFERENCE)
    return [method]


def _method_refused(search: _Search, method: PlannedMethod) -> bool:
    """Whether the model's description says ``method`` cannot train it, recording why."""
    problem = search.shape.method_problem(method)
    if problem is not None:
        search.untried.add(Untried(pool=None, method=method, cause=problem))
    return problem is not None


def _pinned_conflicts(search: _Search, method: PlannedMethod) -> bool:
    """Whether the spec's pinned knobs rule ``method`` out under every ZeRO stage on every engine, recording
    why: the conflicts that hold whatever the stage and engine if there are any, else each combination's."""
    pinned = replace(search.pinned, method=method)
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    per_choice = [
        knob_conflicts(replace(pinned, zero_stage=stage, engine=engine))
        for stage, engine in itertools.product(stages, _engines(pinned.engine))
    ]
    if not all(per_choice):
        return False
    causes = knob_conflicts(pinned) or list(dict.fromkeys(cause for causes in per_choice for cause in causes))
    search.untried.update(Untried(pool=None, method=method, cause=cause) for cause in causes)
    return True


def _engines(pinned: Engine | None) -> list[Engine]:
    return [pinned] if pinned is not None else [Engine.FSDP2, Engine.DEEPSPEED]


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
    has_nvme: bool,
    single_gpu: bool,
    engine: Engine,
) -> Iterator[tuple[int, Offload, Offload]]:
    """(stage, optimizer offload, parameter offload) combinations that run as planned on ``engine`` (the rule
    table allows them), in :func:`_stage_order`, without the ones that duplicate another: on one GPU DeepSpeed
    partitions nothing, so its stages differ only by what they offload (FSDP2's still differ: resharding after
    forward frees the gathered copies). Adapters' optimizer states are offloaded too: the pruning drops it
    where a lighter option fits, and on fsdp2 it is how the base's weights go to the host."""
    pinned = search.spec.strategy
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else _stage_order(engine, single_gpu)
    devices = [Offload.NONE, Offload.CPU] + ([Offload.NVME] if has_nvme else [])
    knobs = replace(search.pinned, method=method, precision=precision, engine=engine)
    for stage in stages:
        for opt in _pinned_or(pinned.offload_optimizer, devices):
            for params in _pinned_or(pinned.offload_parameters, devices if stage == 3 else [Offload.NONE]):
                if knob_conflicts(replace(knobs, zero_stage=stage, offload_optimizer=opt, offload_parameters=params)):
                    continue
                single_gpu_duplicate = (
                    single_gpu
                    and engine == Engine.DEEPSPEED
                    and pinned.zero_stage is None
                    and ((stage == 1 and opt == Offload.NONE) or (stage == 3 and params == Offload.NONE))
                )
                if not single_gpu_duplicate:
                    yield stage, opt, params


def _stage_order(engine: Engine, single_gpu: bool) -> list[int]:
    """The ZeRO stages to try, in the order :func:`_to_beat` needs (what may prune an option comes first).
    DeepSpeed on one GPU partitions nothing: ZeRO-2 is ZeRO-1. On several, ZeRO-1 comes before ZeRO-0: they
    communicate alike and ZeRO-1 mostly holds less, but not always (where few parameters train, its buckets
    outweigh what it partitions), so ZeRO-0 is tried where ZeRO-1 falls short of the largest micro-batch."""
    if engine == Engine.DEEPSPEED:
        return [0, 1, 3] if single_gpu else [1, 0, 2, 3]
    return [0, 1, 2, 3]


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
    pinned_attention = spec.strategy.attention
    if pinned_attention in KERNEL_NEEDS and not runs_attention(pinned_attention, capacity):
        cause = Untried.kernel_not_run(pinned_attention, KERNEL_NEEDS[pinned_attention])
        search.untried.add(Untried(pool=capacity.name, method=None, cause=cause))
        return
    precisions = _precisions(search, capacity, method)
    if not precisions:
        return
    limit = int(capacity.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100))
    attention = pinned_attention or planned_attention(search.shape, capacity, search.sequence_length, search.runtime)
    pinned_ckpt = spec.strategy.gradient_checkpointing
    checkpointing = [pinned_ckpt] if pinned_ckpt is not None else [False, True]
    engines = _engines(spec.strategy.engine)
    batch = spec.training.global_batch_size
    tried = False
    # Most GPUs first: their faster plans raise the bar (search.outpaced) for the slower ones early.
    for nodes, per_node in reversed(
        list(layouts(capacity, spec.resources.max_gpus, batch, spec.strategy.sequence_parallel))
    ):
        splits = [  # a pinned packing the split's kernel cannot keep apart: not this kernel
            split
            for split in _splits(search, capacity, method, attention, nodes * per_node)
            if pinned_packing_problem(spec.dataset.packing, split.attention, search.facts, search.runtime) is None
        ]
        tried = tried or bool(splits)
        packing = {
            split.attention: planned_packing(spec.dataset.packing, split.attention, search.facts, search.runtime)
            for split in splits
        }
        for precision, engine in itertools.product(precisions, engines):
            evaluated: dict[_KnobKey, _Largest] = {}
            options = search.zero_options(method, precision, capacity, nodes * per_node, engine)
            for split, (stage, opt, params), ckpt in itertools.product(splits, options, checkpointing):
                variants = search.technique_variants(stage, ckpt, engine, precision, split.degree)
                key = (stage, opt, params, ckpt, split.degree)
                micro_batches = split.micro_batches
                to_beat = _to_beat(evaluated, key, micro_batches[0])
                worth = [micro for micro in micro_batches if micro > to_beat]
                if not variants or not worth:
                    continue
                knobs = Strategy(
                    method=method,
                    pool=capacity.name,
                    nodes=nodes,
                    gpus_per_node=per_node,
                    zero_stage=stage,
                    offload_optimizer=opt,
                    offload_parameters=params,
                    gradient_checkpointing=ckpt,
                    micro_batch_size=1,
                    gradient_accumulation_steps=1,
                    precision=precision,
                    optimizer=spec.training.optimizer,
                    attention=split.attention,
                    master_weights=search.master_weights,
                    engine=engine,
                    sequence_parallel=split.degree,
                    packing=packing[split.attention],
                )
                plain = _with_techniques(knobs, variants[0])
                if search.outpaced(plain, micro_batches[0], split.per_gpu_batch, capacity):
                    evaluated[key] = _OUTPACED
                    continue
                evaluated[key] = _fit_knobs(
                    search, capacity, limit, plain, variants[1:], worth, split.per_gpu_batch, to_beat
                )
    if not tried:
        search.untried.add(Untried(pool=capacity.name, method=None, cause=Untried.no_layout(spec)))


@dataclass(frozen=True, slots=True)
class _Split:
    """One sequence-parallel degree on a layout: the kernel it attends with and the micro-batches it tries."""

    degree: int
    attention: Attention
    per_gpu_batch: int
    """Sequences per data-parallel rank (a group of ``degree`` GPUs) per optimizer step."""
    micro_batches: list[int]


def _splits(
    search: _Search, capacity: PoolCapacity, method: PlannedMethod, attention: Attention, gpus: int
) -> list[_Split]:
    """The sequence-parallel degrees to try on ``gpus`` (the pinned one, else 1 and the powers of two that
    divide them, lowest first: :func:`_to_beat` tries a higher degree only where lower ones fall short), each
    with a kernel the rules allow it and the micro-batches that divide its data-parallel share of the batch.

    A micro-batch m at degree P holds m/P sequences per GPU. Where a lower degree d with the same kernel can
    hold as many (m x d / P is a whole micro-batch of it), the lower one holds no more memory (the same tokens
    per GPU, without the all-to-all buffers) and runs faster (no all-to-alls), so only the others are tried:
    the higher degrees buy finer shares of a sequence, below one per GPU first."""
    spec = search.spec
    batch = spec.training.global_batch_size
    pinned_micro = spec.strategy.micro_batch_size is not None
    splits: list[_Split] = []
    for degree in batch_degrees(gpus, batch, spec.strategy.sequence_parallel):
        kernel = attention if degree == 1 else search.split_attention(capacity, method, attention, degree)
        if kernel is None:
            continue
        per_gpu_batch = batch // (gpus // degree)
        lower = [split.degree for split in splits if split.attention == kernel and not pinned_micro]
        micro_batches = [
            micro for micro in _micro_batches(spec, per_gpu_batch) if all(micro * d % degree for d in lower)
        ]
        if micro_batches:
            splits.append(_Split(degree, kernel, per_gpu_batch, micro_batches))
    return splits


def _split_attention(
    search: _Search, capacity: PoolCapacity, method: PlannedMethod, attention: Attention, degree: int
) -> Attention | None:
    """The kernel ``degree`` > 1 runs: the planned one where the rules allow it (Ulysses refuses eager and flex,
    and windowed or soft-capped attention needs flash), else flash or SDPA where the pool runs it and the
    model's description plans it, unless the job pins the kernel; None: no kernel can split the sequence."""
    pinned = search.spec.strategy.attention
    kernels = [attention] if pinned is not None else list(dict.fromkeys((attention, Attention.FLASH, Attention.SDPA)))
    for kernel in kernels:
        knobs = replace(search.pinned, method=method, attention=kernel, sequence_parallel=degree)
        plannable = kernel == attention or search.shape.unplannable(Precision.BF16, kernel, frozenset()) is None
        if can_plan(kernel, capacity, search.runtime) and plannable and not knob_conflicts(knobs):
            return kernel
    return None


@lru_cache(maxsize=1 << 12)
def _technique_variants(pinned: tuple[bool | None, ...], untraced: frozenset[str], knobs: Knobs) -> tuple[Variant, ...]:
    """Combinations of the memory-saving techniques (each the ``pinned`` value, in TECHNIQUES' order, or off then
    on) that the rule table allows with ``knobs``, cheapest first: the costliest technique varies slowest
    (activation offloading's PCIe copies, then the chunked loss's recomputed LM head, then the optimizer step in
    backward, which costs no time: the same work moved into the backward; accumulation 1:
    :func:`_largest_fitting_micro_batch`). Techniques the model's description cannot estimate (``untraced``) stay
    off."""
    pinned_of = dict(zip((technique.knob for technique in TECHNIQUES), pinned, strict=True))
    by_cost = sorted(TECHNIQUES, key=lambda technique: technique.cost, reverse=True)
    choices = []
    for technique in by_cost:
        value = pinned_of[technique.knob]
        choices.append([value] if value is not None else [False] if technique.knob in untraced else [False, True])
    variants = []
    for combination in itertools.product(*choices):
        on: dict[str, Any] = dict(zip((technique.knob for technique in by_cost), combination, strict=True))
        if not knob_conflicts(replace(knobs, **on)):
            variants.append(tuple(on[technique.knob] for technique in TECHNIQUES))
    return tuple(variants)


def _fit_knobs(
    search: _Search,
    capacity: PoolCapacity,
    limit: int,
    plain: Strategy,
    variants: tuple[Variant, ...],
    micro_batches: list[int],
    per_gpu_batch: int,
    to_beat: int,
) -> _Largest:
    """The largest of ``micro_batches`` (those above ``to_beat``, what an as-fast option fits) one knob
    combination fits, recording the fits: ``plain`` first, then, where it falls short of the largest
    micro-batch, each technique variant (chunked loss, activation offloading, optimizer in backward, tiled MLP),
    recorded where it fits a larger micro-batch than ``plain``, ``to_beat`` and the variants it adds a technique
    to (tried only below the largest): a technique is chosen where it makes a plan fit, or a faster one (which of two
    variants is faster depends on the job: the report ranks them). They shrink activations and gradients,
    neither of which is in the model states' floor, so none is tried where the floor does not fit."""
    bf16_masters = plain.master_weights == MasterWeights.BF16 and search.spec.strategy.master_weights is None
    best = _largest_fitting_micro_batch(search, capacity, limit, plain, micro_batches, per_gpu_batch,
                                        chosen=Chosen((), None, bf16_masters) if bf16_masters else None)  # fmt: skip
    without = _Largest(best, best, _host_short(search, capacity, plain))
    if best == micro_batches[0]:
        return without
    without = replace(without, states_short=_states_short(search, capacity, limit, plain))
    if not variants or without.states_short:
        return without
    larger = [micro for micro in micro_batches if micro > (best or 0)]
    # The larger micro-batches that need the least: the smallest, and the one without accumulation (which keeps
    # no gradients alive between micro-batches: it can need less than a smaller one that accumulates).
    least = [_with_techniques(plain, variant) for variant in _least_holding(variants)]
    if not any(_fits_gpu(search, limit, template, micro, per_gpu_batch) for template in least
               for micro in {larger[0], larger[-1]}):  # fmt: skip
        return without  # not even the variants that hold least fit a larger micro-batch
    before = max(best or 0, to_beat)  # the largest micro-batch without techniques, of these knobs or as-fast ones
    # The largest micro-batch each variant tried fits, or one it includes does: adding a technique only costs, so a
    # variant is worth trying only above what the variants it includes fit (none where they fit the largest).
    fitted: dict[Variant, int] = {}
    for techniques in variants:
        floor = max([before, *(micro for other, micro in fitted.items() if _includes(techniques, other))])
        if floor >= micro_batches[0]:
            continue
        variant = _with_techniques(plain, techniques)
        added = Chosen(_added_techniques(plain, variant), before or None, bf16_masters)
        micro = _largest_fitting_micro_batch(search, capacity, limit, variant, micro_batches, per_gpu_batch,
                                             must_beat=floor, chosen=added)  # fmt: skip
        best = max(best or 0, micro or 0) or None
        fitted[techniques] = max(floor, micro or 0)
    return replace(without, any=best)


def _least_holding(variants: tuple[Variant, ...]) -> list[Variant]:
    """The variants that hold the least GPU memory on some job: the last (every technique the rules allow
    together), and it without any of those that may hold more than they save (:attr:`Technique.may_hold_more`)."""
    choices = [
        [on, False] if on and technique.may_hold_more else [on]
        for technique, on in zip(TECHNIQUES, variants[-1], strict=True)
    ]
    return [variant for variant in itertools.product(*choices) if variant in variants]


def _includes(variant: Variant, other: Variant) -> bool:
    """Whether ``variant`` has every technique ``other`` has (and so costs at least as much)."""
    return all(on or not other_on for on, other_on in zip(variant, other, strict=True))


def _fits_gpu(search: _Search, limit: int, template: Strategy, micro: int, per_gpu_batch: int) -> bool:
    static = search.static_memory(template)
    return step_total(static, search.activation_estimate(template, micro), per_gpu_batch // micro) <= limit


def _host_short(search: _Search, capacity: PoolCapacity, template: Strategy) -> bool:
    """Whether the host (CPU memory or NVMe) cannot hold the model states it is given, whatever the micro-batch."""
    static = search.static_memory(template)
    return shortfall_ratio(0, static.cpu_per_node, static.nvme_per_node, 1, capacity) > 1


def _states_short(search: _Search, capacity: PoolCapacity, limit: int, template: Strategy) -> bool:
    """Whether the model states alone (no activation at all) overflow the GPU or the host."""
    static = search.static_memory(template)
    return shortfall_ratio(static.floor, static.cpu_per_node, static.nvme_per_node, limit, capacity) > 1


def _added_techniques(plain: Strategy, variant: Strategy) -> tuple[str, ...]:
    return tuple(
        technique.name
        for technique in TECHNIQUES
        if getattr(variant, technique.knob) and not getattr(plain, technique.knob)
    )


def _to_beat(evaluated: dict[_KnobKey, _Largest], knobs: _KnobKey, largest_micro: int) -> int:
    """The micro-batch ``knobs`` must fit more than to give a plan worth having (0: any; ``largest_micro``:
    none can). NVMe offload where CPU offload was tried and the host held its states: none (same GPU memory,
    slower traffic). Else the largest that an as-fast option fits without techniques (:func:`_as_fast`): at
    that micro-batch or below, more recomputation, offload or a higher ZeRO stage can only be slower (one that
    needs a technique pays for it, and may be slower than ``knobs`` without)."""
    stage, opt, params, ckpt, degree = knobs
    on_cpu = [(stage, Offload.CPU, params, ckpt, degree)] if opt == Offload.NVME else []
    on_cpu += [(stage, opt, Offload.CPU, ckpt, degree)] if params == Offload.NVME else []
    if any(key in evaluated and not evaluated[key].host_short for key in on_cpu):
        return largest_micro
    lower = [(stage, opt, params, ckpt, 2**power) for power in range(degree.bit_length() - 1)]
    if any(key in evaluated and (evaluated[key].states_short or evaluated[key].outpaced) for key in lower):
        return largest_micro  # a lower degree's model states overflow (this degree's are the same), or it was outpaced
    # A micro-batch m at degree P holds m/P sequences per GPU: an as-fast option's micro-batch, in this degree's.
    as_fast = [
        largest.plain * degree // other[4]
        for other, largest in evaluated.items()
        if largest.plain and other != knobs and _as_fast(other, knobs)
    ]
    return max(as_fast, default=0)


_OFFLOAD_COST = {Offload.NONE: 0, Offload.CPU: 1, Offload.NVME: 2}
"""Offload devices by what they cost in time (NVMe adds its traffic to CPU offload's)."""


def _as_fast(other: _KnobKey, knobs: _KnobKey) -> bool:
    """Whether ``other`` is at least as fast as ``knobs`` at the same tokens per GPU: no recomputation or offload
    (or slower offload) that ``knobs`` does not have, a stage that communicates no more (a lower one; ZeRO-1
    for ZeRO-0), and a sequence-parallel degree no higher (more all-to-all traffic, and as many micro-batches
    or more per step)."""
    stage, opt, params, ckpt, degree = knobs
    other_stage, other_opt, other_params, other_ckpt, other_degree = other
    as_fast_stage = other_stage <= stage or (stage, other_stage) == (0, 1)
    return (
        as_fast_stage
        and _OFFLOAD_COST[other_opt] <= _OFFLOAD_COST[opt]
        and _OFFLOAD_COST[other_params] <= _OFFLOAD_COST[params]
        and other_ckpt <= ckpt
        and other_degree <= degree
    )


def _largest_fitting_micro_batch(
    search: _Search,
    capacity: PoolCapacity,
    limit: int,
    template: Strategy,
    micro_batches: list[int],
    per_gpu_batch: int,
    must_beat: int | None = None,
    chosen: Chosen | None = None,
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
        if _host_short(search, capacity, template):
            return None  # the host falls short whatever the micro-batch: the plain attempt recorded the miss
        micro_batches = [micro for micro in micro_batches if micro > must_beat]  # only these can be recorded

    excluded = search.exclude

    def attempt(micro: int) -> Evaluated:
        accumulation = per_gpu_batch // micro
        activations = search.activation_estimate(template, micro)
        total = step_total(static, activations, accumulation)
        cpu = static.cpu_per_node + static.ranks_per_node * activations.host_bytes
        ratio = shortfall_ratio(total, cpu, static.nvme_per_node, limit, capacity)
        evaluated = Evaluated(template, micro, accumulation, static, activations, capacity, trainable, limit, ratio)
        if excluded and evaluated.strategy.identity() in excluded:
            return replace(evaluated, miss_ratio=float("inf"), excluded=True)
        return evaluated

    key = (capacity.name, template.nodes, template.gpus_per_node, template.method)
    known = search.nearest_misses.get(key)
    floor = shortfall_ratio(static.floor, static.cpu_per_node, static.nvme_per_node, limit, capacity)
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
    best: Evaluated | None = None
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


def _record_fit(search: _Search, fit: Evaluated, must_beat: int | None, chosen: Chosen | None) -> int | None:
    if must_beat is not None and fit.micro_batch_size <= must_beat:
        return None
    strategy = fit.strategy
    step = step_seconds(search.shape, strategy, fit.capacity, search.sequence_length, fit.trainable)
    tokens = tokens_per_step(strategy, search.sequence_length)
    techniques = chosen.describe(fit.micro_batch_size) if chosen else None
    search.found(Fit(fit, tokens / step, step, techniques))
    return fit.micro_batch_size
