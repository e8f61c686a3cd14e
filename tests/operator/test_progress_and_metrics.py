"""Progress read from rank 0's /metrics (memfit_operator.progress) and the operator's own metrics
(memfit_operator.metrics): parsing and registry bookkeeping, and the scrape against a local HTTP server."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from memfit.api.finetunejob import FineTuneJobStatus, Progress
from memfit.api.loading import load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Method, Phase
from memfit.contract.progress import (
    CHECKPOINT_STEP_METRIC,
    ETA_METRIC,
    RESUMED_FROM_STEP_METRIC,
    SET_ASIDE_METRIC,
    STEP_METRIC,
    TOKENS_PER_SECOND_METRIC,
    TOTAL_STEPS_METRIC,
)
from memfit.planner.search import plan_job
from memfit_operator import progress as progress_module
from memfit_operator.metrics import OperatorMetrics
from memfit_operator.objects import RANK_LABEL
from memfit_operator.progress import TrainerReport, fetch_progress, parse_trainer_metrics, rank0_address
from memfit_operator.status import Resumption

ROOT = Path(__file__).parent.parent.parent
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
JOB = "research/llama-chat"


def exposition(ranks: dict[str, dict[str, float]], extra_labels: bool = True) -> str:
    """/metrics text as the trainer serves it: one gauge family per series, labelled finetunejob and rank."""
    registry = CollectorRegistry()
    names = sorted({name for values in ranks.values() for name in values})
    gauges = {name: Gauge(name, f"{name} help", ["finetunejob", "rank"], registry=registry) for name in names}
    for rank, values in ranks.items():
        for name, value in values.items():
            gauges[name].labels(JOB, rank).set(value)
    # Series the operator does not read, as the trainer exports them too.
    if extra_labels:
        Counter("memfit_train_tokens", "tokens", ["finetunejob", "rank"], registry=registry).labels(JOB, "0").inc(5)
        memory = Gauge("memfit_gpu_memory_allocated_bytes", "m", ["finetunejob", "rank", "device"], registry=registry)
        memory.labels(JOB, "0", "cuda:0").set(1e9)
    return generate_latest(registry).decode()


FULL = {
    STEP_METRIC: 120,
    TOTAL_STEPS_METRIC: 1000,
    ETA_METRIC: 3270.4,
    TOKENS_PER_SECOND_METRIC: 665.2,
    CHECKPOINT_STEP_METRIC: 100,
}


# ------------------------------------------------------------------------------------------------
# parse_trainer_metrics
# ------------------------------------------------------------------------------------------------


def parsed(text: str, world_size: int, now: datetime) -> Progress | None:
    """The progress of rank 0's exposition (what lands in status.progress)."""
    report = parse_trainer_metrics(text, world_size, now)
    return report.progress if report is not None else None


def test_every_progress_series_of_rank_0() -> None:
    progress = parsed(exposition({"0": FULL}), world_size=8, now=NOW)
    assert progress is not None
    assert progress.step == 120 and progress.total_steps == 1000 and progress.percent == 12
    assert progress.tokens_per_second == pytest.approx(665.2 * 8)
    assert progress.tokens_per_second == round(665.2 * 8, 1)
    assert progress.eta == "2026-01-01T12:54:30Z"  # 3270.4 s later, whole seconds
    assert progress.last_checkpoint_step == 100
    assert progress.updated == "2026-01-01T12:00:00Z"


def test_before_the_first_step_there_is_no_progress() -> None:
    assert parsed("", world_size=8, now=NOW) is None
    assert parsed(exposition({"0": {TOTAL_STEPS_METRIC: 1000}}), world_size=8, now=NOW) is None


def test_series_not_exported_yet_stay_null_never_invented() -> None:
    progress = parsed(exposition({"0": {STEP_METRIC: 3}}, extra_labels=False), 4, NOW)
    assert progress is not None
    assert progress.step == 3 and progress.total_steps is None and progress.percent == 0
    assert progress.tokens_per_second is None and progress.eta is None and progress.last_checkpoint_step is None
    assert progress.updated == "2026-01-01T12:00:00Z"


