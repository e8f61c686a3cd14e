"""Re-planning after a strategy ran out of memory: the next leaner plan, not merely the next fastest.

An out-of-memory failure says the estimate of the failed plan was short on that GPU. Excluding only that
exact strategy would let the planner pick a sibling with the same footprint (another pool, another GPU
count) that fails the same way, so the re-plan also asks for more headroom: enough that a plan estimated
like the failed one no longer fits, with LEANER_BY to spare. The order the issue of the operator names
falls out of the planner's ranking under that tighter limit: first what keeps the checkpoint layout
(gradient checkpointing, a smaller micro-batch, offload: the same method, precision, ZeRO stage and GPU
count, so the run resumes from its checkpoint), then anything else that fits (a higher ZeRO stage, other
GPU counts, and a lighter method only when the spec says `auto`). After a layout change the trainer resumes
from the last checkpoint converted to the new layout where
:meth:`~memfit.contract.layout.CheckpointLayout.converts_to` says a conversion exists (another ZeRO stage or
GPU count, DeepSpeed to fsdp2), and from the weights where none does (a method or precision change).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.plan import PlanCandidate, PlanResult
from memfit.api.runtime import IMAGE_RUNTIME, Runtime
from memfit.api.vocabulary import Method, Precision
from memfit.contract.layout import CheckpointLayout
from memfit.planned_model import PlannedModel
from memfit.planner.search import plan_job
from memfit.units import GIB

LEANER_BY = 0.10
"""A re-plan's estimated per-GPU memory must be at least this share below the failed plan's estimate
(on a GPU of another size: the same share of that GPU's memory as the failed plan used, less this)."""
MAX_HEADROOM_PERCENT = 89.0
"""The API's bound on memoryHeadroomPercent (below 90)."""


def checkpoint_layout(plan: PlanCandidate) -> CheckpointLayout:
    """What decides whether a checkpoint loads under another plan (shared with the trainer)."""
    return CheckpointLayout.of(plan.strategy)


def leaner_headroom_percent(spec: FineTuneJobSpec, failed: PlanCandidate) -> float:
    """Headroom under which the failed plan's estimate no longer fits, with LEANER_BY to spare."""
    used = failed.memory.per_gpu.total / failed.gpu_memory_bytes
    wanted = 100.0 * (1.0 - used * (1.0 - LEANER_BY))
    return min(MAX_HEADROOM_PERCENT, max(spec.resources.memory_headroom_percent, wanted))


def replan_after_oom(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    failed: PlanCandidate,
    excluded: Collection[str],
    model: PlannedModel | None = None,
    checkpointed: bool = True,
    runtime: Runtime = IMAGE_RUNTIME,
) -> tuple[PlanResult, bool]:
    """The leaner plan after ``failed`` ran out of memory, and whether it keeps the checkpoint layout (``model``:
    the profiled model ``failed`` was planned for, as ``plan_job`` takes it; ``checkpointed``: the failed run
    left a checkpoint, so a plan that resumes from it goes before a faster one that would start over; ``runtime``:
    the trainer's kernel packages)."""
    resources = spec.resources.model_copy(update={"memory_headroom_percent": leaner_headroom_percent(spec, failed)})
    leaner = spec.model_copy(update={"resources": resources})
    strategy = failed.strategy
    same_layout = leaner.model_copy(
        update={
            "method": Method(strategy.method),
            "training": leaner.training.model_copy(update={"precision": Precision(strategy.precision)}),
            "strategy": leaner.strategy.model_copy(update={"zero_stage": strategy.zero_stage}),
            "resources": resources.model_copy(update={"pool": strategy.pool, "max_gpus": strategy.gpus}),
        }
    )
    kept = only_leaner(plan_job(same_layout, pools, excluded, model, runtime), failed)
    if kept.chosen is not None and checkpoint_layout(kept.chosen) == checkpoint_layout(failed):
        return kept, True
    result = only_leaner(plan_job(leaner, pools, excluded, model, runtime), failed)
    if checkpointed:
        result = resuming_first(result, failed)
    return result, result.chosen is not None and checkpoint_layout(result.chosen) == checkpoint_layout(failed)


def resuming_first(result: PlanResult, failed: PlanCandidate) -> PlanResult:
    """``result`` with the fastest plan that resumes from ``failed``'s checkpoint (converted) chosen over a
    faster one that cannot load it and would start from the weights, throwing the training so far away."""
    source = checkpoint_layout(failed)
    resuming = [plan for plan in result.candidates if source.converts_to(checkpoint_layout(plan)) is None]
    if result.chosen is None or not resuming or resuming[0] is result.chosen:
        return result
    skipped = source.converts_to(checkpoint_layout(result.chosen))
    why = (
        f"the fastest leaner plan that resumes from the last checkpoint (the faster "
        f"{result.chosen.strategy.summary()} cannot load it: {skipped})"
    )
    return result.model_copy(update={"chosen": resuming[0], "why_chosen": why})


def _share(plan: PlanCandidate) -> float:
    return plan.memory.per_gpu.total / plan.gpu_memory_bytes


def only_leaner(result: PlanResult, failed: PlanCandidate) -> PlanResult:
    """``result`` without the plans whose estimate is not LEANER_BY below the failed plan's (as a share of
    their GPU): the headroom says so alone except where MAX_HEADROOM_PERCENT caps it, after a plan that used
    a sliver of a large GPU, when a plan as heavy as the failed one would otherwise fit the re-plan."""
    bound = _share(failed) * (1 - LEANER_BY)
    leaner = [plan for plan in result.candidates if _share(plan) <= bound]
    if len(leaner) == len(result.candidates):
        return result
    heavy = next(plan for plan in result.candidates if _share(plan) > bound)
    said = (
        f"nearest miss: {heavy.strategy.summary()} (its estimate, {heavy.memory.per_gpu.total / GIB:.1f} GiB per "
        f"GPU, is not {LEANER_BY:.0%} below the failed plan's {failed.memory.per_gpu.total / GIB:.1f} GiB)"
    )
    chosen = leaner[0] if leaner else None
    why = result.why_chosen if chosen is result.chosen else None
    if chosen is not None and why is None:
        why = f"the fastest plan whose estimate is {LEANER_BY:.0%} below the failed plan's"
    return result.model_copy(
        update={
            "chosen": chosen,
            "why_chosen": why,
            "candidates": leaner,
            "feasible_count": len(leaner),
            "advice": result.advice if leaner else [said, *result.advice],
        }
    )
