"""Pure status logic of a FineTuneJob: conditions per the Kubernetes API conventions, how an attempt's
pods add up to a phase, why a pod failed, and what ``kubectl get`` shows.

No cluster here: the handlers read pods and write status; these functions decide what to write.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from memfit.api.base import MAX_COUNTER, Condition
from memfit.api.finetunejob import Progress
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import TIMESTAMP_FORMAT, ConditionType, Outcome, Reason, TerminationReason
from memfit.contract.progress import Progress as TrainerProgress
from memfit.contract.termination import completed_progress, stopped_description
from memfit.units import GIB


def now() -> str:
    return datetime.now(UTC).strftime(TIMESTAMP_FORMAT)


def set_condition(
    conditions: Iterable[Condition],
    type_: ConditionType,
    status: bool | None,
    reason: Reason,
    message: str,
    generation: int | None,
    at: str | None = None,
) -> list[Condition]:
    """Conditions with ``type_`` set; lastTransitionTime moves only when the status changes."""
    wanted = {True: "True", False: "False", None: "Unknown"}[status]
    result, found = [], False
    for condition in conditions:
        if condition.type != type_:
            result.append(condition)
            continue
        found = True
        changed = condition.status != wanted
        result.append(
            Condition(
                type=type_,
                status=wanted,
                reason=reason,
                message=message,
                last_transition_time=(at or now()) if changed else condition.last_transition_time,
                observed_generation=generation,
            )
        )
    if not found:
        result.append(
            Condition(
                type=type_, status=wanted, reason=reason, message=message,
                last_transition_time=at or now(), observed_generation=generation,
            )
        )  # fmt: skip
    return result


@dataclass(frozen=True)
class PodReport:
    """What one trainer pod says about itself."""

    name: str
    outcome: Outcome
    reason: str = ""
    """Why it failed, in a sentence (empty unless failed)."""


def _termination(container_status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    state = container_status.get("state") or {}
    return state.get("terminated")


def _trainer_message(message: str | None) -> tuple[Outcome, str] | None:
    """The trainer's JSON termination message (memfit.contract.termination), when it gives a reason."""
    if not message:
        return None
    try:
        payload = json.loads(message)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    if payload.get("reason") == TerminationReason.OUT_OF_MEMORY:
        measured, planned = payload.get("measuredPeakBytes"), payload.get("plannedPeakBytes")
        detail = (
            f" (measured peak {measured / GIB:.1f} GiB, planned {planned / GIB:.1f} GiB)"
            if measured and planned
            else ""
        )
        return Outcome.OUT_OF_MEMORY, f"CUDA out of memory at step {payload.get('step')}{detail}"
    if payload.get("reason") == TerminationReason.CONFIG_ERROR:
        return Outcome.CONFIG_ERROR, f"the trainer refused its config: {payload.get('message')}"
    if payload.get("reason") in (TerminationReason.NO_SPACE, TerminationReason.NON_FINITE):  # a restart cannot help
        return Outcome.CONFIG_ERROR, str(payload.get("message"))
    return None


def report_pod(pod: Mapping[str, Any]) -> PodReport:
    """Classify a trainer pod from its status (as the API returns it)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    for container in status.get("containerStatuses") or []:
        terminated = _termination(container)
        if not terminated:
            continue
        stopped = stopped_description(terminated.get("message"))
        if stopped is not None:  # a signal stopped it after a checkpoint (exit 0 or torchrun's 1): not finished
            return PodReport(name, Outcome.FAILED, f"{name}: {stopped}")
        if terminated.get("exitCode", 0) == 0:
            continue
        if terminated.get("reason") == "OOMKilled":
            return PodReport(name, Outcome.OUT_OF_MEMORY, f"{name}: host memory exhausted (OOMKilled)")
        reported = _trainer_message(terminated.get("message"))
        if reported is not None:
            return PodReport(name, reported[0], f"{name}: {reported[1]}")
        return PodReport(name, Outcome.FAILED, f"{name}: exit code {terminated.get('exitCode')} "
                                               f"({terminated.get('reason') or 'Error'})")  # fmt: skip
    if phase == "Failed":
        return PodReport(name, Outcome.FAILED, f"{name}: {status.get('reason') or 'failed'}")
    if phase == "Pending":
        return PodReport(name, Outcome.PENDING, _unschedulable(name, status))
    # Left: a pod phase of Running, Succeeded or Unknown (Kubernetes' words; the first two are also outcomes).
    return PodReport(name, Outcome(phase) if phase in (Outcome.RUNNING, Outcome.SUCCEEDED) else Outcome.PENDING)


def final_progress(pods: Iterable[Mapping[str, Any]]) -> TrainerProgress | None:
    """Rank 0's progress after its last step, from its termination message (memfit.contract.termination's
    Completed): the pod that finished training says where it ended, also when no read of its metrics did."""
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = _termination(container)
            if terminated and terminated.get("exitCode", 0) == 0:
                progress = completed_progress(terminated.get("message"))
                if progress is not None:
                    return progress
    return None


@dataclass(frozen=True)
class Resumption:
    """Where the current attempt's trainer resumed, as its rank 0 reports it once its resume is over
    (``memfit_checkpoint_resumed_from_step`` and ``memfit_checkpoints_set_aside`` beside its first step, or
    the final progress of its termination message)."""

    step: int | None
    """The checkpoint step it resumed from; None: it started from the model weights."""
    set_aside: int
    """Newer checkpoints it set aside (failed verification, unreadable) before resuming."""


def _counter(value: float) -> int | None:
    return int(value) if math.isfinite(value) and 0 <= value <= MAX_COUNTER else None


def resumption(step: float | None, set_aside: float | None) -> Resumption | None:
    """A trainer's report of its resume from its two numbers (``step`` None: it started from the weights); None
    where it reports none (no ``set_aside``: a trainer older than the report) or numbers status cannot hold
    (a step that is no count is not "from the weights" either)."""
    count = _counter(set_aside) if set_aside is not None else None
    resumed = _counter(step) if step is not None else None
    if count is None or (step is not None and resumed is None):
        return None
    return Resumption(resumed, count)


def final_resumption(final: TrainerProgress) -> Resumption | None:
    """Where rank 0 resumed from, from its final progress (:func:`final_progress`); None from a trainer whose
    document predates the resume keys (it does not carry them: read as null and 0, they would be a guess)."""
    if "checkpoints_set_aside" not in final.model_fields_set:
        return None
    return resumption(final.resumed_from_step, final.checkpoints_set_aside)


def status_progress(final: TrainerProgress) -> Progress:
    """``status.progress`` from the progress rank 0 reports at its end (:func:`final_progress`)."""
    total = final.total_steps
    return Progress(
        step=final.step,
        total_steps=total,
        percent=min(100, 100 * final.step // total) if total else 0,
        tokens_per_second=round(final.tokens_per_second, 1),
        last_checkpoint_step=final.last_checkpoint_step,
        validation_loss=final.validation_loss,
        validation_step=final.validation_step,
        updated=final.updated.astimezone(UTC).strftime(TIMESTAMP_FORMAT),
    )


def _unschedulable(name: str, status: Mapping[str, Any]) -> str:
    """The scheduler's word on a pending pod (e.g. no node with free GPUs), or nothing."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{name} not scheduled: {condition.get('message') or condition.get('reason') or 'unschedulable'}"
    return ""