def test_only_rank_0_counts() -> None:
    other = {STEP_METRIC: 999, TOTAL_STEPS_METRIC: 5, TOKENS_PER_SECOND_METRIC: 1.0, CHECKPOINT_STEP_METRIC: 998}
    text = exposition({"1": other, "0": FULL, "7": other})
    progress = parsed(text, world_size=8, now=NOW)
    assert progress is not None and (progress.step, progress.total_steps, progress.last_checkpoint_step) == (
        120, 1000, 100)  # fmt: skip
    assert parsed(exposition({"1": other}), world_size=8, now=NOW) is None


def test_unlabelled_series_count_as_rank_0() -> None:
    text = f"# TYPE {STEP_METRIC} gauge\n{STEP_METRIC} 7\n# TYPE {TOTAL_STEPS_METRIC} gauge\n{TOTAL_STEPS_METRIC} 70\n"
    progress = parsed(text, world_size=1, now=NOW)
    assert progress is not None and (progress.step, progress.percent) == (7, 10)


@pytest.mark.parametrize(("step", "total", "percent"), [(0, 1000, 0), (999, 1000, 99), (1000, 1000, 100), (1, 3, 33)])
def test_percent_rounds_down(step: int, total: int, percent: int) -> None:
    progress = parsed(exposition({"0": {STEP_METRIC: step, TOTAL_STEPS_METRIC: total}}), 1, NOW)
    assert progress is not None and progress.percent == percent


def test_a_zero_total_gives_zero_percent_not_a_division_error() -> None:
    progress = parsed(exposition({"0": {STEP_METRIC: 0, TOTAL_STEPS_METRIC: 0}}), 1, NOW)
    assert progress is not None and progress.percent == 0


def test_eta_and_updated_are_utc_whatever_the_clock_zone() -> None:
    local = NOW.astimezone(timezone(timedelta(hours=5, minutes=30)))
    progress = parsed(exposition({"0": {STEP_METRIC: 1, ETA_METRIC: 60}}), 1, local)
    assert progress is not None
    assert progress.updated == "2026-01-01T12:00:00Z" and progress.eta == "2026-01-01T12:01:00Z"


def test_tokens_per_second_scales_with_the_world_size() -> None:
    text = exposition({"0": {STEP_METRIC: 1, TOKENS_PER_SECOND_METRIC: 100.04}})
    assert parsed(text, 1, NOW).tokens_per_second == 100.0  # type: ignore[union-attr]
    assert parsed(text, 32, NOW).tokens_per_second == 3201.3  # type: ignore[union-attr]


def test_where_rank_0_resumed_from_and_what_it_set_aside_travel_beside_the_progress() -> None:
    resumed = {RESUMED_FROM_STEP_METRIC: 100, SET_ASIDE_METRIC: 2}
    text = exposition({"0": FULL | resumed, "1": FULL | {RESUMED_FROM_STEP_METRIC: 7, SET_ASIDE_METRIC: 9}})
    report = parse_trainer_metrics(text, world_size=8, now=NOW)
    assert report is not None and report.resumption == Resumption(step=100, set_aside=2)
    # The attempt's business, not status.progress's: the progress is what it was without the two series.
    assert report.progress == parsed(exposition({"0": FULL}), world_size=8, now=NOW)
    assert not {"resumedFromStep", "checkpointsSetAside"} & set(report.progress.to_api())


def test_a_trainer_that_set_nothing_aside_and_exports_no_resumed_step_started_from_the_weights() -> None:
    report = parse_trainer_metrics(exposition({"0": FULL | {SET_ASIDE_METRIC: 0}}), world_size=8, now=NOW)
    assert report is not None and report.resumption == Resumption(step=None, set_aside=0)
    everything_set_aside = exposition({"0": FULL | {SET_ASIDE_METRIC: 3}})
    assert parse_trainer_metrics(everything_set_aside, 8, NOW).resumption == Resumption(None, 3)  # type: ignore[union-attr]


