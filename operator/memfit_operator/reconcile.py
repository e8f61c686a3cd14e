"""What the operator does about one FineTuneJob, decided from what it observes: a pure function.

``reconcile`` takes the job as the API server returns it, the job's pods, the GPU pools and the last
progress read from rank 0, and returns the status to write, the objects to create, the pods to delete and
the Events to post. The kopf handlers observe and apply (handlers.py); nothing here talks to a cluster.
Every action is idempotent by name (creating an existing object or deleting a missing pod is a no-op),
and the status is written before the objects exist, so running ``reconcile`` again on the same or a
later observation (a second loop, an operator restarted half-way) never duplicates anything.

Phases: Pending -> (Invalid | Unschedulable | Launching) -> Running -> Succeeded, with Restarting after a
failed rank (gang restart, bounded by spec.maxRestarts), a re-plan after an out-of-memory failure
(bounded by spec.maxReplans), Suspended while spec.suspend is true, and Failed when a bound is spent.
Succeeded and Failed are terminal: nothing afterwards (operator restarts, deleted children) changes them.

A job that types no model sizes (no ``spec.model.architecture``) is planned from its model's profile: the
profile ConfigMap of its model reference (shared by the namespace's jobs of that model), else the one the job's
profiling pod reports in its termination message (stored in that ConfigMap), else a profiling pod is created
and the job waits (Pending, Planned=False reason Profiling). A model the pod cannot profile makes the job
Invalid (reason ModelUnreadable, the pod's one line) until its spec changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from memfit.api.finetunejob import Attempt, FineTuneJob, FineTuneJobSpec, FineTuneJobStatus, Progress
from memfit.api.gpupool import GPUPool, pool_capacity
from memfit.api.loading import describe_validation_error
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import ConditionType, EndedOutcome, Outcome, Phase, Reason
from memfit.contract.profile_message import ProfileMessageError, decode_profile_message
from memfit.planner.replan import checkpoint_layout, replan_after_oom
from memfit.planner.search import PlanningError, plan_job
from memfit.planner.throughput import peak_flops
from memfit.profile import ModelProfile
from memfit.profiled_model import ProfiledModel
from memfit.render.trainer_config import render_trainer_config
from memfit_operator.objects import (
    TrainerOptions,
    attempt_objects,
    attempt_of,
    is_profiling_pod,
    model_reference,
    owned_pods,
    pod_name,
    profile_config_map,
    profile_config_map_name,
    profile_of,
    profiled_path,
    profiling_pod,
    profiling_pod_name,
)
from memfit_operator.status import (
    GangState,
    Resumption,
    final_progress,
    final_resumption,
    gang_state,
    memory_per_gpu,
    profiling_outcome,
    progress_display,
    report_pod,
    set_condition,
    status_progress,
)

TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
ACTIVE = (Phase.LAUNCHING, Phase.RUNNING, Phase.RESTARTING)
"""Phases with an attempt's pods in the cluster."""


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the job."""

    type: Literal["Normal", "Warning"]
    reason: Reason
    message: str


@dataclass(frozen=True)
class Observation:
    """Everything ``reconcile`` looks at."""

    job: Mapping[str, Any]
    """The FineTuneJob as the API server returns it (metadata with uid and generation, spec, status)."""
    pods: Sequence[Mapping[str, Any]]
    """The job's pods, of any attempt. Only pods the job controls count (owner reference with the job's uid):
    a pod that merely carries the job's labels is neither followed, scraped nor deleted."""
    pools: Sequence[GPUPool]
    progress: Progress | None
    """Training progress read from the current attempt's rank 0 (None when nothing was read)."""
    now: str
    """RFC 3339 time of the observation."""
    profiles: Sequence[Mapping[str, Any]] = ()
    """Profile ConfigMaps (as the API server returns them) of the job's model: the one named
    ``profile_config_map_name(spec)`` when it exists (others are ignored)."""
    resumption: Resumption | None = None
    """Where the current attempt's trainer resumed from, read with ``progress`` (None when it did not say)."""


