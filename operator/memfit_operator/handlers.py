"""kopf wiring: watch FineTuneJobs, their pods and the GPUPools; run ``reconcile`` per job; apply.

Each FineTuneJob gets one daemon (a coroutine kopf starts when the job appears, including every job that
exists when the operator starts, and stops when the job goes). The daemon reconciles its job at least
every ``resync_seconds`` and at once when the job or one of its pods changes. Pods and pools come from kopf
indexes (in-memory, fed by watches: no API call per pass). One daemon per job means one writer per job, so
passes over a job never race; with two replicas, kopf peering keeps one of them active.

Status is written before children are created (see memfit_operator.reconcile), and a pass skips the write
when nothing changed, so an idle job costs no API calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJobStatus
from memfit.api.gpupool import GPUPool
from memfit.api.loading import describe_validation_error
from memfit.api.vocabulary import MANAGED_BY, MANAGED_BY_LABEL, TIMESTAMP_FORMAT, Phase, Reason
from memfit_operator.cluster_api import GROUP, JOBS, VERSION, ClusterApi, load_credentials
from memfit_operator.metrics import FOLLOW_HANDLER, OperatorMetrics
from memfit_operator.objects import attempt_of, owned_pods, owner_of, profile_of
from memfit_operator.peering import announce_missing_peering
from memfit_operator.progress import TrainerReport, fetch_progress, rank0_address
from memfit_operator.reconcile import ACTIVE, Decision, Observation, reconcile, wanted_profile
from memfit_operator.settings import OperatorSettings

POD_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
WAKEUP_HANDLERS = ("'pod_changed'", "'job_changed'")
INDEX_LAG_SECONDS = 30.0
"""How long an object this daemon created is not created again: the pod index learns of a new pod from
the watch a moment later, and the pass that our own status write triggers comes before that."""
log = logging.getLogger("memfit.operator")


class Runtime:
    """What the handlers share in one operator process (kept in kopf's memo)."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self.metrics = OperatorMetrics()
        self.cluster = ClusterApi(load_credentials())
        self.http: aiohttp.ClientSession | None = None
        self.peering_notice: asyncio.Task[None] | None = None
        self._wakeups: dict[tuple[str, str], asyncio.Event] = {}
        self.profiles: dict[tuple[str, str], dict[str, Any]] = {}
        """Profile ConfigMaps read, by (namespace, name): immutable, so read once."""

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self._wakeups.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str | None, name: str | None) -> None:
        event = self._wakeups.get((namespace or "", name or ""))
        if event is not None:
            event.set()

    def forget(self, namespace: str, name: str) -> None:
        self._wakeups.pop((namespace, name), None)


def _plain(value: Any) -> Any:
    """kopf's body views as plain dicts and lists (the pure core takes plain data)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    operator_settings: OperatorSettings = memo.get("settings") or OperatorSettings.from_environment()
    runtime = Runtime(operator_settings)
    memo["runtime"] = runtime
    runtime.http = aiohttp.ClientSession()
    if operator_settings.metrics_port:
        runtime.metrics.serve(operator_settings.metrics_port)
    settings.persistence.finalizer = "memfit.dev/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="memfit.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="memfit.dev")
    settings.posting.reporting_component = "memfit-operator"
    settings.watching.label_selectors["v1", "pods"] = POD_SELECTOR  # the server filters: no cluster-wide pod stream
    peering = settings.peering
    if peering.mandatory and not peering.standalone and (peering.clusterwide or operator_settings.namespace):
        # kopf waits for the peering object in silence: say which one, and how to get out, while it is missing.
        namespace = None if peering.clusterwide else operator_settings.namespace
        lookup = functools.partial(runtime.cluster.peering, namespace, peering.name)
        every = operator_settings.peering_notice_seconds
        runtime.peering_notice = asyncio.create_task(announce_missing_peering(lookup, namespace, peering.name, every))


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None and runtime.peering_notice is not None:
        runtime.peering_notice.cancel()
    if runtime is not None and runtime.http is not None:
        await runtime.http.close()


@kopf.index("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGED_BY})
def trainer_pods(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Pods by (namespace, name of the FineTuneJob that controls them, by owner reference): the parts the
    reconciler reads. A pod no FineTuneJob controls is left out, whatever its labels say."""
    metadata = _plain(body.get("metadata", {}))
    owner = owner_of({"metadata": metadata})
    if owner is None:
        return {}
    kept = {key: metadata.get(key) for key in ("name", "labels", "ownerReferences")}
    return {(namespace, owner[0]): {"metadata": kept, "status": _plain(body.get("status", {}))}}