def test_no_resumption_from_a_trainer_without_the_set_aside_series_or_before_its_first_step() -> None:
    older = parse_trainer_metrics(exposition({"0": FULL}), world_size=8, now=NOW)  # a trainer older than the series
    assert older is not None and older.resumption is None
    # Before the first step the resume may still be under way: no resumed step yet is not "from the weights".
    assert parse_trainer_metrics(exposition({"0": {SET_ASIDE_METRIC: 0, TOTAL_STEPS_METRIC: 1000}}), 8, NOW) is None


@pytest.mark.parametrize(
    "series",
    [{SET_ASIDE_METRIC: -1}, {SET_ASIDE_METRIC: math.nan}, {SET_ASIDE_METRIC: 2.0**60},
     {SET_ASIDE_METRIC: 0, RESUMED_FROM_STEP_METRIC: math.nan}, {SET_ASIDE_METRIC: 1, RESUMED_FROM_STEP_METRIC: -5}],
)  # fmt: skip
def test_numbers_status_cannot_hold_are_no_resumption(series: dict[str, float]) -> None:
    report = parse_trainer_metrics(exposition({"0": FULL | series}), world_size=8, now=NOW)
    assert report is not None and report.resumption is None and report.progress.step == 120


# ------------------------------------------------------------------------------------------------
# rank0_address
# ------------------------------------------------------------------------------------------------


UID = "0f1e2d3c-uid"


def owner(uid: str = UID, **changes: object) -> dict:
    return {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "name": "job", "uid": uid,
            "controller": True, "blockOwnerDeletion": True, **changes}  # fmt: skip


def pod(rank: str | None, ip: str | None = None, owners: list[dict] | None = None) -> dict:
    labels = {RANK_LABEL: rank} if rank is not None else {}
    status = {"phase": "Running", "podIP": ip} if ip is not None else {"phase": "Pending"}
    metadata = {"name": f"job-a1-n{rank}", "labels": labels, "ownerReferences": [owner()] if owners is None else owners}
    return {"metadata": metadata, "status": status}


def test_rank0_address_is_rank_0s_pod_ip() -> None:
    assert rank0_address([pod("1", "10.0.0.2"), pod("0", "10.0.0.1"), pod("2", "10.0.0.3")], UID) == "10.0.0.1"


def test_rank0_address_is_none_until_rank_0_has_an_ip() -> None:
    assert rank0_address([pod("1", "10.0.0.2"), pod("0")], UID) is None
    assert rank0_address([pod("1", "10.0.0.2")], UID) is None
    assert rank0_address([], UID) is None
    assert rank0_address([{"metadata": {"name": "x", "labels": None}, "status": None}], UID) is None
    assert rank0_address([{"metadata": {"name": "x", "labels": {RANK_LABEL: "0"}}}], UID) is None


def test_rank0_address_ignores_pods_without_the_rank_label() -> None:
    assert rank0_address([pod(None, "10.9.9.9"), pod("0", "10.0.0.1")], UID) == "10.0.0.1"


@pytest.mark.parametrize(
    "owners",
    [
        [],  # labels copied onto a pod of one's own
        [owner(uid="another-job-uid")],  # the job's name, not its uid (e.g. a job deleted and created again)
        [owner(controller=False)],  # an owner, not the controller
        [owner(kind="Deployment")],
        [owner(apiVersion="example.com/v1")],
    ],
)
def test_rank0_address_only_of_a_pod_the_job_controls(owners: list[dict]) -> None:
    """Labels alone never make a pod a scrape target: anyone who may create pods can copy them."""
    assert rank0_address([pod("0", "169.254.169.254", owners)], UID) is None
    assert rank0_address([pod("0", "169.254.169.254", owners), pod("0", "10.0.0.1")], UID) == "10.0.0.1"