@dataclass
class Decision:
    """What to do: write ``status``, create ``create`` (409 is fine), delete the pods ``delete``."""

    status: FineTuneJobStatus
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    planned: PlanCandidate | None = None
    """A plan made in this pass (for the operator's metrics)."""
    restarted: bool = False
    replanned_after_oom: bool = False


class _Pass:
    """One reconcile pass over a job: the draft decision and the helpers that fill it."""

    def __init__(self, observation: Observation, image: str, options: TrainerOptions) -> None:
        self.observation, self.image, self.options = observation, image, options
        metadata = observation.job.get("metadata") or {}
        self.generation: int | None = metadata.get("generation")
        owned = owned_pods(observation.pods, metadata.get("uid"))
        self.pods = [p for p in owned if not is_profiling_pod(p)]
        """The trainer pods (ranks of attempts)."""
        self.profiling = [p for p in owned if is_profiling_pod(p)]
        self.model: ProfiledModel | None = None
        """The model planned from its profile (a job without spec.model.architecture), once known."""
        self.decision = Decision(status=_read_status(observation.job.get("status")))
        self.previous_phase = self.decision.status.phase

    @property
    def status(self) -> FineTuneJobStatus:
        return self.decision.status

    def condition(self, type_: ConditionType, status: bool, reason: Reason, message: str) -> bool:
        """Set a condition; True when it changed (status, reason or message)."""
        before = next((c for c in self.status.conditions if c.type == type_), None)
        self.status.conditions = set_condition(
            self.status.conditions, type_, status, reason, message, self.generation, self.observation.now
        )
        return before is None or (before.status, before.reason, before.message) != (
            {True: "True", False: "False"}[status], reason, message)  # fmt: skip

    def event(self, type_: Literal["Normal", "Warning"], reason: Reason, message: str) -> None:
        self.decision.events.append(Event(type_, reason, message))

    def phase(self, phase: Phase) -> bool:
        """Move to ``phase``; True when that is a change."""
        changed = self.status.phase is not phase
        self.status.phase = phase
        return changed

    def attempt_pods(self, attempt: Attempt | None) -> list[Mapping[str, Any]]:
        if attempt is None:
            return []
        return [p for p in self.pods if attempt_of(p) == str(attempt.number)]

    def delete_pods(self, pods: Sequence[Mapping[str, Any]]) -> None:
        self.decision.delete.extend(p["metadata"]["name"] for p in pods)