def profiling_outcome(pod: Mapping[str, Any]) -> tuple[Outcome, str]:
    """How a profiling pod stands (memfit_trainer.profile --termination-log): SUCCEEDED with its termination
    message (the encoded profile), FAILED with its one line, else PENDING or RUNNING (with the scheduler's word
    on a pod that waits for a node)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    for container in status.get("containerStatuses") or []:
        terminated = _termination(container)
        if not terminated:
            continue
        code, message = terminated.get("exitCode", 0), terminated.get("message") or ""
        if code == 0:
            if message:
                return Outcome.SUCCEEDED, message
            return Outcome.FAILED, "the profiler exited 0 but left no profile in its termination message"
        if terminated.get("reason") == "OOMKilled":
            return Outcome.FAILED, "the profiler ran out of host memory (OOMKilled)"
        reported = _trainer_message(message)
        if reported is not None and reported[0] is Outcome.CONFIG_ERROR:
            return Outcome.FAILED, str(json.loads(message).get("message"))
        return Outcome.FAILED, f"the profiler failed with exit code {code} ({terminated.get('reason') or 'Error'})"
    if phase == "Failed":
        why = status.get("message") or status.get("reason") or "failed"
        return Outcome.FAILED, f"the profiling pod failed: {why}"
    if phase == "Pending":
        return Outcome.PENDING, _unschedulable(name, status)
    return Outcome.RUNNING, ""


@dataclass(frozen=True)
class GangState:
    """An attempt's pods together: the gang fails as soon as one rank does."""

    outcome: Outcome
    reason: str


def gang_state(reports: Iterable[PodReport], expected: int) -> GangState:
    reports = list(reports)
    for wanted in (Outcome.CONFIG_ERROR, Outcome.OUT_OF_MEMORY, Outcome.FAILED):
        failed = [r for r in reports if r.outcome is wanted]
        if failed:
            return GangState(wanted, "; ".join(r.reason for r in failed))
    if len(reports) == expected and all(r.outcome is Outcome.SUCCEEDED for r in reports):
        return GangState(Outcome.SUCCEEDED, f"all {expected} node ranks finished")
    if len(reports) == expected and all(r.outcome in (Outcome.RUNNING, Outcome.SUCCEEDED) for r in reports):
        return GangState(Outcome.RUNNING, f"{expected} node ranks running")
    started = f"{sum(r.outcome is not Outcome.PENDING for r in reports)} of {expected} node ranks started"
    waiting = [r.reason for r in reports if r.outcome is Outcome.PENDING and r.reason]
    return GangState(Outcome.PENDING, "; ".join([started, *waiting[:1]]))


def memory_per_gpu(plan: PlanCandidate) -> str:
    """``kubectl get``'s Mem/GPU column: estimated total against capacity."""
    return f"{plan.memory.per_gpu.total / GIB:.1f}/{plan.gpu_memory_bytes / GIB:.1f} GiB"


def progress_display(step: int, total: int | None) -> str:
    """``kubectl get``'s Progress column."""
    if not total:
        return f"step {step}"
    return f"{100 * step // total}% {step}/{total}"