# ------------------------------------------------------------------------------------------------
# fetch_progress: bounded in time and size, parsed off the event loop
# ------------------------------------------------------------------------------------------------


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    app.router.add_get("/elsewhere", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def fetch(handler: Callable[[web.Request], Awaitable[web.StreamResponse]], **limits: float) -> tuple[object, float]:
    """fetch_progress against a local server answering with ``handler``: (its result, seconds taken)."""

    async def run() -> tuple[object, float]:
        runner, port = await _serve(handler)
        try:
            async with aiohttp.ClientSession() as session:
                started = time.monotonic()
                result = await fetch_progress(session, "127.0.0.1", port, 8, **limits)  # type: ignore[arg-type]
                return result, time.monotonic() - started
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def test_fetch_progress_reads_rank_0() -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=exposition({"0": FULL}))

    report, _ = fetch(metrics)
    assert isinstance(report, TrainerReport) and report.progress.step == 120


def test_a_reply_over_the_size_limit_is_refused_not_read() -> None:
    """A 400 MB reply took the operator 85 s and 2.5 GB: now it stops reading at SCRAPE_MAX_BYTES."""
    sent = []

    async def huge(request: web.Request) -> web.StreamResponse:  # valid exposition, just far too much of it
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(exposition({"0": FULL}).encode())
        line = b'memfit_padding_total{rank="0",x="' + b"y" * 1000 + b'"} 1\n'
        try:
            for _ in range(200_000):  # 200 MB if it were all read
                await response.write(line * 64)
                sent.append(len(line) * 64)
        except (ConnectionResetError, RuntimeError):
            pass
        return response

    progress, seconds = fetch(huge, max_bytes=1024**2)
    assert progress is None
    assert seconds < 2.5, "refused as soon as the limit was crossed, not at the timeout"
    assert sum(sent) < 64 * 1024**2, "the operator stopped reading; the server did not get to send it all"


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def declared(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (2 * 1024**2))

    assert fetch(declared, max_bytes=1024**2)[0] is None


def test_a_reply_trickling_in_is_cut_at_the_timeout() -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"# a comment, one byte at a time\n")
            await asyncio.sleep(0.1)
        return response

    progress, seconds = fetch(slow, timeout=0.5)
    assert progress is None and seconds < 1.5


def test_a_redirect_is_not_followed() -> None:
    async def redirect(request: web.Request) -> web.Response:
        if request.path == "/metrics":
            raise web.HTTPFound("/elsewhere")
        return web.Response(text=exposition({"0": FULL}))

    assert fetch(redirect)[0] is None


def test_text_that_is_not_the_exposition_format_is_no_progress_not_an_error() -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="memfit_train_step{rank=0 oops\n")

    assert fetch(garbage)[0] is None


def test_parsing_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    parsed_in: list[int] = []
    real = progress_module.parse_trainer_metrics

    def recording(*args: object) -> object:
        parsed_in.append(threading.get_ident())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(progress_module, "parse_trainer_metrics", recording)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=exposition({"0": FULL}))

    assert isinstance(fetch(metrics)[0], TrainerReport)
    assert parsed_in and loop_thread not in parsed_in


# ------------------------------------------------------------------------------------------------
# OperatorMetrics
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def metrics() -> OperatorMetrics:
    return OperatorMetrics()


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def jobs_by_phase(metrics: OperatorMetrics) -> dict[str, float | None]:
    return {phase.value: value(metrics, "memfit_operator_jobs", phase=phase.value) for phase in Phase}


def job_series(metrics: OperatorMetrics, job: str) -> list[tuple[str, dict[str, str], float]]:
    return sorted(
        (s.name, dict(s.labels), s.value)
        for family in metrics.registry.collect()
        for s in family.samples
        if s.labels.get("finetunejob") == job
    )


def status(phase: Phase | None, gpus: int | None = 8, replans: int = 0, restarts: int = 0) -> FineTuneJobStatus:
    return FineTuneJobStatus(phase=phase, gpus=gpus, replans=replans, restarts=restarts)