@kopf.index(GROUP, VERSION, "gpupools")
def gpu_pools(name: str, body: kopf.Body, logger: kopf.Logger, **_: Any) -> dict[Any, Any]:
    """Every valid GPUPool under one key; an invalid one is left out with a log line (the API server's schema
    already refuses most mistakes, so this is the cross-field checks)."""
    try:
        pool = GPUPool.model_validate({k: _plain(body.get(k)) for k in ("apiVersion", "kind", "metadata", "spec")})
    except ValidationError as error:
        logger.warning(f"GPUPool {name} is ignored: {describe_validation_error(error, GPUPool)}")
        return {}
    return {None: pool}


@kopf.on.event("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGED_BY})
def pod_changed(namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    owner = owner_of({"metadata": _plain(body.get("metadata", {}))})
    if runtime is not None and owner is not None:
        runtime.wake(namespace, owner[0])


@kopf.on.event(GROUP, VERSION, JOBS)
def job_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None:
        runtime.wake(namespace, name)


class ChildrenRefused(Exception):
    """The API server refused to create some of a job's children (reported on the job as a Warning)."""


class JobFollower:
    """The state one job's daemon keeps between passes."""

    def __init__(self, runtime: Runtime, namespace: str, name: str) -> None:
        self.runtime, self.namespace, self.name = runtime, namespace, name
        self.key = f"{namespace}/{name}"
        self.written: dict[str, Any] | None = None
        """The status as this daemon last wrote it: newer than the watched body until the watch catches up."""
        self.report: TrainerReport | None = None
        """What rank 0 of the current attempt last said (progress, where it resumed from), until a pass uses it."""
        self.progress_read_at = 0.0
        self.created: dict[tuple[str, str], float] = {}
        """(kind, name) -> when this daemon created it (or found it existing)."""
        self.refused: set[str] = set()
        """Refusals of creates by the API server already posted as Events (once each, not every pass)."""

    async def pass_once(self, body: kopf.Body, pods: list[dict[str, Any]], pools: list[GPUPool]) -> None:
        job = {key: _plain(body.get(key)) for key in ("apiVersion", "kind", "metadata", "spec")}
        job["status"] = self.written if self.written is not None else _plain(body.get("status") or {})
        status = FineTuneJobStatus.model_validate(job["status"] or {})
        # Only pods this job controls (owner reference with its uid): the index keys pods by the owner's name,
        # which a job deleted and created again under the same name shares with its predecessor.
        pods = [dict(p) for p in owned_pods(pods, (job.get("metadata") or {}).get("uid"))]
        await self._read_progress(status, job, pods)
        now = datetime.now(UTC).strftime(TIMESTAMP_FORMAT)
        profiles = await self._profiles(job)
        report = self.report
        progress, resumption = (report.progress, report.resumption) if report is not None else (None, None)
        observation = Observation(job, pods, pools, progress, now, profiles, resumption)
        settings = self.runtime.settings
        # Planning is CPU work (milliseconds to tens of them): off the event loop, so watches and probes stay live.
        decision = await asyncio.to_thread(reconcile, observation, settings.trainer_image, settings.trainer_options())
        self.report = None
        await self._apply(body, job["status"] or {}, decision)

    async def _profiles(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """The profile ConfigMap the job needs (a job that types no model sizes), when it exists: read once, as it
        is immutable (one GET per pass only while it does not exist yet)."""
        name = wanted_profile(job)
        if name is None:
            return []
        key = (self.namespace, name)
        found = self.runtime.profiles.get(key)
        if found is None:
            found = await asyncio.to_thread(self.runtime.cluster.read_config_map, self.namespace, name)
            if found is None:
                return []
            with contextlib.suppress(ValueError):  # one memfit cannot read is not kept: deleting it must count
                profile_of(found)
                self.runtime.profiles[key] = found
        return [found]

    async def _read_progress(self, status: FineTuneJobStatus, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        """Read rank 0's progress at most every progress_seconds, while the job runs."""
        settings, runtime = self.runtime.settings, self.runtime
        if status.phase is not Phase.RUNNING or status.plan is None or not status.attempts or runtime.http is None:
            return
        if time.monotonic() - self.progress_read_at < settings.progress_seconds:
            return
        self.progress_read_at = time.monotonic()
        current = str(status.attempts[-1].number)
        attempt_pods = [p for p in pods if attempt_of(p) == current]
        address = rank0_address(attempt_pods, (job.get("metadata") or {}).get("uid"))
        if address is not None:
            port, world = settings.trainer_metrics_port, status.plan.strategy.gpus
            self.report = await fetch_progress(runtime.http, address, port, world)

    async def _apply(self, body: kopf.Body, before: dict[str, Any], decision: Decision) -> None:
        cluster, metrics = self.runtime.cluster, self.runtime.metrics
        after = decision.status.to_api()
        if after != before:
            patch = {key: None for key in before if key not in after} | after
            await asyncio.to_thread(cluster.patch_job_status, self.namespace, self.name, patch)
            self.written = after
        for pod in decision.delete:
            await asyncio.to_thread(cluster.delete_pod, self.namespace, pod)
        now = time.monotonic()
        refusals: list[str] = []
        for manifest in decision.create:
            key = (manifest["kind"], manifest["metadata"]["name"])
            if now - self.created.get(key, -INDEX_LAG_SECONDS) < INDEX_LAG_SECONDS:
                continue  # created moments ago: the pod index has not seen it yet, asking again is a sure 409
            try:
                await asyncio.to_thread(cluster.create, manifest)
            except ApiException as error:  # the others are still created, the Events still posted
                refusals.append(self._refused(body, manifest, error))
                continue
            self.created[key] = now
        self.refused &= set(refusals)
        for event in decision.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1000])
            # The operator's log tells the story too (a plain logger: kopf posts its object logger's lines as
            # Events, which would double these).
            log.log(logging.WARNING if event.type == "Warning" else logging.INFO,
                    f"[{self.key}] {event.reason}: {event.message}")  # fmt: skip
        if decision.planned is not None:
            metrics.plan_adopted(decision.planned)
        if decision.restarted:
            metrics.restarts.inc()
        if decision.replanned_after_oom:
            metrics.oom_replans.inc()
        metrics.job_status(self.key, decision.status)
        if refusals:  # the pass failed (counted, and reported above); the next one tries again
            raise ChildrenRefused("; ".join(refusals))

    def _refused(self, body: kopf.Body, manifest: Mapping[str, Any], error: ApiException) -> str:
        """A child the API server will not create (admission, quota, RBAC, an invalid field) leaves the job
        waiting in Launching: say so on the job, once per distinct refusal, not on every pass."""
        message = (f"the API server refused {manifest['kind']} {manifest['metadata']['name']}: "
                   f"{error.status} {error.reason}: {_api_message(error)}")  # fmt: skip
        if message not in self.refused:
            self.refused.add(message)
            kopf.event(body, type="Warning", reason=Reason.LAUNCHING, message=message[:1000])
            log.warning(f"[{self.key}] {Reason.LAUNCHING}: {message}")
        return message


# kopf passes the indexes by name (trainer_pods, gpu_pools) and a namespaced object's namespace as a str; its
# DaemonFn protocol (namespace: str | None, no index arguments) can express neither.
@kopf.daemon(GROUP, VERSION, JOBS, cancellation_timeout=5.0)  # type: ignore[arg-type]
async def follow_job(
    namespace: str,
    name: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    trainer_pods: kopf.Index[tuple[str, str], dict[str, Any]],
    gpu_pools: kopf.Index[None, GPUPool],
    logger: kopf.Logger,
    **_: Any,
) -> None:
    runtime: Runtime = memo["runtime"]
    follower = JobFollower(runtime, namespace, name)
    wakeup = runtime.wakeup(namespace, name)
    try:
        while not stopped:
            wakeup.clear()
            started = time.monotonic()
            try:
                pods = list(trainer_pods.get((namespace, name), []))
                pools = list(gpu_pools.get(None, []))
                await follower.pass_once(body, pods, pools)
            except ChildrenRefused:  # already an Event and a log line: count it, retry next pass
                runtime.metrics.handler_errors.labels(FOLLOW_HANDLER).inc()
            except Exception:  # one bad pass must not end the job's daemon: log, count, retry next pass
                runtime.metrics.handler_errors.labels(FOLLOW_HANDLER).inc()
                logger.exception("reconcile pass failed; retrying")
            finally:
                runtime.metrics.reconcile_seconds.observe(time.monotonic() - started)
            await _sleep(wakeup, stopped, _interval(runtime, follower))
    finally:
        runtime.forget(namespace, name)
        runtime.metrics.job_gone(follower.key)


def _api_message(error: ApiException) -> str:
    """The Status message of an API error (what kubectl prints), else its body."""
    try:
        return str(json.loads(error.body or "").get("message") or error.body)
    except (ValueError, AttributeError):
        return str(error.body)


def _interval(runtime: Runtime, follower: JobFollower) -> float:
    """Wake sooner while running so progress stays fresh; the resync period otherwise."""
    phase = (follower.written or {}).get("phase")
    settings = runtime.settings
    if phase in {p.value for p in ACTIVE}:
        return min(settings.resync_seconds, settings.progress_seconds)
    return settings.resync_seconds


async def _sleep(wakeup: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Until a job or pod event, the interval, or the daemon being stopped, whichever comes first."""
    deadline = time.monotonic() + seconds
    while not stopped and not wakeup.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(wakeup.wait(), timeout=min(left, 1.0))
        except TimeoutError:
            continue