def wanted_profile(raw: Mapping[str, Any]) -> str | None:
    """The name of the profile ConfigMap a job needs observed (its launched spec's, else its spec's): None when the
    job types its model's sizes, or its spec is invalid."""
    try:
        spec = _read_status(raw.get("status")).launched_spec
        if spec is None:
            spec = FineTuneJob.model_validate(
                {k: raw[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in raw}
            ).spec
    except ValidationError:
        return None
    return None if spec.model.architecture is not None else profile_config_map_name(spec)


def _read_status(raw: Mapping[str, Any] | None) -> FineTuneJobStatus:
    """The status memfit wrote before (a fresh one for a new job)."""
    return FineTuneJobStatus.model_validate(raw or {})


def reconcile(observation: Observation, image: str, options: TrainerOptions | None = None) -> Decision:
    """Decide what to do about one job (see the module docstring); ``options``: how trainer pods are built
    beyond the job and its plan (the operator's settings)."""
    run = _Pass(observation, image, options or TrainerOptions())
    status = run.status
    spec_changed = status.observed_generation != run.generation
    if status.launched_spec is None and spec_changed:
        status.plan = None  # the spec changed before the first launch (e.g. created suspended): plan it anew
    status.observed_generation = run.generation
    if observation.progress is not None:
        _record_progress(status, observation.progress, observation.resumption)
    current = status.attempts[-1] if status.attempts else None
    if observation.resumption is not None and current is not None and current.finished is None:
        _record_resumption(run, current, observation.resumption)
    if status.phase in TERMINAL:
        # Terminal stays terminal; only make sure no rank of the last attempt keeps a GPU busy.
        run.delete_pods([p for p in run.attempt_pods(current) if report_pod(p).outcome is Outcome.RUNNING])
        return run.decision

    job = _accepted_job(run)
    if job is None or (status.phase is Phase.INVALID and not spec_changed):
        return run.decision  # invalid (the renderer refused it too) until the spec changes
    if job.spec.model.architecture is not None:
        run.delete_pods(run.profiling)  # the spec types the sizes now: no profile needed
    elif not _profiled(run, job):
        return run.decision
    if status.plan is None and not _plan(run, job):
        return run.decision
    assert status.plan is not None
    _remove_stale_pods(run, current)
    if job.spec.suspend:
        _suspend(run, current)
        return run.decision
    if current is None or current.finished is not None:  # first launch, or resuming after a suspension
        if status.phase is Phase.SUSPENDED:
            resuming = "spec.suspend is false: resuming from the last checkpoint"
            run.condition(ConditionType.SUSPENDED, False, Reason.RESUMED, resuming)
            run.event("Normal", Reason.RESUMED, resuming)
        _launch(run, job, status.plan, Phase.LAUNCHING, checkpoint_carries=True)
        return run.decision
    _follow(run, job, status.plan, current)
    return run.decision


def _remove_stale_pods(run: _Pass, current: Attempt | None) -> None:
    """Pods of any attempt but the current running one should not exist (an operator stopped between
    recording a new attempt and deleting the old one's pods leaves them): delete them."""
    keep = str(current.number) if current is not None and current.finished is None else None
    run.delete_pods([p for p in run.pods if attempt_of(p) != keep])


def _record_progress(status: FineTuneJobStatus, progress: Progress, resumption: Resumption | None = None) -> None:
    """A restarted trainer reports no checkpoint or validation loss until its first: the last known stay. One that
    says where it resumed (``resumption``) knows better: its checkpoint is the one it resumed from until its first
    save, and from the weights none (the previous one was set aside, or of a layout it cannot read)."""
    previous = status.progress
    if progress.last_checkpoint_step is None and (previous is not None or resumption is not None):
        known = resumption.step if resumption is not None else previous.last_checkpoint_step if previous else None
        progress = progress.model_copy(update={"last_checkpoint_step": known})
    if previous is not None and progress.validation_step is None:
        kept = {"validation_loss": previous.validation_loss, "validation_step": previous.validation_step}
        progress = progress.model_copy(update=kept)
    status.progress = progress
    status.progress_display = progress_display(progress.step, progress.total_steps)


def _record_resumption(run: _Pass, attempt: Attempt, resumption: Resumption) -> None:
    """The trainer's word on where ``attempt`` resumed replaces the launch's expectation. Its first report is the
    trigger (``checkpointsSetAside`` is null until then): the Events are posted with that status change, so a
    later pass, whatever it reads, writes and posts nothing more about it."""
    if attempt.checkpoints_set_aside is not None:
        return
    expected = attempt.resumed_from_step
    attempt.resumed_from_step, attempt.checkpoints_set_aside = resumption.step, resumption.set_aside
    step = resumption.step
    origin = f"resumed from checkpoint step {step}" if step is not None else "started from the model weights"
    launched = "" if expected == step else (
        f" (launched to resume from checkpoint step {expected})" if expected is not None
        else " (launched to start from the model weights)")  # fmt: skip
    if resumption.set_aside:
        run.event("Warning", Reason.CHECKPOINT_SET_ASIDE, f"attempt {attempt.number}: {resumption.set_aside} newer "
                  "checkpoint(s) failed verification or could not be read and were set aside (rank 0's log names "
                  f"them); {origin}{launched}")  # fmt: skip
    elif launched:
        run.event("Normal", Reason.RESUMED_FROM, f"attempt {attempt.number} {origin}{launched}")


def _accepted_job(run: _Pass) -> FineTuneJob | None:
    """The job to act on: the spec as validated, or after launch the launched spec (immutable but for
    ``suspend``). None when there is nothing to act on (an invalid spec that never launched)."""
    raw = run.observation.job
    status = run.status
    launched = status.launched_spec
    try:
        job = FineTuneJob.model_validate({k: raw[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in raw})
    except ValidationError as error:
        message = describe_validation_error(error, FineTuneJob)
        if launched is None:
            changed = run.condition(ConditionType.READY, False, Reason.INVALID_SPEC, message)
            run.phase(Phase.INVALID)
            if changed:
                run.event("Warning", Reason.INVALID_SPEC, message)
            return None
        job = FineTuneJob.model_validate({"metadata": raw["metadata"], "spec": launched.to_api()})
        _reject_change(run, f"the changed spec is invalid ({message})")
        return _with_suspend(job, bool((raw.get("spec") or {}).get("suspend", False)))
    if launched is None:
        return job
    changed_fields = _changed_fields(launched, job.spec)
    if changed_fields:
        _reject_change(run, f"{', '.join(changed_fields)} changed after launch; only spec.suspend may change")
    elif status.phase not in (Phase.INVALID, Phase.UNSCHEDULABLE):
        run.condition(ConditionType.READY, True, Reason.SPEC_ACCEPTED, "the spec is valid and planned")
    return _with_suspend(job.model_copy(update={"spec": launched}), job.spec.suspend)


def _with_suspend(job: FineTuneJob, suspend: bool) -> FineTuneJob:
    return job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": suspend})})


def _changed_fields(launched: FineTuneJobSpec, spec: FineTuneJobSpec) -> list[str]:
    before, after = launched.to_api(), spec.to_api()
    keys = sorted((set(before) | set(after)) - {"suspend"})
    return [f"spec.{key}" for key in keys if before.get(key) != after.get(key)]


def _reject_change(run: _Pass, why: str) -> None:
    message = (f"{why}. The job continues with the spec it was launched with; revert the change, or delete the "
               "job and create a new one")  # fmt: skip
    if run.condition(ConditionType.READY, False, Reason.SPEC_IMMUTABLE, message):
        run.event("Warning", Reason.SPEC_IMMUTABLE, message)


def _plan(run: _Pass, job: FineTuneJob) -> bool:
    """Plan a job that has no plan yet; False (and phase Unschedulable) when nothing fits."""
    status = run.status
    chosen: PlanCandidate | None
    try:
        result = plan_job(job.spec, run.observation.pools, status.excluded_strategies, run.model, run.options.runtime)
    except PlanningError as error:
        chosen, advice = None, str(error)
    else:
        chosen, advice = result.chosen, "; ".join(result.advice) or "no strategy fits the declared GPUPools"
    if chosen is None:
        message = f"nothing fits: {advice}"
        changed = run.condition(ConditionType.PLANNED, False, Reason.UNSCHEDULABLE, message)
        run.condition(ConditionType.READY, False, Reason.UNSCHEDULABLE, message)
        run.phase(Phase.UNSCHEDULABLE)
        if changed:
            run.event("Warning", Reason.UNSCHEDULABLE, message)
        return False
    _adopt_plan(run, chosen)
    run.condition(ConditionType.READY, True, Reason.SPEC_ACCEPTED, "the spec is valid and planned")
    run.event("Normal", Reason.PLANNED, _plan_message(chosen))
    return True


def _profiled(run: _Pass, job: FineTuneJob) -> bool:
    """The profile of a job's model that types no sizes, in ``run.model``: from its ConfigMap, else from the job's
    profiling pod (stored in the ConfigMap by this pass). False while there is none: the profiling pod is created
    or awaited (phase Pending, Planned=False reason Profiling), or it could not profile the model (Invalid)."""
    spec = job.spec
    stored_name = profile_config_map_name(spec)
    stored = next((c for c in run.observation.profiles if (c.get("metadata") or {}).get("name") == stored_name), None)
    if stored is not None:
        try:
            run.model = ProfiledModel(profile_of(stored))
        except ValueError as error:
            _model_unreadable(run, spec, f"ConfigMap {stored_name} holds no profile memfit reads ({error}); delete "
                                         "it to profile the model again")  # fmt: skip
            return False
        run.delete_pods(run.profiling)  # the result is stored: the finished pod has done its part
        return True
    name = profiling_pod_name(job, run.generation or 0)
    run.delete_pods([p for p in run.profiling if p["metadata"]["name"] != name])  # made for an older spec
    pod = next((p for p in run.profiling if p["metadata"]["name"] == name), None)
    if pod is None:
        run.decision.create.append(profiling_pod(job, run.generation or 0, run.image))
        _profiling(run, spec, name, "")
        return False
    outcome, detail = profiling_outcome(pod)
    if outcome is Outcome.FAILED:
        _model_unreadable(run, spec, f"{detail} (pod {name})")
        return False
    if outcome is not Outcome.SUCCEEDED:
        _profiling(run, spec, name, detail)
        return False
    try:
        profile = decode_profile_message(detail)
        run.model = ProfiledModel(profile)
    except (ProfileMessageError, ValueError) as error:
        _model_unreadable(run, spec, f"pod {name} reported no profile memfit reads: {error}")
        return False
    run.decision.create.append(profile_config_map(job, profile))
    run.event("Normal", Reason.PROFILED, f"{_profile_summary(profile)}; stored in ConfigMap {stored_name} for "
                                         f"every job of {model_reference(spec)}")  # fmt: skip
    return True


def _profile_summary(profile: ModelProfile) -> str:
    count = profile.total_parameters
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count:,}"
    return (f"profiled {profile.architecture} ({profile.model_type}, {size} parameters, config.json "
            f"sha256 {profile.config_sha256[:12]}...)")  # fmt: skip


def _profiling(run: _Pass, spec: FineTuneJobSpec, pod: str, detail: str) -> None:
    """Waiting for the profiling pod: Pending, Planned=False reason Profiling (an Event when that is new)."""
    if run.status.plan is not None:
        return  # planned before its profile ConfigMap went: nothing to report while it is made again
    message = f"profiling {profiled_path(spec)} from its config.json (pod {pod})"
    changed = run.condition(ConditionType.PLANNED, False, Reason.PROFILING, message)
    run.condition(ConditionType.READY, False, Reason.PROFILING, message + (f": {detail}" if detail else ""))
    run.phase(Phase.PENDING)
    if changed:
        run.event("Normal", Reason.PROFILING, message)


def _model_unreadable(run: _Pass, spec: FineTuneJobSpec, why: str) -> None:
    """The model cannot be profiled: Invalid until the spec changes (Failed once launched)."""
    message = f"{model_reference(spec)} cannot be planned from its profile: {why}"
    if run.status.launched_spec is not None:
        _fail(run, Reason.MODEL_UNREADABLE, message)
        return
    message += "; fix the model and change the job's spec (or create the job again) to profile it again"
    changed = run.condition(ConditionType.PLANNED, False, Reason.MODEL_UNREADABLE, message)
    run.condition(ConditionType.READY, False, Reason.MODEL_UNREADABLE, message)
    run.phase(Phase.INVALID)
    if changed:
        run.event("Warning", Reason.MODEL_UNREADABLE, message)


def _plan_message(plan: PlanCandidate) -> str:
    return f"{plan.strategy.summary()}; estimated {memory_per_gpu(plan)} per GPU (estimate, not measured)"


def _adopt_plan(run: _Pass, plan: PlanCandidate) -> None:
    status = run.status
    status.plan, status.gpus, status.memory_per_gpu = plan, plan.strategy.gpus, memory_per_gpu(plan)
    run.condition(ConditionType.PLANNED, True, Reason.PLANNED, _plan_message(plan))
    run.decision.planned = plan


def _pool(run: _Pass, name: str) -> GPUPool | None:
    return next((p for p in run.observation.pools if p.metadata.name == name), None)


def _launch(run: _Pass, job: FineTuneJob, plan: PlanCandidate, phase: Phase, checkpoint_carries: bool) -> None:
    """Start a new attempt: record it in status first, then create its objects (``checkpoint_carries``: the
    trainer resumes from the last checkpoint, of this layout or converted from the previous one)."""
    status = run.status
    pool = _pool(run, plan.strategy.pool)
    if pool is None:  # the pool was deleted since planning: plan again on the next pass
        status.plan = None
        run.phase(Phase.PENDING)
        run.event("Warning", Reason.POOL_GONE, f"GPUPool {plan.strategy.pool!r} no longer exists; planning again")
        return
    number = len(status.attempts) + 1
    try:
        objects = _attempt_objects(run, job, plan, pool, number)
    except ValueError as error:  # the renderer refuses what validation let through (say, a stored plan)
        _unrenderable(run, plan, error)
        return
    resumed = status.progress.last_checkpoint_step if status.progress is not None and checkpoint_carries else None
    if status.progress is not None and not checkpoint_carries:
        status.progress = status.progress.model_copy(update={"last_checkpoint_step": None})
    status.attempts.append(
        Attempt(
            number=number,
            strategy_summary=plan.strategy.summary(),
            started=run.observation.now,
            resumed_from_step=resumed,
        )  # fmt: skip
    )
    status.launched_spec = status.launched_spec or job.spec.model_copy(update={"suspend": False})
    run.decision.create.extend(objects)
    run.phase(phase)
    origin = f"from checkpoint step {resumed}" if resumed is not None else "from the model weights"
    # The words the next pass uses while no rank has started, so a repeated pass writes nothing new.
    waiting = gang_state([], plan.strategy.nodes).reason
    run.condition(ConditionType.RUNNING, False, Reason.LAUNCHING, f"attempt {number}: {waiting}")
    run.event("Normal", Reason.LAUNCHING, f"attempt {number} ({plan.strategy.summary()}), starting {origin}")


def _unrenderable(run: _Pass, plan: PlanCandidate, error: ValueError) -> None:
    """The trainer config cannot be rendered for this job and plan: nothing is launched. Retrying cannot
    help, so the job says why and waits for a fixed spec (before the first launch) or is failed."""
    message = f"the trainer config cannot be rendered for {plan.strategy.summary()}: {error}"
    if run.status.launched_spec is None:
        run.status.plan = None
        changed = run.condition(ConditionType.READY, False, Reason.INVALID_SPEC, message)
        run.phase(Phase.INVALID)
        if changed:
            run.event("Warning", Reason.INVALID_SPEC, message)
    else:
        _fail(run, Reason.INVALID_SPEC, message)


def _suspend(run: _Pass, current: Attempt | None) -> None:
    if current is not None and current.finished is None:
        run.delete_pods(run.attempt_pods(current))
        _finish(run, current, Outcome.SUSPENDED, "spec.suspend is true")
    message = "spec.suspend is true: pods removed; plan, progress and checkpoints kept"
    if run.phase(Phase.SUSPENDED):
        run.event("Normal", Reason.SUSPENDED, message)
    run.condition(ConditionType.SUSPENDED, True, Reason.SUSPEND_REQUESTED, message)
    run.condition(ConditionType.RUNNING, False, Reason.SUSPENDED, message)


def _finish(run: _Pass, attempt: Attempt, outcome: EndedOutcome, reason: str) -> None:
    attempt.finished, attempt.outcome, attempt.reason = run.observation.now, outcome, reason


def _follow(run: _Pass, job: FineTuneJob, plan: PlanCandidate, attempt: Attempt) -> None:
    """Turn the current attempt's pods into phase, conditions and, on failure, the next attempt."""
    pods = run.attempt_pods(attempt)
    nodes = plan.strategy.nodes
    gang = gang_state((report_pod(p) for p in pods), nodes)
    present = {p["metadata"]["name"] for p in pods}
    missing = [name for name in (pod_name(job, attempt.number, r) for r in range(nodes)) if name not in present]
    if missing and run.status.phase is Phase.RUNNING and gang.outcome is not Outcome.SUCCEEDED:
        gang = GangState(Outcome.FAILED, f"pod(s) {', '.join(missing)} deleted while running")
    if gang.outcome is Outcome.CONFIG_ERROR:
        run.delete_pods(pods)
        _finish(run, attempt, Outcome.CONFIG_ERROR, gang.reason)
        _fail(run, Reason.TRAINER_CONFIG_ERROR, f"{gang.reason}. A restart would fail the same way: fix the data "
                                                "or the spec and create the job again")  # fmt: skip
    elif gang.outcome is Outcome.OUT_OF_MEMORY:
        _replan_after_oom(run, job, plan, attempt, pods, gang.reason)
    elif gang.outcome is Outcome.FAILED:
        _restart(run, job, plan, attempt, pods, gang.reason)
    elif gang.outcome is Outcome.SUCCEEDED:
        final = final_progress(pods)
        if final is not None:
            resumed = final_resumption(final)  # the first word on it for a job shorter than a progress read
            _record_progress(run.status, status_progress(final), resumed)
            if resumed is not None:
                _record_resumption(run, attempt, resumed)
        _succeed(run, attempt, gang.reason)
    elif gang.outcome is Outcome.RUNNING:
        if run.phase(Phase.RUNNING):
            run.event("Normal", Reason.RUNNING, f"attempt {attempt.number}: {gang.reason}")
        run.condition(ConditionType.RUNNING, True, Reason.RUNNING, f"attempt {attempt.number}: {gang.reason}")
    else:
        _wait_for_ranks(run, job, plan, attempt, missing, gang.reason)


def _wait_for_ranks(
    run: _Pass, job: FineTuneJob, plan: PlanCandidate, attempt: Attempt, missing: list[str], why: str
) -> None:
    """Launching: (re)create what is not there yet (existing objects are left alone) and say what the
    gang waits for (ranks not started, the scheduler's reason)."""
    run.condition(ConditionType.RUNNING, False, Reason.LAUNCHING, f"attempt {attempt.number}: {why}")
    if missing:
        wanted = set(missing)
        pool = _pool(run, plan.strategy.pool)
        objects = _attempt_objects(run, job, plan, pool, attempt.number) if pool is not None else []
        run.decision.create.extend(o for o in objects if o["kind"] != "Pod" or o["metadata"]["name"] in wanted)


def _attempt_objects(
    run: _Pass, job: FineTuneJob, plan: PlanCandidate, pool: GPUPool, number: int
) -> list[dict[str, Any]]:
    flops = peak_flops(pool_capacity(pool), plan.strategy.precision)
    config = render_trainer_config(job, plan, peak_flops=flops, planned=run.model, devices=pool.spec.devices)
    return attempt_objects(job, plan, pool, config, number, run.image, run.options)


def _succeed(run: _Pass, attempt: Attempt, reason: str) -> None:
    status = run.status
    _finish(run, attempt, Outcome.SUCCEEDED, reason)
    run.phase(Phase.SUCCEEDED)
    if status.progress is not None and status.progress.total_steps:
        total = status.progress.total_steps
        status.progress = status.progress.model_copy(update={"step": total, "percent": 100, "eta": None})
        status.progress_display = progress_display(total, total)
    run.condition(ConditionType.RUNNING, False, Reason.COMPLETED, reason)
    run.condition(ConditionType.SUCCEEDED, True, Reason.COMPLETED, f"attempt {attempt.number}: {reason}")
    run.event("Normal", Reason.SUCCEEDED, f"training finished: {reason}")


def _fail(run: _Pass, reason: Reason, message: str) -> None:
    run.phase(Phase.FAILED)
    run.condition(ConditionType.RUNNING, False, reason, message)
    run.condition(ConditionType.SUCCEEDED, False, reason, message)
    run.condition(ConditionType.READY, False, reason, message)
    run.event("Warning", Reason.FAILED, message)


@dataclass(frozen=True)
class _Budget:
    """Restarts or re-plans: how many were used of how many the spec allows."""

    used: int
    allowed: int
    noun: str
    field: str
    """The spec field that sets ``allowed``."""
    spent_reason: Reason
    """The condition reason when it is spent."""


def _end_attempt(
    run: _Pass, attempt: Attempt, pods: Sequence[Mapping[str, Any]], outcome: EndedOutcome, why: str, budget: _Budget
) -> bool:
    """Remove the attempt's pods and record how it ended; False (and the job Failed) when the budget is spent."""
    run.delete_pods(pods)
    _finish(run, attempt, outcome, why)
    if budget.used < budget.allowed:
        return True
    _fail(run, budget.spent_reason, f"{why}; all {budget.allowed} {budget.noun} used (spec.{budget.field})")
    return False


def _restart(
    run: _Pass, job: FineTuneJob, plan: PlanCandidate, attempt: Attempt, pods: Sequence[Mapping[str, Any]], why: str
) -> None:
    """Gang semantics: one failed rank ends the attempt; the next starts from the last checkpoint."""
    status = run.status
    budget = _Budget(status.restarts, job.spec.max_restarts, "restart(s)", "maxRestarts", Reason.RESTART_LIMIT_REACHED)
    if not _end_attempt(run, attempt, pods, Outcome.FAILED, why, budget):
        return
    status.restarts += 1
    run.decision.restarted = True
    run.event("Warning", Reason.RANK_FAILED, f"{why}; gang restart {status.restarts}/{job.spec.max_restarts}")
    _launch(run, job, plan, Phase.RESTARTING, checkpoint_carries=True)


def _replan_after_oom(
    run: _Pass, job: FineTuneJob, plan: PlanCandidate, attempt: Attempt, pods: Sequence[Mapping[str, Any]], why: str
) -> None:
    """Out of memory is not an ordinary failure: the same plan would fail again, so plan leaner."""
    status = run.status
    run.event("Warning", Reason.OUT_OF_MEMORY, f"{why} under {plan.strategy.summary()}")
    budget = _Budget(status.replans, job.spec.max_replans, "re-plan(s)", "maxReplans", Reason.REPLAN_LIMIT_REACHED)
    if not _end_attempt(run, attempt, pods, Outcome.OUT_OF_MEMORY, why, budget):
        return
    status.excluded_strategies.append(plan.strategy.identity())
    checkpointed = status.progress is not None and status.progress.last_checkpoint_step is not None
    result, layout_kept = replan_after_oom(
        job.spec, run.observation.pools, plan, status.excluded_strategies, run.model, checkpointed, run.options.runtime
    )
    if result.chosen is None:
        advice = "; ".join(result.advice)
        _fail(run, Reason.NO_LEANER_PLAN, f"{why}; no leaner strategy fits the declared GPUPools. {advice}".strip())
        return
    status.replans += 1
    run.decision.replanned_after_oom = True
    _adopt_plan(run, result.chosen)
    was, now = memory_per_gpu(plan), memory_per_gpu(result.chosen)
    # The trainer converts the last checkpoint where the layouts allow it (the same pure rule decides there).
    unconvertible = checkpoint_layout(plan).converts_to(checkpoint_layout(result.chosen))
    change = f"the checkpoint layout changes ({_layout(plan)} -> {_layout(result.chosen)})"
    keeps = ("the checkpoint layout is unchanged: resuming from the last checkpoint" if layout_kept else
             f"{change}: resuming from the last checkpoint, converted to the new layout" if unconvertible is None
             else f"{change}: starting from the model weights, no conversion exists ({unconvertible})")  # fmt: skip
    chosen = result.chosen.strategy.summary()
    count = f"{status.replans}/{job.spec.max_replans}"
    run.event("Normal", Reason.REPLANNED, f"re-plan {count}: {chosen} (estimated {now} per GPU, was {was}); {keeps}")
    _launch(run, job, result.chosen, Phase.RESTARTING, checkpoint_carries=unconvertible is None)


def _layout(plan: PlanCandidate) -> str:
    layout = checkpoint_layout(plan)
    masters = " with bf16 masters" if layout.master_weights == "bf16" else ""
    if layout.engine == "fsdp2":
        return f"{layout.method} {layout.precision} on fsdp2 (any GPU count){masters}"
    return f"{layout.method} {layout.precision} ZeRO-{layout.zero_stage} on {layout.world_size} GPU(s){masters}"