def test_every_phase_counts_zero_before_any_job(metrics: OperatorMetrics) -> None:
    assert jobs_by_phase(metrics) == {phase.value: 0.0 for phase in Phase}
    assert job_series(metrics, JOB) == []


def test_a_running_job_has_its_series(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.RUNNING, gpus=16, replans=1, restarts=2))
    assert job_series(metrics, JOB) == sorted([
        ("memfit_job_phase", {"finetunejob": JOB, "phase": "Running"}, 1.0),
        ("memfit_job_gpus", {"finetunejob": JOB}, 16.0),
        ("memfit_job_replans", {"finetunejob": JOB}, 1.0),
        ("memfit_job_restarts", {"finetunejob": JOB}, 2.0),
    ])  # fmt: skip
    assert jobs_by_phase(metrics) == {p.value: float(p is Phase.RUNNING) for p in Phase}


@pytest.mark.parametrize("phase", [Phase.LAUNCHING, Phase.RUNNING, Phase.RESTARTING])
def test_gpus_are_reported_while_pods_exist(metrics: OperatorMetrics, phase: Phase) -> None:
    metrics.job_status(JOB, status(phase, gpus=8))
    assert value(metrics, "memfit_job_gpus", finetunejob=JOB) == 8


@pytest.mark.parametrize(
    "phase", [Phase.PENDING, Phase.INVALID, Phase.UNSCHEDULABLE, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED]
)
def test_gpus_disappear_when_no_pods_exist(metrics: OperatorMetrics, phase: Phase) -> None:
    metrics.job_status(JOB, status(Phase.RUNNING, gpus=8))
    metrics.job_status(JOB, status(phase, gpus=8))
    assert value(metrics, "memfit_job_gpus", finetunejob=JOB) is None
    assert value(metrics, "memfit_job_phase", finetunejob=JOB, phase=phase.value) == 1


def test_a_phase_change_replaces_the_phase_series(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.LAUNCHING))
    metrics.job_status(JOB, status(Phase.RUNNING))
    metrics.job_status(JOB, status(Phase.SUCCEEDED))
    phases = [labels["phase"] for name, labels, _ in job_series(metrics, JOB) if name == "memfit_job_phase"]
    assert phases == ["Succeeded"]
    assert jobs_by_phase(metrics)["Succeeded"] == 1 and jobs_by_phase(metrics)["Running"] == 0
    assert sum(v or 0 for v in jobs_by_phase(metrics).values()) == 1


def test_the_same_phase_twice_keeps_one_series_and_updates_counts(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.RUNNING, restarts=0))
    metrics.job_status(JOB, status(Phase.RUNNING, restarts=1))
    assert value(metrics, "memfit_job_restarts", finetunejob=JOB) == 1
    assert jobs_by_phase(metrics)["Running"] == 1


def test_a_status_without_a_phase_records_nothing(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(None))
    assert job_series(metrics, JOB) == []
    assert sum(v or 0 for v in jobs_by_phase(metrics).values()) == 0


def test_jobs_are_counted_by_phase(metrics: OperatorMetrics) -> None:
    metrics.job_status("a/one", status(Phase.RUNNING))
    metrics.job_status("a/two", status(Phase.RUNNING))
    metrics.job_status("b/three", status(Phase.INVALID, gpus=None))
    counts = jobs_by_phase(metrics)
    assert counts["Running"] == 2 and counts["Invalid"] == 1 and sum(v or 0 for v in counts.values()) == 3
    metrics.job_status("a/two", status(Phase.FAILED))
    counts = jobs_by_phase(metrics)
    assert counts["Running"] == 1 and counts["Failed"] == 1 and sum(v or 0 for v in counts.values()) == 3


def test_a_deleted_job_loses_every_series_and_its_count(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.RUNNING, replans=1, restarts=1))
    metrics.job_status("other/job", status(Phase.RUNNING))
    metrics.job_gone(JOB)
    assert job_series(metrics, JOB) == []
    assert jobs_by_phase(metrics)["Running"] == 1
    assert value(metrics, "memfit_job_phase", finetunejob="other/job", phase="Running") == 1
    metrics.job_gone(JOB)  # twice: harmless
    metrics.job_gone("never/seen")  # never recorded: harmless
    assert jobs_by_phase(metrics)["Running"] == 1


