"""The planner: every way to run a job on the declared pools, the ones that fit, and the fastest.

Search space: pool x layout (nodes x GPUs per node) x method x ZeRO stage x offload x checkpointing x
micro-batch. Model states do not depend on the micro-batch and activations do not depend on the
layout, so both are cached; for each combination of the other knobs only the largest micro-batch
that fits is kept (a bigger micro-batch never runs slower), which keeps a 10-pool search in
milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from memfit.api.finetunejob import FineTuneJobSpec, Method, Offload, Optimizer, Precision
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.plan import PlanCandidate, PlanMemory, PlanResult, PlanStrategy, RejectedCandidate
from memfit.memory.activations import estimate_activations
from memfit.memory.estimate import LoraSettings, activation_setup, estimate_memory
from memfit.memory.states import model_states, trainable_split
from memfit.model_shape import ModelShape
from memfit.planner.advice import advise
from memfit.planner.throughput import estimate_throughput

GIB = 1024**3
METHOD_FIDELITY = {"full": 0, "lora": 1, "qlora": 2}
"""auto prefers the method that changes the model least: full, then LoRA, then QLoRA."""
MAX_CANDIDATES = 50
"""Feasible candidates kept in a result (fastest first); the rest are counted in the advice."""


class PlanningError(ValueError):
    """The request cannot be planned at all (e.g. a pool it names does not exist)."""


@dataclass
class _Search:
    """The fixed inputs of one planning run and its caches."""

    spec: FineTuneJobSpec
    shape: ModelShape
    lora: LoraSettings
    exclude: Collection[str]
    fits: list[PlanCandidate] = field(default_factory=list)
    nearest_misses: dict[tuple[str, int, int, str], tuple[float, RejectedCandidate]] = field(default_factory=dict)

    @property
    def sequence_length(self) -> int:
        return self.spec.training.sequence_length


def plan_job(spec: FineTuneJobSpec, pools: Sequence[GPUPool], exclude: Collection[str] = ()) -> PlanResult:
    """Plan ``spec`` on ``pools``; ``exclude`` holds strategy summaries known to fail (after an OOM)."""
    started = time.perf_counter()
    shape = spec.model.architecture.shape()
    lora = LoraSettings(spec.lora.rank, tuple(spec.lora.target_modules), spec.lora.dropout > 0)
    search = _Search(spec, shape, lora, frozenset(exclude))
    for capacity in _selected_pools(spec, pools):
        _search_pool(search, capacity)

    ranked = sorted(
        search.fits, key=lambda c: (METHOD_FIDELITY[c.strategy.method], -c.throughput.tokens_per_second)
    )
    misses = [rejected for _, rejected in sorted(search.nearest_misses.values(), key=lambda m: m[0])]
    chosen = ranked[0] if ranked else None
    return PlanResult(
        chosen=chosen,
        candidates=ranked[:MAX_CANDIDATES],
        rejected=misses,
        planning_seconds=round(time.perf_counter() - started, 6),
        advice=[] if chosen else advise(spec, shape, misses, pools),
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


def _methods(spec: FineTuneJobSpec) -> list[str]:
    if spec.method is Method.AUTO:
        return ["full", "lora", "qlora"]
    return [spec.method.value]


def _precisions(spec: FineTuneJobSpec, capacity: PoolCapacity) -> list[str]:
    pinned = spec.training.precision
    if pinned is Precision.AUTO:
        return ["bf16" if capacity.bf16 else "fp16"]
    if pinned is Precision.BF16 and not capacity.bf16:
        return []  # the GPU cannot run it; reported by advise() if nothing else fits
    return [pinned.value]


def _zero_options(spec: FineTuneJobSpec, method: str, capacity: PoolCapacity) -> Iterator[tuple[int, str, str]]:
    """(stage, optimizer offload, parameter offload) combinations DeepSpeed supports for ``method``."""
    pinned = spec.strategy
    stages = [pinned.zero_stage] if pinned.zero_stage is not None else [0, 1, 2, 3]
    devices = ["none", "cpu"] + (["nvme"] if capacity.nvme_bytes_per_node else [])
    eight_bit = spec.training.optimizer in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
    for stage in stages:
        if method == "qlora" and stage == 3:
            continue
        for opt in _pinned_or(pinned.offload_optimizer, devices):
            # Offload needs ZeRO; adapters' states are too small to be worth moving; 8-bit states stay on GPU.
            if opt != "none" and (stage == 0 or (method != "full" and pinned.offload_optimizer is None) or eight_bit):
                continue
            for params in _pinned_or(pinned.offload_parameters, devices if stage == 3 else ["none"]):
                if method == "qlora" and params != "none":
                    continue
                yield stage, opt, params


def _pinned_or(pinned: Offload | None, options: list[str]) -> list[str]:
    return [pinned.value] if pinned is not None else options


def _micro_batches(spec: FineTuneJobSpec, per_gpu_batch: int) -> list[int]:
    """Largest first: divisors of the per-GPU batch (accumulation makes up the rest)."""
    pinned = spec.strategy.micro_batch_size
    if pinned is not None:
        return [pinned] if per_gpu_batch % pinned == 0 else []
    return [b for b in range(per_gpu_batch, 0, -1) if per_gpu_batch % b == 0]


def _search_pool(search: _Search, capacity: PoolCapacity) -> None:
    spec = search.spec
    limit = int(capacity.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100))
    attention = (spec.strategy.attention.value if spec.strategy.attention else "sdpa")
    checkpointing = (
        [spec.strategy.gradient_checkpointing] if spec.strategy.gradient_checkpointing is not None else [False, True]
    )
    for nodes, per_node in layouts(capacity, spec.resources.max_gpus, spec.training.global_batch_size):
        per_gpu_batch = spec.training.global_batch_size // (nodes * per_node)
        for precision in _precisions(spec, capacity):
            for method in _methods(spec):
                for stage, opt, params in _zero_options(spec, method, capacity):
                    for ckpt in checkpointing:
                        template = PlanStrategy.model_construct(
                            method=method, pool=capacity.name, nodes=nodes, gpus_per_node=per_node,
                            zero_stage=stage, offload_optimizer=opt, offload_parameters=params,
                            gradient_checkpointing=ckpt, micro_batch_size=1, gradient_accumulation_steps=1,
                            precision=precision, optimizer=spec.training.optimizer.value, attention=attention,
                        )  # fmt: skip
                        _largest_fitting_micro_batch(search, capacity, limit, template, per_gpu_batch)


def _largest_fitting_micro_batch(
    search: _Search, capacity: PoolCapacity, limit: int, template: PlanStrategy, per_gpu_batch: int
) -> None:
    shape, lora = search.shape, search.lora
    states = _cached_states(shape, template.method, template.zero_stage, template.offload_optimizer,
                            template.offload_parameters, template.gpus, template.precision, template.optimizer,
                            lora)  # fmt: skip
    trainable = trainable_split(shape, template.method, lora.rank, lora.targets).trainable
    total = shape.parameter_count
    miss: tuple[float, PlanStrategy, PlanMemory, str] | None = None
    for micro in _micro_batches(search.spec, per_gpu_batch):
        strategy = template.model_copy(
            update={"micro_batch_size": micro, "gradient_accumulation_steps": per_gpu_batch // micro}
        )
        if strategy.summary() in search.exclude:
            miss = (float("inf"), strategy, _memory(search, strategy, states), "excluded: it ran out of memory before")
            continue
        memory = _memory(search, strategy, states)
        ratio, reason = _shortfall(memory, limit, capacity)
        if reason is None:
            search.fits.append(_candidate(PlanCandidate, search, strategy, memory, capacity, trainable, total))
            return
        miss = (ratio, strategy, memory, reason)
    if miss is None:
        return
    ratio, strategy, memory, reason = miss
    key = (capacity.name, template.nodes, template.gpus_per_node, template.method)
    best = search.nearest_misses.get(key)
    if best is None or ratio < best[0]:
        rejected = _candidate(RejectedCandidate, search, strategy, memory, capacity, trainable, total, reason=reason)
        search.nearest_misses[key] = (ratio, rejected)


def _memory(search: _Search, strategy: PlanStrategy, states: object) -> PlanMemory:
    activations = _cached_activations(search.shape, strategy.method, strategy.precision,
                                      strategy.gradient_checkpointing, strategy.micro_batch_size,
                                      search.sequence_length, strategy.attention, search.lora)  # fmt: skip
    return estimate_memory(search.shape, strategy, search.sequence_length, search.lora, states, activations)  # type: ignore[arg-type]


def _candidate(cls, search: _Search, strategy, memory, capacity, trainable: int, total: int, **extra):  # type: ignore[no-untyped-def]
    throughput = estimate_throughput(search.shape, strategy, capacity, search.sequence_length, trainable)
    return cls.model_construct(
        strategy=strategy,
        parameter_count=total,
        trainable_parameter_count=trainable,
        memory=memory,
        gpu_memory_bytes=capacity.gpu_memory_bytes,
        fits=cls is PlanCandidate,
        throughput=throughput,
        **extra,
    )


def _shortfall(memory: PlanMemory, limit: int, capacity: PoolCapacity) -> tuple[float, str | None]:
    """How far over its limits the plan is (max ratio), and the reason, or None when it fits."""
    gpu, node = memory.per_gpu.total, memory.per_node
    checks = [
        (gpu / limit, f"GPU memory: needs {gpu / GIB:.1f} GiB per GPU, {limit / GIB:.1f} GiB usable "
                      f"({capacity.gpu_memory_bytes / GIB:.1f} GiB less headroom)"),
        (node.cpu / capacity.cpu_memory_bytes_per_node,
         f"CPU memory: needs {node.cpu / GIB:.1f} GiB per node, the pool has {capacity.cpu_memory_bytes_per_node / GIB:.1f} GiB"),
        (node.nvme / capacity.nvme_bytes_per_node if capacity.nvme_bytes_per_node else (float("inf") if node.nvme else 0.0),
         f"NVMe: needs {node.nvme / GIB:.1f} GiB per node, the pool has {capacity.nvme_bytes_per_node / GIB:.1f} GiB"),
    ]  # fmt: skip
    worst_ratio, worst_reason = max(checks, key=lambda check: check[0])
    return worst_ratio, (worst_reason if worst_ratio > 1 else None)


@lru_cache(maxsize=4096)
def _cached_states(shape, method, stage, opt, params, gpus, precision, optimizer, lora):  # type: ignore[no-untyped-def]
    strategy = PlanStrategy.model_construct(
        method=method, zero_stage=stage, offload_optimizer=opt, offload_parameters=params, nodes=1,
        gpus_per_node=gpus, precision=precision, optimizer=optimizer,
    )  # fmt: skip
    return model_states(shape, strategy, lora.rank, lora.targets)


@lru_cache(maxsize=4096)
def _cached_activations(shape, method, precision, ckpt, micro, sequence_length, attention, lora):  # type: ignore[no-untyped-def]
    strategy = PlanStrategy.model_construct(
        method=method, precision=precision, gradient_checkpointing=ckpt, micro_batch_size=micro, attention=attention
    )
    return estimate_activations(shape, activation_setup(shape, strategy, sequence_length, lora))
