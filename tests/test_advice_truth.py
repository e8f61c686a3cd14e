"""Every advice line of `memfit plan` is true of the job and the pools it was given.

Each scenario plans a job that does not fit; every line of its advice must be recognised by one of the
claims below, and the claim is then checked against the inputs (the spec, the pools, and the planner's
own nearest miss, whose numbers the lines quote). A line no claim recognises fails the test, so a new kind
of advice comes with the check of its truth.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, PoolCapacity, pool_capacity
from memfit.api.plan import PlanCandidate, PlanResult, RejectedCandidate
from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Method, StepPhase
from memfit.planner.defaults import DEFAULT_CHANGES
from memfit.planner.search import plan_job
from memfit.units import GIB
from tests.planning_fixtures import A100_NODE, RTX_4090, RTX_4090_BIG_HOST, V100_NODE, job, pool, unvalidated_job

T4_ONE = pool("t4", "Tesla-T4", 1, 1, 64)
T4 = pool("t4", "Tesla-T4", 4, 2, 180)
L4 = pool("l4", "NVIDIA-L4", 1, 4, 60)
ONE_L4_BIG_HOST = pool("l4", "NVIDIA-L4", 1, 1, 1000)
A100_SMALL_NVME = pool("a100-nvme", "NVIDIA-A100-SXM4-80GB", 8, 1, 1000, 50)
METHODS = ("full", "lora", "qlora")
WHOLE_SEQUENCES = {"sequenceParallel": 1, "tiledMlp": False}
"""Pinned where a scenario needs a long sequence not to fit (split over GPUs, or with the tiled MLP, it does)."""


@dataclass
class Case:
    spec: FineTuneJobSpec
    pools: list[GPUPool]
    exclude: tuple[str, ...] = ()

    def plan(self, **changes: Any) -> PlanResult:
        spec = self.spec.model_copy(update=changes) if changes else self.spec
        return plan_job(spec, self.pools, exclude=self.exclude)


def single_plan_case() -> Case:
    """A job with exactly one strategy to try, which fits but ran out of memory before."""
    spec = job(
        "qwen2.5-0.5b",
        "full",
        batch=1,
        sequence=256,
        strategy={"zeroStage": 0, "gradientCheckpointing": False, "chunkedLoss": False, "tiledMlp": False},
    )
    only = plan_job(spec, [T4_ONE]).chosen
    assert only is not None
    return Case(spec, [T4_ONE], exclude=(only.strategy.identity(),))


SCENARIOS: dict[str, Callable[[], Case]] = {
    # The issue's case: a pinned bf16 on a T4, globalBatchSize 8, one GPU.
    "bf16 pinned on a T4": lambda: Case(
        job("llama-2-7b", batch=8, training={"globalBatchSize": 8, "precision": "bf16"}), [T4_ONE]
    ),
    "bf16 pinned on T4s and a 4090": lambda: Case(
        job("llama-2-70b", "full", batch=64, training={"globalBatchSize": 64, "precision": "bf16"}), [T4, RTX_4090]
    ),
    "qlora on V100s, batch 64": lambda: Case(job("llama-2-13b", "qlora", batch=64), [V100_NODE]),
    "qlora pinned to fp16": lambda: Case(
        unvalidated_job("llama-2-7b", "qlora", batch=64, training={"precision": "fp16"}), [A100_NODE]
    ),
    "qlora with parameter offload on deepspeed": lambda: Case(
        unvalidated_job("llama-2-7b", "qlora", batch=64, strategy={"offloadParameters": "cpu", "engine": "deepspeed"}),
        [A100_NODE],
    ),
    "70b full on T4s": lambda: Case(job("llama-2-70b", "full", batch=64), [T4]),
    "70b full on L4s with a small host": lambda: Case(job("llama-3.1-70b", "full"), [L4]),
    "13b full at ZeRO-0 on one L4": lambda: Case(
        job("llama-2-13b", "full", strategy={"zeroStage": 0}), [ONE_L4_BIG_HOST]
    ),
    "long sequence, checkpointing pinned off": lambda: Case(
        job(
            "llama-3.1-8b",
            "full",
            batch=8,
            sequence=32768,
            strategy={"zeroStage": 3, "gradientCheckpointing": False, **WHOLE_SEQUENCES},
        ),
        [A100_NODE],
    ),  # fmt: skip
    "very long sequence": lambda: Case(
        job("llama-3.1-8b", "full", batch=8, sequence=262144, strategy={"zeroStage": 3, **WHOLE_SEQUENCES}), [A100_NODE]
    ),
    "large pinned micro-batch": lambda: Case(
        job("llama-2-70b", "full", batch=64, strategy={"microBatchSize": 64, "sequenceParallel": 1}), [A100_NODE]
    ),
    "70b full on 8 V100s": lambda: Case(job("llama-2-70b", "full", batch=64, resources={"maxGPUs": 8}), [V100_NODE]),
    "70b full on 8 V100s, maxGPUs 2": lambda: Case(
        job("llama-2-70b", "full", batch=64, resources={"maxGPUs": 2}, strategy={"offloadOptimizer": "none"}),
        [V100_NODE],
    ),
    "70b lora on a 4090": lambda: Case(job("llama-2-70b", "lora", batch=64), [RTX_4090]),
    "optimizer offload pinned off": lambda: Case(
        job("llama-2-13b", "full", batch=64, strategy={"offloadOptimizer": "none"}), [RTX_4090_BIG_HOST]
    ),
    "ZeRO-2 pinned": lambda: Case(job("llama-2-70b", "full", batch=64, strategy={"zeroStage": 2}), [A100_NODE]),
    "optimizer offload pinned without ZeRO": lambda: Case(
        unvalidated_job("llama-2-7b", "full", batch=16, strategy={"offloadOptimizer": "cpu", "zeroStage": 0}),
        [A100_NODE],
    ),
    "qlora with the optimizer on NVMe": lambda: Case(
        unvalidated_job("llama-2-7b", "qlora", strategy={"offloadOptimizer": "nvme"}), [A100_NODE]
    ),
    "NVMe pinned on a small NVMe": lambda: Case(
        job("llama-2-70b", "full", batch=64, strategy={"offloadOptimizer": "nvme", "offloadParameters": "nvme"}),
        [A100_SMALL_NVME],
    ),
    "the only plan ran out of memory before": single_plan_case,
    # torchtune's 8B full fine-tune on a 24 GB card, with memfit's default gradient clipping.
    "8b full with paged 8-bit AdamW on a 24 GB card": lambda: Case(
        job(
            "llama-3.1-8b",
            "full",
            training={"globalBatchSize": 2, "sequenceLength": 2048, "optimizer": "paged_adamw8bit"},
        ),
        [RTX_4090],
    ),
    "3b full with the optimizer on a 24 GB card": lambda: Case(
        job(
            "llama-3.2-3b",
            "full",
            training={"globalBatchSize": 8, "sequenceLength": 2048},
            strategy={"offloadOptimizer": "none", "offloadParameters": "none"},
        ),
        [RTX_4090],
    ),  # fmt: skip
}


# ------------------------------------------------------------------------------------------------
# What the inputs say, computed here independently of the planner's code
# ------------------------------------------------------------------------------------------------


def capacity(case: Case, name: str) -> PoolCapacity:
    return next(pool_capacity(p) for p in case.pools if p.metadata.name == name)


def gpu_counts(spec: FineTuneJobSpec, cap: PoolCapacity, *, capped: bool = True) -> list[int]:
    """GPU counts the planner's documented layouts give: part of a node in powers of two, or whole nodes;
    at most resources.maxGPUs (when ``capped``), dividing the global batch."""
    counts = [g for g in (1, 2, 4, 8, 16) if g < cap.gpus_per_node]
    counts += [n * cap.gpus_per_node for n in range(1, cap.nodes + 1)]
    limit = spec.resources.max_gpus if capped else None
    return [c for c in counts if (limit is None or c <= limit) and spec.training.global_batch_size % c == 0]


def limit_of(case: Case, candidate: PlanCandidate) -> int:
    return int(candidate.gpu_memory_bytes * (1 - case.spec.resources.memory_headroom_percent / 100))


def tried(result: PlanResult, method: str | None, pools: list[str] | None) -> bool:
    return any(
        (method is None or c.strategy.method == method) and (pools is None or c.strategy.pool in pools)
        for c in [*result.candidates, *result.rejected]
    )


def states(candidate: PlanCandidate) -> int:
    gpu = candidate.memory.per_gpu
    return gpu.parameters + gpu.gradients + gpu.optimizer_states


# ------------------------------------------------------------------------------------------------
# The claims: each recognises its lines and says whether the line is true
# ------------------------------------------------------------------------------------------------

Check = Callable[[re.Match[str], Case, PlanResult], bool]
CLAIMS: list[tuple[re.Pattern[str], Check]] = []


def claim(pattern: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        CLAIMS.append((re.compile(pattern), check))
        return check

    return register


def nearest(result: PlanResult) -> RejectedCandidate:
    assert result.chosen is None and result.rejected
    return result.rejected[0]


@claim(r"nearest miss: (?P<summary>.+?) \((?P<reason>.+)\)$")
def _nearest_miss(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    return m["summary"] == miss.strategy.summary() and m["reason"] == miss.reason and not miss.fits


@claim(r"no candidate estimated to fit is left: each one ran out of memory before \(status\.excludedStrategies\)$")
def _all_excluded(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    unexcluded = plan_job(case.spec, case.pools)
    excluded = set(case.exclude)
    return (
        result.chosen is None
        and all(r.reason.startswith("excluded") for r in result.rejected)
        and all(c.strategy.identity() in excluded for c in unexcluded.candidates)
    )


@claim(
    r"the host's CPU memory falls short(?:(?P<gpu_fits> \(the GPU memory would do\))|, even more than the GPU memory): "
    r"more CPU memory per node \(cpuMemoryGiBPerNode\)"
    r"(?P<nvme>, or NVMe per node \(nvmeGiBPerNode\) for ZeRO-3 to move optimizer states to)?"
    r"(?P<nodes>, or more nodes \(ZeRO-3 divides the offloaded states between them\))?$"
)
def _host_cpu(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss, pinned = nearest(result), case.spec.strategy
    cap = capacity(case, miss.strategy.pool)
    nvme_possible = (
        miss.strategy.method == "full" and pinned.zero_stage in (None, 3) and pinned.offload_optimizer in (None, "nvme")
    )
    gpu_over, cpu_over = (
        miss.memory.per_gpu.total / limit_of(case, miss),
        miss.memory.per_node.cpu / cap.cpu_memory_bytes_per_node,
    )
    return (
        cpu_over > 1
        and (gpu_over <= 1 if m["gpu_fits"] else 1 < gpu_over < cpu_over)
        and bool(m["nvme"]) == nvme_possible
        and bool(m["nodes"]) == (miss.strategy.zero_stage == 3)
    )


@claim(
    r"the host's NVMe falls short(?:(?P<gpu_fits> \(the GPU memory would do\))|, even more than the GPU memory): "
    r"more NVMe per node \(nvmeGiBPerNode\)"
    r"(?P<nodes>, or more nodes \(ZeRO-3 divides the offloaded states between them\))?$"
)
def _host_nvme(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    cap = capacity(case, miss.strategy.pool)
    gpu_over = miss.memory.per_gpu.total / limit_of(case, miss)
    nvme_over = miss.memory.per_node.nvme / cap.nvme_bytes_per_node if cap.nvme_bytes_per_node else float("inf")
    return (
        nvme_over > 1
        and (gpu_over <= 1 if m["gpu_fits"] else 1 < gpu_over < nvme_over)
        and bool(m["nodes"]) == (miss.strategy.zero_stage == 3)
    )


@claim(r"it also needs (?P<gap>[\d.]+) GiB more per GPU$")
def _also_gpu(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    gap = miss.memory.per_gpu.total - limit_of(case, miss)
    return gap > 0 and abs(float(m["gap"]) - gap / GIB) < 0.051 and not miss.reason.startswith("GPU")


@claim(
    r"method (?P<method>lora|qlora) \(adapters on a frozen base\) would fit: (?P<summary>.+) "
    r"\((?P<speed>[\d,]+) tokens/s est\.\)$"
)
def _lighter_fits(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    method = case.spec.method
    if method not in ("full", "lora") or METHODS.index(m["method"]) <= METHODS.index(method):
        return False
    chosen = case.plan(method=Method(m["method"])).chosen
    return (
        chosen is not None
        and chosen.strategy.summary() == m["summary"]
        and f"{chosen.throughput.tokens_per_second:,.0f}" == m["speed"]
    )


@claim(r"method (?P<method>lora|qlora) does not fit either: (?P<summary>.+?) \((?P<reason>.+)\)$")
def _lighter_misses(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    method = case.spec.method
    if method not in ("full", "lora") or METHODS.index(m["method"]) <= METHODS.index(method):
        return False
    other = case.plan(method=Method(m["method"]))
    return (
        other.chosen is None
        and other.rejected[0].strategy.summary() == m["summary"]
        and other.rejected[0].reason == m["reason"]
    )


SPLITTING_KNOBS = {"strategy.sequenceParallel": "sequence_parallel", "strategy.tiledMlp": "tiled_mlp"}


@claim(
    r"unpinned, (?P<knobs>strategy\.\w+(?: and strategy\.\w+)?) would fit it: (?P<summary>.+?) "
    r"\((?P<speed>[\d,]+) tokens/s est\.\)$"
)
def _unpinned_splits(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    """Each named knob is pinned (off, or at a degree); with them left to the planner the job fits, on the quoted
    plan, which sets each of them otherwise."""
    names = [SPLITTING_KNOBS[knob] for knob in m["knobs"].split(" and ")]
    pinned = case.spec.strategy
    if any(getattr(pinned, name) is None or getattr(pinned, name) is True for name in names):
        return False
    chosen = case.plan(strategy=pinned.model_copy(update=dict.fromkeys(names))).chosen
    return (
        chosen is not None
        and chosen.strategy.summary() == m["summary"]
        and f"{chosen.throughput.tokens_per_second:,.0f}" == m["speed"]
        and all(getattr(chosen.strategy, name) != getattr(pinned, name) for name in names)
    )


SETTINGS = {change.setting: change for change in DEFAULT_CHANGES}


@claim(r"with (?P<setting>[\w.]+: \w+) \([^)]+\) it fits: (?P<summary>.+?) \((?P<speed>[\d,]+) tokens/s est\.\)$")
def _changed_default(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    """The job leaves the setting at its default, and with it changed (nothing else) the job fits, on the quoted
    plan."""
    change = SETTINGS[m["setting"]]
    section = getattr(case.spec, change.section)
    if getattr(section, change.field) != type(section).model_fields[change.field].default:
        return False
    chosen = case.plan(**{change.section: section.model_copy(update={change.field: change.value})}).chosen
    return (
        chosen is not None
        and chosen.strategy.summary() == m["summary"]
        and f"{chosen.throughput.tokens_per_second:,.0f}" == m["speed"]
    )


def test_the_advice_names_the_default_that_blocks_the_fit() -> None:
    """torchtune fits Llama-3.1-8B's full fine-tune on a 24 GB card with the optimizer step in backward, which
    gradient clipping (memfit's default) rules out: the advice says so."""
    advice = SCENARIOS["8b full with paged 8-bit AdamW on a 24 GB card"]().plan().advice
    assert any(line.startswith("with training.maxGradNorm: 0 (") and "opt-in-bwd" in line for line in advice)
    advice = SCENARIOS["3b full with the optimizer on a 24 GB card"]().plan().advice
    assert any(line.startswith("with training.optimizer: adamw8bit (") for line in advice)


@claim(r"it needs (?P<gap>[\d.]+) GiB more per GPU: a GPU with at least (?P<gib>\d+) GiB would fit it$")
def _bigger_gpu(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    cap = capacity(case, miss.strategy.pool)
    total, headroom = miss.memory.per_gpu.total, 1 - case.spec.resources.memory_headroom_percent / 100
    gib = int(m["gib"])
    return (
        abs(float(m["gap"]) - (total - limit_of(case, miss)) / GIB) < 0.051
        and int(gib * GIB * headroom) >= total > int((gib - 1) * GIB * headroom)  # "at least": the smallest
        and miss.memory.per_node.cpu <= cap.cpu_memory_bytes_per_node
        and miss.memory.per_node.nvme <= cap.nvme_bytes_per_node
    )


@claim(r"it needs (?P<gap>[\d.]+) GiB more per GPU, and its host also falls short: needs (?P<host>.+)$")
def _bigger_gpu_and_host(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    cap = capacity(case, miss.strategy.pool)
    cpu_short = miss.memory.per_node.cpu > cap.cpu_memory_bytes_per_node
    nvme_short = miss.memory.per_node.nvme > cap.nvme_bytes_per_node
    return (
        abs(float(m["gap"]) - (miss.memory.per_gpu.total - limit_of(case, miss)) / GIB) < 0.051
        and (cpu_short or nvme_short)
        and ("CPU memory" in m["host"]) == cpu_short
        and ("NVMe" in m["host"]) == nvme_short
    )


@claim(
    r"activations take (?P<gib>[\d.]+) GiB(?P<even> even with gradient checkpointing)? at sequenceLength "
    r"(?P<sequence>\d+): (?P<ckpt>gradient checkpointing(?P<unpin> \(unpin strategy\.gradientCheckpointing\))? or )?"
    r"a shorter sequence(?: or a smaller strategy\.microBatchSize \(pinned at (?P<micro>\d+)\))? shrinks them$"
)
def _activations(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    phases, limit = miss.memory.phases, limit_of(case, miss)
    assert phases is not None
    pinned = case.spec.strategy
    return (
        miss.memory.binding == StepPhase.FORWARD_BACKWARD
        and abs(float(m["gib"]) - phases.forward_backward.activations / GIB) < 0.051
        # Shrinking them can close the gap: they exceed it, and the optimizer step alone fits.
        and phases.forward_backward.activations > miss.memory.per_gpu.total - limit
        and phases.optimizer_step.total <= limit
        and int(m["sequence"]) == case.spec.training.sequence_length
        and bool(m["even"]) == miss.strategy.gradient_checkpointing
        and bool(m["ckpt"]) == (not miss.strategy.gradient_checkpointing)
        and bool(m["unpin"]) == (pinned.gradient_checkpointing is False)
        and (m["micro"] is None) == (pinned.micro_batch_size in (None, 1))
        and (m["micro"] is None or int(m["micro"]) == pinned.micro_batch_size)
    )


@claim(
    r"more GPUs: ZeRO-3 divides weights, gradients and optimizer states by the GPU count, and this job uses at most "
    r"(?P<most>\d+) of pool (?P<pool>\S+): (?P<why>.+)$"
)
def _more_gpus(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss, spec = nearest(result), case.spec
    cap = capacity(case, m["pool"])
    most = int(m["most"])
    if not (miss.strategy.zero_stage == 3 and miss.strategy.pool == m["pool"] and miss.strategy.gpus == most):
        return False
    if most != max(gpu_counts(spec, cap)):
        return False
    uncapped_more = [c for c in gpu_counts(spec, cap, capped=False) if c > most]
    why = m["why"]
    if why.startswith("resources.maxGPUs"):
        return bool(uncapped_more) and why == f"resources.maxGPUs {spec.resources.max_gpus} caps it (raise it)"
    if why.startswith("no larger GPU count"):
        return not uncapped_more and cap.gpus_per_node * cap.nodes > most
    return why.startswith(f"the pool has {most} GPU") and cap.gpus_per_node * cap.nodes == most


@claim(r"strategy\.zeroStage 0 is pinned: offloading optimizer states to the host needs ZeRO 1-3$")
def _zero0_pinned(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    return case.spec.strategy.zero_stage == 0 and miss.memory.per_gpu.optimizer_states > 0


@claim(
    r"strategy\.offloadOptimizer none is pinned: unpinned, the planner can move optimizer states to CPU memory or NVMe$"
)
def _offload_pinned_off(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    return (
        case.spec.strategy.offload_optimizer == "none"
        and miss.strategy.method == "full"
        and miss.memory.per_gpu.optimizer_states > 0
        and case.spec.training.optimizer not in EIGHT_BIT_OPTIMIZERS
    )


@claim(r"strategy\.zeroStage (?P<stage>\d) is pinned: partitioning or offloading the weights needs ZeRO-3$")
def _stage_pinned(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    miss = nearest(result)
    stage = int(m["stage"])
    return (
        case.spec.strategy.zero_stage == stage != 3
        and miss.strategy.method != "qlora"
        and miss.memory.per_gpu.parameters > miss.memory.per_gpu.total - limit_of(case, miss)
    )


UNTRIED = (
    r"(?:methods? (?P<methods>[a-z]+(?:(?:, | and )[a-z]+)*)(?: on (?P<pools>pools? [\w\-, ]+))?"
    r"|(?P<only_pools>pools? [\w\-, ]+)) (?:was|were) not tried: "
)


def untried_subject(m: re.Match[str], case: Case, result: PlanResult) -> tuple[list[str], list[str] | None]:
    """The methods (none: every one) and pools (None: every one) the line says were not tried; asserts
    that none was (a method other than the pinned one: in the plan of that method)."""
    names = m["pools"] or m["only_pools"]
    pools = names.split(" ", 1)[1].split(", ") if names else None
    methods = re.split(r", | and ", m["methods"]) if m["methods"] else []
    for method in methods or [None]:
        pinned = case.spec.method
        searched = result if method in (None, pinned) or pinned == "auto" else case.plan(method=Method(method))
        assert not tried(searched, method, pools), f"the line says {method} on {pools} was not tried, but it was"
    return methods, pools


@claim(UNTRIED + r"training\.precision bf16 is pinned, but these GPUs have no bf16 \(use auto or fp16\)$")
def _untried_bf16(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    methods, pools = untried_subject(m, case, result)
    return (
        case.spec.training.precision == "bf16"
        and pools is not None
        and all(not capacity(case, name).bf16 for name in pools)
    )


@claim(UNTRIED + r"qlora computes in bf16 \(the trainer refuses it in fp16 and fp32\), which these GPUs lack$")
def _untried_qlora_gpus(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    methods, pools = untried_subject(m, case, result)
    return methods == ["qlora"] and pools is not None and all(not capacity(case, name).bf16 for name in pools)


CONFLICTS: dict[str, Callable[[FineTuneJobSpec, str], bool]] = {
    r"method qlora computes in bf16 \(the trainer refuses it in (?P<p>fp16|fp32)\): set training\.precision to "
    r"bf16 or auto, on a GPU with bf16": lambda s, m: m == "qlora" and s.training.precision in ("fp16", "fp32"),
    r"method qlora cannot run under DeepSpeed ZeRO-3 \(DeepSpeed does not partition 4-bit weights\); use zeroStage "
    r"0-2, or strategy\.engine fsdp2 \(it shards them\)": (
        lambda s, m: m == "qlora" and s.strategy.zero_stage in (None, 3) and s.strategy.engine == "deepspeed"
    ),
    r"method qlora keeps its 4-bit base on the GPU under DeepSpeed \(parameter offload needs ZeRO-3, which "
    r"DeepSpeed cannot run with qlora\); strategy\.engine fsdp2 offloads it": (
        lambda s, m: (
            m == "qlora" and s.strategy.offload_parameters in ("cpu", "nvme") and s.strategy.engine == "deepspeed"
        )
    ),
    r"strategy\.offloadParameters needs zeroStage 3 \(only ZeRO-3 partitions parameters; DeepSpeed ignores "
    r"parameter offload under ZeRO 0-2\)": lambda s, m: s.strategy.offload_parameters in ("cpu", "nvme"),
    r"strategy\.offloadOptimizer needs zeroStage 1-3 \(DeepSpeed ignores it without ZeRO\)": (
        lambda s, m: s.strategy.offload_optimizer in ("cpu", "nvme") and s.strategy.zero_stage in (None, 0)
    ),
    r"strategy\.offloadOptimizer nvme needs zeroStage 3 \(ZeRO-1 and ZeRO-2 keep offloaded optimizer states in CPU "
    r"memory, whatever the device says\)": (
        lambda s, m: s.strategy.offload_optimizer == "nvme" and s.strategy.zero_stage in (None, 1, 2)
    ),
}
for _pattern, _holds in CONFLICTS.items():

    def _conflict(m: re.Match[str], case: Case, result: PlanResult, holds: Any = _holds) -> bool:
        methods, pools = untried_subject(m, case, result)
        return bool(methods) and pools is None and all(holds(case.spec, method) for method in methods)

    CLAIMS.append((re.compile(UNTRIED + _pattern + "$"), _conflict))


@claim(r"training\.globalBatchSize (?P<batch>\d+) must be divisible by the GPU count")
def _batch_divisible(m: re.Match[str], case: Case, result: PlanResult) -> bool:
    """The line memfit printed before: true only if no pool offers a GPU count that divides the batch."""
    return all(not gpu_counts(case.spec, pool_capacity(p)) for p in case.pools)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.slow
def test_every_advice_line_is_true_of_its_inputs(scenario: str) -> None:
    case = SCENARIOS[scenario]()
    result = case.plan()
    assert result.chosen is None and result.advice
    for line in result.advice:
        matches = [(pattern.match(line), check) for pattern, check in CLAIMS]
        recognised = [(match, check) for match, check in matches if match]
        assert recognised, f"no claim recognises the advice line {line!r}"
        for match, check in recognised:
            assert check(match, case, result), f"{scenario}: false advice: {line!r}"


def test_the_issue_case_says_only_why_nothing_was_tried() -> None:
    result = SCENARIOS["bf16 pinned on a T4"]().plan()
    assert result.advice == [
        "pool t4 was not tried: training.precision bf16 is pinned, but these GPUs have no bf16 (use auto or fp16)"
    ]


def test_a_tried_pool_is_not_reported_untried() -> None:
    result = SCENARIOS["bf16 pinned on T4s and a 4090"]().plan()
    assert result.advice[0].startswith("nearest miss: ") and "rtx" in result.advice[0]
    assert result.advice[-1].startswith("pool t4 was not tried: ")
    assert not any("rtx was not tried" in line for line in result.advice)