def test_a_job_that_comes_back_after_deletion_starts_afresh(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.FAILED, restarts=3))
    metrics.job_gone(JOB)
    metrics.job_status(JOB, status(Phase.LAUNCHING, restarts=0))
    assert value(metrics, "memfit_job_restarts", finetunejob=JOB) == 0
    assert value(metrics, "memfit_job_phase", finetunejob=JOB, phase="Failed") is None
    assert jobs_by_phase(metrics)["Launching"] == 1 and jobs_by_phase(metrics)["Failed"] == 0


def test_registries_are_per_instance() -> None:
    first, second = OperatorMetrics(), OperatorMetrics()
    first.job_status(JOB, status(Phase.RUNNING))
    assert second.registry.get_sample_value("memfit_operator_jobs", {"phase": "Running"}) == 0


@pytest.fixture(scope="module")
def plan() -> PlanCandidate:
    import yaml

    from memfit.api.finetunejob import FineTuneJobSpec

    document = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())
    chosen = plan_job(
        FineTuneJobSpec.model_validate(document["spec"]), load_documents(ROOT / "examples" / "inventory.yaml").pools
    ).chosen
    assert chosen is not None
    return chosen


def test_plans_are_counted_by_method_and_zero_stage(metrics: OperatorMetrics, plan: PlanCandidate) -> None:
    labels = {"method": plan.strategy.method, "zero_stage": str(plan.strategy.zero_stage)}
    assert value(metrics, "memfit_operator_plans_total", **labels) is None
    metrics.plan_adopted(plan)
    metrics.plan_adopted(plan)
    assert value(metrics, "memfit_operator_plans_total", **labels) == 2
    lora = plan.model_copy(update={"strategy": replace(plan.strategy, method=Method.LORA, zero_stage=0)})
    metrics.plan_adopted(lora)
    assert value(metrics, "memfit_operator_plans_total", method="lora", zero_stage="0") == 1
    assert value(metrics, "memfit_operator_plans_total", **labels) == 2


def test_fleet_counters_and_the_reconcile_histogram(metrics: OperatorMetrics) -> None:
    assert value(metrics, "memfit_operator_restarts_total") == 0
    assert value(metrics, "memfit_operator_oom_replans_total") == 0
    metrics.restarts.inc()
    metrics.oom_replans.inc()
    metrics.oom_replans.inc()
    metrics.handler_errors.labels("follow_job").inc()
    metrics.reconcile_seconds.observe(0.003)
    metrics.reconcile_seconds.observe(0.2)
    assert value(metrics, "memfit_operator_restarts_total") == 1
    assert value(metrics, "memfit_operator_oom_replans_total") == 2
    assert value(metrics, "memfit_operator_handler_errors_total", handler="follow_job") == 1
    assert value(metrics, "memfit_operator_reconcile_duration_seconds_count") == 2
    assert value(metrics, "memfit_operator_reconcile_duration_seconds_bucket", le="0.005") == 1
    assert value(metrics, "memfit_operator_reconcile_duration_seconds_bucket", le="0.25") == 2


def test_the_exposition_names_match_the_module_docstring(metrics: OperatorMetrics) -> None:
    metrics.job_status(JOB, status(Phase.RUNNING))
    text = generate_latest(metrics.registry).decode()
    for name in ("memfit_operator_jobs", "memfit_operator_plans_total", "memfit_operator_oom_replans_total",
                 "memfit_operator_restarts_total", "memfit_operator_reconcile_duration_seconds",
                 "memfit_operator_handler_errors_total", "memfit_job_phase", "memfit_job_gpus",
                 "memfit_job_replans", "memfit_job_restarts"):  # fmt: skip
        assert f"# TYPE {name} " in text, name
