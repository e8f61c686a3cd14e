"""When nothing fits: say why, from what actually ruled the candidates out, and what would change it.

Every line states something true of the job and the pools: the nearest miss and the shortfall it was
rejected for, a change that addresses that shortfall (only where the change is possible and not already
made), what each method lighter than a pinned one achieves (planned, not presumed), and each pool or method
the search could not try at all, with the rule that ruled it out. tests/test_advice_truth.py checks each
kind of line against the inputs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.plan import PlanCandidate, RejectedCandidate
from memfit.api.vocabulary import Attention, Method, Offload, StepPhase
from memfit.planner.defaults import DefaultChange
from memfit.planner.evaluated import Shortfall
from memfit.planner.layouts import layouts
from memfit.planner.report import Miss
from memfit.units import GIB

LONG_SEQUENCE = 256
"""Below this many tokens per sequence a shorter sequence is not worth suggesting."""


@dataclass(frozen=True, slots=True)
class Untried:
    """A part of the search where no candidate could be evaluated at all, and why."""

    pool: str | None
    """The pool, or None for every pool."""
    method: str | None
    """The method, or None for every method."""
    cause: str
    """A clause: one of the constants below, ``no_layout``, or a strategy conflict of the pinned knobs."""

    BF16_PINNED: ClassVar[str] = "training.precision bf16 is pinned, but these GPUs have no bf16 (use auto or fp16)"
    QLORA_NEEDS_BF16: ClassVar[str] = (
        "qlora computes in bf16 (the trainer refuses it in fp16 and fp32), which these GPUs lack"
    )

    @staticmethod
    def kernel_not_run(attention: Attention, needs: str) -> str:
        """A pinned attention kernel that needs GPUs the pool does not have."""
        return (
            f"strategy.attention {attention} is pinned, and {needs}, which these are not (leave strategy.attention "
            "out: SDPA)"
        )

    @staticmethod
    def no_layout(spec: FineTuneJobSpec) -> str:
        """No GPU count of the pool can take the batch (with a pinned micro-batch, within maxGPUs)."""
        batch, max_gpus = spec.training.global_batch_size, spec.resources.max_gpus
        micro = spec.strategy.micro_batch_size
        within = f" (at most resources.maxGPUs {max_gpus})" if max_gpus else ""
        if micro is not None:
            return (f"strategy.microBatchSize {micro} divides the per-GPU batch (globalBatchSize {batch} / GPUs) "
                    f"of none of its GPU counts{within}")  # fmt: skip
        return f"training.globalBatchSize {batch} is divisible by none of its GPU counts{within}"


def advise(
    spec: FineTuneJobSpec,
    misses: Sequence[Miss],
    pools: Sequence[GPUPool],
    untried: Collection[Untried],
    lighter: Mapping[str, PlanCandidate | None] = MappingProxyType({}),
    unpinned: tuple[Sequence[str], PlanCandidate] | None = None,
    defaults: Sequence[tuple[DefaultChange, PlanCandidate]] = (),
) -> list[str]:
    """Sentences for a person: the nearest miss and each change that would close its gap, what the
    methods lighter than a pinned one achieve (``lighter``: the best plan of each, with ``fits``, or its
    nearest miss; None where it could not be tried), the plan that fits with the pinned knobs ``unpinned``
    names left to the planner, the plan that fits with each default ``defaults`` changes, then what was never
    tried and why."""
    advice = _nearest_miss(spec, misses[0], pools) if misses else []
    advice += _lighter_lines(lighter)
    if unpinned is not None:
        knobs, plan = unpinned
        speed = f"{plan.throughput.tokens_per_second:,.0f} tokens/s est."
        advice.append(f"unpinned, {' and '.join(knobs)} would fit it: {plan.strategy.summary()} ({speed})")
    for change, plan in defaults:
        speed = f"{plan.throughput.tokens_per_second:,.0f} tokens/s est."
        advice.append(f"with {change.setting} ({change.why}) it fits: {plan.strategy.summary()} ({speed})")
    advice += _untried_lines(untried)
    return advice or ["no strategy could be evaluated for this job"]


def _lighter_lines(lighter: Mapping[str, PlanCandidate | None]) -> list[str]:
    lines = []
    for method, plan in lighter.items():
        if plan is None:
            continue
        if plan.fits:
            speed = f"{plan.throughput.tokens_per_second:,.0f} tokens/s est."
            lines.append(f"method {method} (adapters on a frozen base) would fit: {plan.strategy.summary()} ({speed})")
        elif isinstance(plan, RejectedCandidate):
            lines.append(f"method {method} does not fit either: {plan.strategy.summary()} ({plan.reason})")
    return lines


def _capacity(pools: Sequence[GPUPool], name: str) -> PoolCapacity:
    return next(pool_capacity(p) for p in pools if p.metadata.name == name)


def max_gpus_for(spec: FineTuneJobSpec, capacity: PoolCapacity) -> int:
    """The most GPUs of ``capacity`` this job can use (memfit.planner.layouts)."""
    counts = [
        n * g
        for n, g in layouts(
            capacity, spec.resources.max_gpus, spec.training.global_batch_size, spec.strategy.sequence_parallel
        )
    ]
    return max(counts, default=0)


def _nearest_miss(spec: FineTuneJobSpec, miss: Miss, pools: Sequence[GPUPool]) -> list[str]:
    nearest = miss.candidate
    strategy, memory = nearest.strategy, nearest.memory
    capacity = _capacity(pools, strategy.pool)
    advice = [f"nearest miss: {strategy.summary()} ({nearest.reason})"]
    if miss.shortfall == Shortfall.EXCLUDED:  # misses are sorted: every one is excluded
        advice.append(
            "no candidate estimated to fit is left: each one ran out of memory before (status.excludedStrategies)"
        )
        return advice
    headroom = 1 - spec.resources.memory_headroom_percent / 100
    limit = int(capacity.gpu_memory_bytes * headroom)
    gpu = memory.per_gpu
    gap = gpu.total - limit
    if miss.shortfall.on_host:
        advice.append(_host_line(spec, miss, gpu_fits=gap <= 0))
        if gap > 0:
            advice.append(f"it also needs {gap / GIB:.1f} GiB more per GPU")
        return advice

    host_short = []
    if memory.per_node.cpu > capacity.cpu_memory_bytes_per_node:
        host_short.append(f"{memory.per_node.cpu / GIB:.1f} GiB of CPU memory per node, the pool has "
                          f"{capacity.cpu_memory_bytes_per_node / GIB:.1f} GiB")  # fmt: skip
    if memory.per_node.nvme > capacity.nvme_bytes_per_node:
        host_short.append(f"{memory.per_node.nvme / GIB:.1f} GiB of NVMe per node, the pool has "
                          f"{capacity.nvme_bytes_per_node / GIB:.1f} GiB")  # fmt: skip
    if host_short:
        advice.append(f"it needs {gap / GIB:.1f} GiB more per GPU, and its host also falls short: needs "
                      + "; ".join(host_short))  # fmt: skip
    else:
        fitting_gib = math.ceil((gpu.total + 1) / headroom / GIB)
        advice.append(f"it needs {gap / GIB:.1f} GiB more per GPU: a GPU with at least {fitting_gib} GiB would fit it")

    phases = memory.phases
    sequence = spec.training.sequence_length
    if (
        phases is not None
        and memory.binding == StepPhase.FORWARD_BACKWARD
        and phases.forward_backward.activations > gap
        and phases.optimizer_step.total <= limit
        and sequence > LONG_SEQUENCE
    ):
        activations = f"activations take {phases.forward_backward.activations / GIB:.1f} GiB"
        micro = spec.strategy.micro_batch_size
        shorter = "a shorter sequence" + (
            f" or a smaller strategy.microBatchSize (pinned at {micro})" if micro and micro > 1 else ""
        )
        if strategy.gradient_checkpointing:
            advice.append(f"{activations} even with gradient checkpointing at sequenceLength {sequence}: "
                          f"{shorter} shrinks them")  # fmt: skip
        else:
            unpin = " (unpin strategy.gradientCheckpointing)" if spec.strategy.gradient_checkpointing is False else ""
            advice.append(f"{activations} at sequenceLength {sequence}: gradient checkpointing{unpin} or "
                          f"{shorter} shrinks them")  # fmt: skip
    states = gpu.parameters + gpu.gradients + gpu.optimizer_states
    most = max_gpus_for(spec, capacity)
    if states > gap and strategy.zero_stage == 3 and strategy.gpus == most:
        advice.append(
            "more GPUs: ZeRO-3 divides weights, gradients and optimizer states by the GPU count, and this job "
            f"uses at most {most} of pool {strategy.pool}: {_more_gpus_limit(spec, capacity, most)}"
        )
    advice += _pinned_offload(spec, nearest, gap)
    return advice


def _host_line(spec: FineTuneJobSpec, miss: Miss, gpu_fits: bool) -> str:
    """The host memory the nearest miss lacks, and what would give it more."""
    strategy, pinned = miss.candidate.strategy, spec.strategy
    than_gpu = " (the GPU memory would do)" if gpu_fits else ", even more than the GPU memory"
    if miss.shortfall == Shortfall.NVME:
        line = f"the host's NVMe falls short{than_gpu}: more NVMe per node (nvmeGiBPerNode)"
    else:
        line = f"the host's CPU memory falls short{than_gpu}: more CPU memory per node (cpuMemoryGiBPerNode)"
        if (
            strategy.method == Method.FULL
            and pinned.zero_stage in (None, 3)
            and pinned.offload_optimizer in (None, Offload.NVME)
        ):
            line += ", or NVMe per node (nvmeGiBPerNode) for ZeRO-3 to move optimizer states to"
    if strategy.zero_stage == 3:
        line += ", or more nodes (ZeRO-3 divides the offloaded states between them)"
    return line


def _more_gpus_limit(spec: FineTuneJobSpec, capacity: PoolCapacity, most: int) -> str:
    """What keeps the job from using more than ``most`` GPUs of ``capacity``."""
    batch, max_gpus = spec.training.global_batch_size, spec.resources.max_gpus
    larger = [n * g for n, g in layouts(capacity, None, batch) if n * g > most]
    if larger and max_gpus is not None:
        return f"resources.maxGPUs {max_gpus} caps it (raise it)"
    if capacity.gpus_per_node * capacity.nodes > most:
        return f"no larger GPU count of the pool divides globalBatchSize {batch}"
    return f"the pool has {most} GPU{'s' if most > 1 else ''} (add nodes)"


def _pinned_offload(spec: FineTuneJobSpec, nearest: RejectedCandidate, gap: int) -> list[str]:
    """Pins that kept the planner from offloading states it would otherwise have moved to the host."""
    pinned, strategy, gpu = spec.strategy, nearest.strategy, nearest.memory.per_gpu
    advice = []
    if strategy.method == Method.FULL and strategy.offload_optimizer == Offload.NONE and gpu.optimizer_states > 0:
        if pinned.zero_stage == 0:
            advice.append("strategy.zeroStage 0 is pinned: offloading optimizer states to the host needs ZeRO 1-3")
        elif pinned.offload_optimizer == Offload.NONE:
            advice.append(
                "strategy.offloadOptimizer none is pinned: unpinned, the planner can move optimizer states to "
                "CPU memory or NVMe"
            )
    if (
        strategy.method != Method.QLORA
        and pinned.zero_stage is not None
        and pinned.zero_stage != 3
        and gpu.parameters > gap
    ):
        advice.append(f"strategy.zeroStage {pinned.zero_stage} is pinned: partitioning or offloading the weights "
                      "needs ZeRO-3")  # fmt: skip
    return advice


METHOD_ORDER = ("full", "lora", "qlora")


def _untried_lines(untried: Collection[Untried]) -> list[str]:
    """One line per cause and set of pools: which methods and pools it kept the search from trying."""
    pools_of: dict[tuple[str | None, str], set[str] | None] = {}  # (method, cause) -> pools; None: every pool
    for item in untried:
        key = (item.method, item.cause)
        if item.pool is None:
            pools_of[key] = None
        elif key in pools_of:
            known = pools_of[key]
            if known is not None:
                known.add(item.pool)
        else:
            pools_of[key] = {item.pool}
    methods_of: dict[tuple[str, tuple[str, ...] | None], list[str | None]] = {}
    for (method, cause), pools in pools_of.items():
        if method is not None and (None, cause) in pools_of:
            every_method = pools_of[(None, cause)]
            if every_method is None or (pools is not None and pools <= every_method):
                continue  # said for every method
        names = tuple(sorted(pools)) if pools is not None else None
        methods_of.setdefault((cause, names), []).append(method)
    lines = []
    for (cause, names), methods in sorted(methods_of.items(), key=lambda item: (item[0][0], item[0][1] or ())):
        named = sorted((m for m in methods if m is not None), key=METHOD_ORDER.index)
        parts = []
        if named:
            listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
            parts.append(("method " if len(named) == 1 else "methods ") + listed)
        if names is not None:
            parts.append(("pool " if len(names) == 1 else "pools ") + ", ".join(names))
        subject = " on ".join(parts) or "no strategy"
        verb = "were" if len(named) > 1 else "was"
        lines.append(f"{subject} {verb} not tried: {cause}")
    return lines
