"""The operator's own Prometheus metrics (``/metrics`` on ``--metrics-port``).

Fleet series: ``memfit_operator_jobs{phase}``, ``memfit_operator_plans_total{method,zero_stage}``,
``memfit_operator_oom_replans_total``, ``memfit_operator_restarts_total``,
``memfit_operator_reconcile_duration_seconds``, ``memfit_operator_handler_errors_total{handler}``.
Per job (label ``finetunejob`` = namespace/name, like the trainer's series): ``memfit_job_phase{phase}``
(1 for the current phase), ``memfit_job_gpus`` (while its pods exist), ``memfit_job_replans``,
``memfit_job_restarts``. A job's series disappear when the job does.
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from memfit.api.finetunejob import FineTuneJobStatus
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Phase

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
"""A pass is a few milliseconds of logic plus API calls; planning a large inventory takes ~50 ms."""
PODS_EXIST = (Phase.LAUNCHING, Phase.RUNNING, Phase.RESTARTING)
FOLLOW_HANDLER = "follow_job"
"""The handler whose failed passes memfit_operator_handler_errors_total counts (the per-job daemon)."""


class OperatorMetrics:
    """One registry per operator process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._jobs = Gauge("memfit_operator_jobs", "FineTuneJobs this operator follows, by status phase.",
                           ["phase"], registry=self.registry)  # fmt: skip
        self.plans = Counter("memfit_operator_plans", "Plans adopted (first plans and re-plans).",
                             ["method", "zero_stage"], registry=self.registry)  # fmt: skip
        self.oom_replans = Counter("memfit_operator_oom_replans", "Re-plans after an out-of-memory failure.",
                                   registry=self.registry)  # fmt: skip
        self.restarts = Counter("memfit_operator_restarts", "Gang restarts after a failed rank.",
                                registry=self.registry)  # fmt: skip
        self.reconcile_seconds = Histogram("memfit_operator_reconcile_duration_seconds",
                                           "Wall time of one reconcile pass over one job, API calls included.",
                                           buckets=RECONCILE_BUCKETS, registry=self.registry)  # fmt: skip
        self.handler_errors = Counter("memfit_operator_handler_errors", "Reconcile passes that raised.",
                                      ["handler"], registry=self.registry)  # fmt: skip
        self._job_phase = Gauge("memfit_job_phase", "1 for the FineTuneJob's current status phase.",
                                ["finetunejob", "phase"], registry=self.registry)  # fmt: skip
        self._job_gpus = Gauge("memfit_job_gpus", "GPUs the FineTuneJob's current plan uses, while its pods exist.",
                               ["finetunejob"], registry=self.registry)  # fmt: skip
        self._job_replans = Gauge("memfit_job_replans", "Out-of-memory re-plans of the FineTuneJob so far.",
                                  ["finetunejob"], registry=self.registry)  # fmt: skip
        self._job_restarts = Gauge("memfit_job_restarts", "Gang restarts of the FineTuneJob so far.",
                                   ["finetunejob"], registry=self.registry)  # fmt: skip
        self.handler_errors.labels(FOLLOW_HANDLER)  # a 0 series from the start, not an absent one
        self._phases: dict[str, Phase] = {}
        for phase in Phase:
            self._jobs.labels(phase.value).set(0)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def plan_adopted(self, plan: PlanCandidate) -> None:
        self.plans.labels(plan.strategy.method, str(plan.strategy.zero_stage)).inc()

    def job_status(self, job: str, status: FineTuneJobStatus) -> None:
        """Record a job's latest status."""
        previous = self._phases.get(job)
        if status.phase is None:
            return
        if previous is not None and previous is not status.phase:
            self._job_phase.remove(job, previous.value)
        self._phases[job] = status.phase
        self._job_phase.labels(job, status.phase.value).set(1)
        self._job_replans.labels(job).set(status.replans)
        self._job_restarts.labels(job).set(status.restarts)
        if status.phase in PODS_EXIST and status.gpus:
            self._job_gpus.labels(job).set(status.gpus)
        else:
            self._forget(self._job_gpus, job)
        self._count_phases()

    def job_gone(self, job: str) -> None:
        phase = self._phases.pop(job, None)
        if phase is not None:
            self._job_phase.remove(job, phase.value)
        for gauge in (self._job_gpus, self._job_replans, self._job_restarts):
            self._forget(gauge, job)
        self._count_phases()

    @staticmethod
    def _forget(gauge: Gauge, job: str) -> None:
        with contextlib.suppress(KeyError):  # never set, or already removed
            gauge.remove(job)

    def _count_phases(self) -> None:
        tally = Tally(self._phases.values())
        for phase in Phase:
            self._jobs.labels(phase.value).set(tally[phase])
