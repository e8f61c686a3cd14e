"""The FineTuneJob state machine (memfit_operator.reconcile), driven like a tiny fake cluster.

``FakeCluster`` holds the job as the API server would return it, the pods and other children, and the
Events. ``step()`` runs one reconcile pass and applies its Decision the way the handlers do (status
replaced, objects created unless they exist, pods deleted); the kubelet helpers set pod statuses.
No cluster, no torch, no network.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJobSpec, FineTuneJobStatus, Progress
from memfit.api.gpupool import GPUPool
from memfit.api.loading import load_documents
from memfit.api.vocabulary import MANAGED_BY, MANAGED_BY_LABEL, Phase
from memfit.contract.progress import Progress as TrainerProgress
from memfit.contract.termination import completed_message
from memfit.units import GIB
from memfit_operator.objects import ATTEMPT_LABEL, CONFIG_FILE, PROFILE_LABEL, RANK_LABEL, TrainerOptions
from memfit_operator.reconcile import Decision, Event, Observation, reconcile
from memfit_operator.status import Resumption

ROOT = Path(__file__).parent.parent.parent
IMAGE = "registry.example/memfit-trainer:0.1.0"
POOLS: list[GPUPool] = load_documents(ROOT / "examples" / "inventory.yaml").pools


def job_document(preset: str | None = None, **spec: Any) -> dict[str, Any]:
    """The example job as the API server returns it (uid, generation, empty status); ``spec`` overrides."""
    document = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())
    document["metadata"].update({"uid": "0f1e2d3c-uid", "generation": 1, "resourceVersion": "1"})
    if preset is not None:
        document["spec"]["model"]["architecture"] = {"preset": preset}
    document["spec"].update(spec)
    document["status"] = {}
    return document


def multi_node_document(**spec: Any) -> dict[str, Any]:
    """Full fine-tuning of a 70B model on the A100 pool: a gang of several node ranks."""
    return job_document("llama-2-70b", method="full", resources={"pool": "a100-80gb"}, **spec)


class FakeCluster:
    """One job, its children and its Events, changed only by applied Decisions and the test."""

    def __init__(self, document: dict[str, Any], pools: list[GPUPool] | None = None) -> None:
        self.job = document
        self.pools = list(POOLS if pools is None else pools)
        self.pods: dict[str, dict[str, Any]] = {}
        self.others: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[Event] = []
        self.decisions: list[Decision] = []
        self.clock = 0

    # --- the operator's side -------------------------------------------------------------------
    def observe(self, progress: Progress | None = None, resumption: Resumption | None = None) -> Observation:
        self.clock += 1
        now = f"2026-01-01T00:{self.clock // 60:02d}:{self.clock % 60:02d}Z"
        # Round-trip through JSON: reconcile sees plain data, as the API server returns it.
        job = json.loads(json.dumps(self.job))
        pods = [json.loads(json.dumps(p)) for p in self.pods.values()]
        profiles = [json.loads(json.dumps(o)) for (kind, _), o in self.others.items()
                    if kind == "ConfigMap" and PROFILE_LABEL in o["metadata"].get("labels", {})]  # fmt: skip
        return Observation(job=job, pods=pods, pools=list(self.pools), progress=progress, now=now, profiles=profiles,
                           resumption=resumption)  # fmt: skip

    def step(self, progress: Progress | None = None, resumption: Resumption | None = None) -> Decision:
        """One pass; ``progress`` and ``resumption``: what rank 0's metrics said (read in this pass)."""
        observation = self.observe(progress, resumption)
        frozen = copy.deepcopy((observation.job, list(observation.pods)))
        decision = reconcile(observation, IMAGE)
        assert (observation.job, list(observation.pods)) == frozen, "reconcile must not change its input"
        self.apply(decision)
        return decision

    def apply(self, decision: Decision, create: bool = True) -> None:
        self.decisions.append(decision)
        self.job["status"] = decision.status.to_api()
        for name in decision.delete:
            self.pods.pop(name, None)  # deleting a missing pod is a no-op
        if create:
            for manifest in decision.create:
                self.create(manifest)
        self.events.extend(decision.events)

    def create(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        if manifest["kind"] == "Pod":
            self.pods.setdefault(name, copy.deepcopy(manifest))  # 409 Conflict: the existing one stays
        else:
            self.others.setdefault((manifest["kind"], name), copy.deepcopy(manifest))

    # --- the user's side -----------------------------------------------------------------------
    def edit_spec(self, **changes: Any) -> None:
        """kubectl edit: the spec changes and the API server bumps metadata.generation."""
        self.job["spec"].update(copy.deepcopy(changes))
        self.job["metadata"]["generation"] += 1

    # --- the kubelet's side --------------------------------------------------------------------
    def attempt_pods(self, attempt: int) -> list[str]:
        return sorted(n for n, p in self.pods.items() if p["metadata"]["labels"][ATTEMPT_LABEL] == str(attempt))

    def running(self, *names: str) -> None:
        for name in names or list(self.pods):
            self.pods[name]["status"] = {
                "phase": "Running",
                "podIP": f"10.0.0.{len(name)}",
                "containerStatuses": [{"name": "trainer", "state": {"running": {"startedAt": "now"}}}],
            }

    def terminated(self, name: str, phase: str, exit_code: int, reason: str, message: str | None = None) -> None:
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": reason}
        if message is not None:
            terminated["message"] = message
        self.pods[name]["status"] = {
            "phase": phase,
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        }

    def succeeded(self, *names: str) -> None:
        for name in names or list(self.pods):
            self.terminated(name, "Succeeded", 0, "Completed")

    def failed(self, name: str, exit_code: int = 1) -> None:
        self.terminated(name, "Failed", exit_code, "Error", "Traceback (most recent call last): ...")

    def oom_killed(self, name: str) -> None:
        self.terminated(name, "Failed", 137, "OOMKilled")

    def trainer_oom(self, name: str, step: int = 3, measured: int = 79 * GIB, planned: int = 62 * GIB) -> None:
        message = json.dumps({"reason": "OutOfMemory", "step": step, "measuredPeakBytes": measured,
                              "plannedPeakBytes": planned, "message": "CUDA out of memory"})  # fmt: skip
        self.terminated(name, "Failed", 1, "Error", message)

    # --- reading -------------------------------------------------------------------------------
    @property
    def status(self) -> FineTuneJobStatus:
        return FineTuneJobStatus.model_validate(self.job["status"])

    @property
    def raw_status(self) -> dict[str, Any]:
        return self.job["status"]

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.raw_status["conditions"] if c["type"] == type_)

    def launch_running(self) -> Decision:
        """Plan, launch and see every rank running."""
        first = self.step()
        self.running()
        self.step()
        assert self.raw_status["phase"] == "Running"
        return first


def owned_by_the_job(**changes: Any) -> dict[str, Any]:
    """The owner reference the operator puts on the job's children (uid of job_document())."""
    return {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "name": "llama-chat", "uid": "0f1e2d3c-uid",
            "controller": True, "blockOwnerDeletion": True, **changes}  # fmt: skip


def reasons(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.type, e.reason) for e in events]


def pod_names(decision: Decision) -> list[str]:
    return [o["metadata"]["name"] for o in decision.create if o["kind"] == "Pod"]


def kinds(decision: Decision) -> list[str]:
    return [o["kind"] for o in decision.create]


def quiet(decision: Decision) -> bool:
    """Nothing to do: no objects, no deletions, no Events."""
    return not decision.create and not decision.delete and not decision.events


def trainer_config(cluster: FakeCluster, attempt: int) -> dict[str, Any]:
    config_map = cluster.others[("ConfigMap", f"llama-chat-a{attempt}")]
    return json.loads(config_map["data"][CONFIG_FILE])


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(job_document())


@pytest.fixture
def gang() -> FakeCluster:
    return FakeCluster(multi_node_document())


# ================================================================================================
# First pass: plan and launch
# ================================================================================================


def test_first_pass_plans_writes_status_and_launches_one_pod_per_node_rank(gang: FakeCluster) -> None:
    decision = gang.step()
    status = decision.status
    plan = status.plan
    assert plan is not None and plan.fits and plan.strategy.nodes > 1
    nodes = plan.strategy.nodes
    assert status.phase is Phase.LAUNCHING
    assert status.gpus == plan.strategy.gpus == nodes * plan.strategy.gpus_per_node
    assert status.memory_per_gpu == f"{plan.memory.per_gpu.total / GIB:.1f}/{plan.gpu_memory_bytes / GIB:.1f} GiB"
    assert status.observed_generation == 1
    assert [a.number for a in status.attempts] == [1]
    attempt = status.attempts[0]
    assert attempt.strategy_summary == plan.strategy.summary()
    assert attempt.started == "2026-01-01T00:00:01Z" and attempt.finished is None and attempt.outcome is None
    assert attempt.resumed_from_step is None
    assert status.restarts == 0 and status.replans == 0 and status.excluded_strategies == []
    assert status.launched_spec is not None and status.launched_spec.suspend is False
    assert status.launched_spec.to_api() == FineTuneJobSpec.model_validate(gang.job["spec"]).to_api()
    assert status.launched_spec.training.global_batch_size == 64

    ready, planned = gang.condition("Ready"), gang.condition("Planned")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "SpecAccepted", 1)
    assert (planned["status"], planned["reason"], planned["observedGeneration"]) == ("True", "Planned", 1)
    assert plan.strategy.summary() in planned["message"] and status.memory_per_gpu.split("/")[0] in planned["message"]
    running = gang.condition("Running")
    assert (running["status"], running["reason"]) == ("False", "Launching")

    assert reasons(decision.events) == [("Normal", "Planned"), ("Normal", "Launching")]
    assert plan.strategy.summary() in decision.events[0].message
    assert "attempt 1" in decision.events[1].message and "from the model weights" in decision.events[1].message

    assert kinds(decision) == ["ConfigMap", "Service"] + ["Pod"] * nodes
    assert pod_names(decision) == [f"llama-chat-a1-n{rank}" for rank in range(nodes)]
    ranks = [o["metadata"]["labels"][RANK_LABEL] for o in decision.create if o["kind"] == "Pod"]
    assert ranks == [str(rank) for rank in range(nodes)]
    for pod in (o for o in decision.create if o["kind"] == "Pod"):
        assert pod["metadata"]["labels"][ATTEMPT_LABEL] == "1"
        assert pod["spec"]["containers"][0]["image"] == IMAGE
        assert f"--nnodes={nodes}" in pod["spec"]["containers"][0]["command"]
    assert decision.delete == []
    assert decision.planned == plan and not decision.restarted and not decision.replanned_after_oom


def test_the_trainer_config_of_the_launch_carries_the_plan(cluster: FakeCluster) -> None:
    decision = cluster.step()
    plan = decision.status.plan
    assert plan is not None
    config = trainer_config(cluster, 1)
    training = config["training"]
    assert training["microBatchSize"] == plan.strategy.micro_batch_size
    assert training["gradientAccumulationSteps"] == plan.strategy.gradient_accumulation_steps
    assert training["globalBatchSize"] == 64
    assert config["job"] == "research/llama-chat"


def test_the_decision_is_a_pure_function_of_the_observation(gang: FakeCluster) -> None:
    observation = gang.observe()
    first, second = reconcile(observation, IMAGE), reconcile(observation, IMAGE)
    assert first.status.to_api() == second.status.to_api()
    assert first.create == second.create and first.delete == second.delete and first.events == second.events


# ================================================================================================
# Idempotence: a pass repeated, or an operator restarted half-way, never duplicates anything
# ================================================================================================


def test_a_repeated_pass_after_a_crash_before_any_create_launches_no_second_attempt(gang: FakeCluster) -> None:
    first = gang.observe()
    decision = reconcile(first, IMAGE)
    gang.apply(decision, create=False)  # status written, then the operator died: nothing was created
    again = gang.step()
    assert [a.number for a in again.status.attempts] == [1]
    assert again.status.restarts == 0 and again.status.phase is Phase.LAUNCHING
    assert pod_names(again) == pod_names(decision)
    assert again.events == [] and again.delete == [] and again.planned is None
    assert again.status.to_api() == decision.status.to_api(), "a repeated pass writes nothing new"


def test_a_repeated_pass_creates_only_the_missing_pods(gang: FakeCluster) -> None:
    decision = reconcile(gang.observe(), IMAGE)
    gang.apply(decision, create=False)
    pods = [o for o in decision.create if o["kind"] == "Pod"]
    assert len(pods) >= 3
    for pod in pods[::2]:  # the operator created every other pod before it died
        gang.create(pod)
    gang.running(pods[0]["metadata"]["name"])
    again = gang.step()
    assert pod_names(again) == [p["metadata"]["name"] for p in pods[1::2]]
    assert [a.number for a in again.status.attempts] == [1] and again.events == [] and again.delete == []
    assert sorted(gang.pods) == sorted(p["metadata"]["name"] for p in pods)
    assert pod_names(gang.step()) == []


def test_launching_with_every_pod_present_creates_nothing(gang: FakeCluster) -> None:
    gang.step()
    for _ in range(3):
        decision = gang.step()
        assert quiet(decision)
        assert decision.status.phase is Phase.LAUNCHING and len(decision.status.attempts) == 1


def test_a_running_job_stays_quiet_across_passes(gang: FakeCluster) -> None:
    gang.launch_running()
    before = copy.deepcopy(gang.raw_status)
    for _ in range(3):
        assert quiet(gang.step())
    assert gang.raw_status == before


def test_a_restart_interrupted_after_its_status_write_finishes_without_a_third_attempt(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.failed("llama-chat-a1-n1")
    old = copy.deepcopy(gang.pods)
    decision = reconcile(gang.observe(), IMAGE)
    gang.apply(decision, create=False)  # status written; then the operator died: no create landed
    gang.pods = old  # and no deletion either
    assert gang.status.attempts[-1].number == 2 and gang.status.restarts == 1
    again = gang.step()
    assert [a.number for a in again.status.attempts] == [1, 2] and again.status.restarts == 1
    assert not again.restarted and again.events == []
    assert sorted(again.delete) == [f"llama-chat-a1-n{r}" for r in range(again.status.plan.strategy.nodes)]
    assert pod_names(again) == [f"llama-chat-a2-n{r}" for r in range(again.status.plan.strategy.nodes)]
    assert again.status.attempts[0].outcome == "Failed" and again.status.attempts[1].finished is None


def test_stale_pods_of_an_older_attempt_are_deleted(gang: FakeCluster) -> None:
    gang.launch_running()
    old = gang.attempt_pods(1)
    gang.failed(old[1])
    decision = reconcile(gang.observe(), IMAGE)
    assert sorted(decision.delete) == old
    gang.apply(decision)
    # The deletions did not land (the operator stopped between writing status and deleting).
    for name in old:
        gang.pods[name] = {"metadata": {"name": name, "labels": {ATTEMPT_LABEL: "1", RANK_LABEL: name[-1]},
                                        "ownerReferences": [owned_by_the_job()]},
                           "status": {"phase": "Running"}}  # fmt: skip
    again = gang.step()
    assert sorted(again.delete) == old
    assert [a.number for a in again.status.attempts] == [1, 2] and again.status.restarts == 1
    assert gang.attempt_pods(1) == [] and len(gang.attempt_pods(2)) == again.status.plan.strategy.nodes


def test_pods_without_an_attempt_label_are_stale_too(cluster: FakeCluster) -> None:
    cluster.step()
    cluster.pods["stray"] = {"metadata": {"name": "stray", "labels": {}, "ownerReferences": [owned_by_the_job()]},
                             "status": {"phase": "Running"}}  # fmt: skip
    assert cluster.step().delete == ["stray"]


@pytest.mark.parametrize(
    "owners",
    [[], [owned_by_the_job(uid="uid-of-an-earlier-job-of-that-name")], [owned_by_the_job(controller=False)]],
)
def test_pods_the_job_does_not_control_are_neither_followed_nor_deleted(gang: FakeCluster, owners: list) -> None:
    """Labels alone prove nothing (anyone who may create pods can copy them): a pod counts as the job's only
    when its controller owner reference carries the job's uid."""
    gang.launch_running()
    mine = gang.attempt_pods(1)
    for name, attempt, phase in (("decoy-old", "7", "Running"), ("decoy-failed", "1", "Failed")):
        labels = {MANAGED_BY_LABEL: MANAGED_BY, "memfit.dev/job": "llama-chat", ATTEMPT_LABEL: attempt,
                  RANK_LABEL: "0"}  # fmt: skip
        status = {"phase": phase, "podIP": "169.254.169.254"}
        gang.pods[name] = {"metadata": {"name": name, "labels": labels, "ownerReferences": owners}, "status": status}
    decision = gang.step()
    assert decision.delete == [] and decision.create == []  # the decoys neither deleted nor failing the gang
    assert decision.status.phase is Phase.RUNNING and [a.number for a in decision.status.attempts] == [1]
    assert gang.attempt_pods(1) == sorted([*mine, "decoy-failed"])  # still there


def test_with_network_policies_each_attempt_gets_one_before_its_pods(gang: FakeCluster) -> None:
    options = TrainerOptions(network_policy=True, metrics_peers=({"podSelector": {}},))
    decision = reconcile(gang.observe(), IMAGE, options)
    nodes = decision.status.plan.strategy.nodes
    assert kinds(decision) == ["ConfigMap", "Service", "NetworkPolicy"] + ["Pod"] * nodes
    [policy] = [o for o in decision.create if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"][ATTEMPT_LABEL] == "1"
    assert kinds(reconcile(gang.observe(), IMAGE)) == ["ConfigMap", "Service"] + ["Pod"] * nodes  # off by default


# ================================================================================================
# Running, Succeeded
# ================================================================================================


def test_every_rank_running_makes_the_job_running_once(gang: FakeCluster) -> None:
    gang.step()
    names = sorted(gang.pods)
    gang.running(*names[:-1])
    partial = gang.step()
    assert partial.status.phase is Phase.LAUNCHING and quiet(partial)
    gang.running(names[-1])
    decision = gang.step()
    assert decision.status.phase is Phase.RUNNING
    assert reasons(decision.events) == [("Normal", "Running")]
    running = gang.condition("Running")
    assert running["status"] == "True" and running["reason"] == "Running"
    assert f"{len(names)} node ranks running" in running["message"]
    assert quiet(gang.step())


def test_all_ranks_succeeded_is_terminal_success(gang: FakeCluster) -> None:
    gang.launch_running()
    progress = Progress(step=900, total_steps=1000, percent=90, eta="2026-01-01T01:00:00Z", last_checkpoint_step=800)
    gang.step(progress)
    gang.succeeded()
    decision = gang.step()
    status = decision.status
    assert status.phase is Phase.SUCCEEDED
    assert status.attempts[-1].outcome == "Succeeded" and status.attempts[-1].finished is not None
    assert "node ranks finished" in (status.attempts[-1].reason or "")
    assert status.progress is not None and (status.progress.step, status.progress.percent) == (1000, 100)
    assert status.progress.eta is None and status.progress_display == "100% 1000/1000"
    assert (gang.condition("Succeeded")["status"], gang.condition("Succeeded")["reason"]) == ("True", "Completed")
    assert (gang.condition("Running")["status"], gang.condition("Running")["reason"]) == ("False", "Completed")
    assert reasons(decision.events) == [("Normal", "Succeeded")]
    assert decision.create == [] and decision.delete == []


def test_a_job_too_short_for_a_progress_read_ends_with_rank_0s_final_progress(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.step()  # no progress was read while it ran (its steps took less than the reading interval)
    final = TrainerProgress(step=40, total_steps=40, percent=100.0, tokens_per_second=1234.56, eta_seconds=0.0,
                            eta=None, last_checkpoint_step=40, loss=2.5, validation_loss=3.25, validation_step=40,
                            updated=datetime(2026, 1, 1, tzinfo=UTC))  # fmt: skip
    rank0, *others = gang.attempt_pods(1)
    gang.terminated(rank0, "Succeeded", 0, "Completed", completed_message(final))
    gang.succeeded(*others)
    status = gang.step().status
    assert status.phase is Phase.SUCCEEDED and status.progress is not None
    progress = status.progress
    assert (progress.step, progress.total_steps, progress.percent, progress.last_checkpoint_step) == (40, 40, 100, 40)
    assert (progress.validation_loss, progress.validation_step, progress.tokens_per_second) == (3.25, 40, 1234.6)
    assert status.progress_display == "100% 40/40"


def test_succeeded_is_terminal_whatever_happens_afterwards(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.succeeded()
    gang.step()
    after = copy.deepcopy(gang.raw_status)

    def unchanged() -> None:
        decision = gang.step()
        assert quiet(decision)
        status = decision.status.to_api()
        status.pop("observedGeneration", None)
        assert status == {k: v for k, v in after.items() if k != "observedGeneration"}

    gang.pods.clear()  # the pods are garbage-collected
    unchanged()
    gang.pools = []  # the pools go
    unchanged()
    gang.edit_spec(suspend=True)  # suspend and resume
    unchanged()
    gang.edit_spec(suspend=False)
    unchanged()
    gang.edit_spec(maxRestarts=7)  # any other edit
    unchanged()
    gang.edit_spec(training={"globalBatchSize": 63, "sequenceLength": 4096})
    unchanged()


def test_a_single_rank_finishing_first_keeps_the_job_running(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.succeeded("llama-chat-a1-n0")
    decision = gang.step()
    assert decision.status.phase is Phase.RUNNING and quiet(decision)


def test_a_job_that_finishes_between_two_passes_succeeds(cluster: FakeCluster) -> None:
    cluster.step()
    cluster.succeeded()
    assert cluster.step().status.phase is Phase.SUCCEEDED


# ================================================================================================
# Gang restarts
# ================================================================================================


def test_a_failed_rank_deletes_the_gang_and_launches_the_next_attempt(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.step(Progress(step=250, total_steps=1000, percent=25, last_checkpoint_step=200))
    old = gang.attempt_pods(1)
    gang.failed("llama-chat-a1-n1")
    decision = gang.step()
    status = decision.status
    assert sorted(decision.delete) == old
    assert status.phase is Phase.RESTARTING and status.restarts == 1 and status.replans == 0
    assert decision.restarted and not decision.replanned_after_oom and decision.planned is None
    first, second = status.attempts
    assert (first.outcome, first.finished) == ("Failed", "2026-01-01T00:00:04Z")
    assert first.reason == "llama-chat-a1-n1: exit code 1 (Error)"
    assert second.number == 2 and second.finished is None and second.resumed_from_step == 200
    assert second.strategy_summary == first.strategy_summary
    assert reasons(decision.events) == [("Warning", "RankFailed"), ("Normal", "Launching")]
    assert "gang restart 1/3" in decision.events[0].message and "exit code 1" in decision.events[0].message
    assert "from checkpoint step 200" in decision.events[1].message
    assert kinds(decision)[:2] == ["ConfigMap", "Service"]
    assert pod_names(decision) == [f"llama-chat-a2-n{r}" for r in range(len(old))]
    assert gang.attempt_pods(1) == []
    running = gang.condition("Running")
    assert (running["status"], running["reason"]) == ("False", "Launching")
    assert "attempt 2" in running["message"]
    # The new gang comes up.
    gang.running()
    assert gang.step().status.phase is Phase.RUNNING


def test_several_failed_ranks_are_all_named(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.failed("llama-chat-a1-n0", exit_code=2)
    gang.failed("llama-chat-a1-n1", exit_code=3)
    reason = gang.step().status.attempts[0].reason or ""
    assert "llama-chat-a1-n0: exit code 2" in reason and "llama-chat-a1-n1: exit code 3" in reason


def test_a_pod_failed_without_a_container_status_is_a_failed_rank(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.pods["llama-chat-a1-n0"]["status"] = {"phase": "Failed", "reason": "Evicted"}
    decision = gang.step()
    assert decision.status.restarts == 1 and decision.status.attempts[0].reason == "llama-chat-a1-n0: Evicted"


def test_a_rank_failing_while_launching_restarts_the_gang_too(gang: FakeCluster) -> None:
    gang.step()
    gang.failed("llama-chat-a1-n0")
    decision = gang.step()
    assert decision.status.restarts == 1 and decision.status.phase is Phase.RESTARTING


def test_restarts_are_bounded_by_max_restarts(gang: FakeCluster) -> None:
    gang.edit_spec(maxRestarts=2)
    gang.launch_running()
    for attempt in (1, 2):
        gang.failed(f"llama-chat-a{attempt}-n0")
        decision = gang.step()
        assert decision.status.restarts == attempt and decision.status.phase is Phase.RESTARTING
        assert f"gang restart {attempt}/2" in decision.events[0].message
        gang.running()
        gang.step()
    gang.failed("llama-chat-a3-n2")
    decision = gang.step()
    status = decision.status
    assert status.phase is Phase.FAILED and status.restarts == 2
    assert [a.outcome for a in status.attempts] == ["Failed", "Failed", "Failed"]
    assert sorted(decision.delete) == [f"llama-chat-a3-n{r}" for r in range(status.plan.strategy.nodes)]
    assert pod_names(decision) == [] and decision.create == []
    assert reasons(decision.events) == [("Warning", "Failed")]
    assert "all 2 restart(s) used (spec.maxRestarts)" in decision.events[0].message
    for type_ in ("Ready", "Running", "Succeeded"):
        condition = gang.condition(type_)
        assert (condition["status"], condition["reason"]) == ("False", "RestartLimitReached")
    # Terminal: nothing brings it back.
    gang.pods.clear()
    assert quiet(gang.step()) and gang.status.phase is Phase.FAILED
    gang.edit_spec(maxRestarts=5)
    assert quiet(gang.step()) and gang.status.phase is Phase.FAILED and len(gang.status.attempts) == 3


def test_max_restarts_zero_fails_on_the_first_failed_rank(cluster: FakeCluster) -> None:
    cluster.edit_spec(maxRestarts=0)
    cluster.launch_running()
    cluster.failed("llama-chat-a1-n0")
    decision = cluster.step()
    assert decision.status.phase is Phase.FAILED and decision.status.restarts == 0
    assert len(decision.status.attempts) == 1 and not decision.restarted


def test_a_failed_job_still_stops_ranks_left_running(gang: FakeCluster) -> None:
    gang.edit_spec(maxRestarts=0)
    gang.launch_running()
    gang.failed("llama-chat-a1-n0")
    decision = reconcile(gang.observe(), IMAGE)
    gang.apply(decision)
    assert decision.status.phase is Phase.FAILED
    # The deletions did not land: the other ranks still hold their GPUs, rank 0's failed pod stays for logs.
    for rank in range(decision.status.plan.strategy.nodes):
        name = f"llama-chat-a1-n{rank}"
        metadata = {"name": name, "labels": {ATTEMPT_LABEL: "1"}, "ownerReferences": [owned_by_the_job()]}
        gang.pods[name] = {"metadata": metadata, "status": {"phase": "Running"}}
    gang.failed("llama-chat-a1-n0")
    again = gang.step()
    running = [f"llama-chat-a1-n{r}" for r in range(1, decision.status.plan.strategy.nodes)]
    assert sorted(again.delete) == running and again.create == [] and again.events == []
    assert again.status.phase is Phase.FAILED


def test_a_pod_deleted_while_running_restarts_the_gang(gang: FakeCluster) -> None:
    gang.launch_running()
    del gang.pods["llama-chat-a1-n1"]
    decision = gang.step()
    assert decision.status.restarts == 1 and decision.status.phase is Phase.RESTARTING
    assert decision.status.attempts[0].reason == "pod(s) llama-chat-a1-n1 deleted while running"
    assert sorted(decision.delete) == [f"llama-chat-a1-n{r}" for r in range(decision.status.plan.strategy.nodes)
                                       if r != 1]  # fmt: skip
    assert reasons(decision.events) == [("Warning", "RankFailed"), ("Normal", "Launching")]
    assert len(pod_names(decision)) == decision.status.plan.strategy.nodes


def test_a_pod_deleted_while_launching_is_recreated_not_restarted(gang: FakeCluster) -> None:
    gang.step()
    del gang.pods["llama-chat-a1-n1"]
    decision = gang.step()
    assert pod_names(decision) == ["llama-chat-a1-n1"]
    assert decision.status.restarts == 0 and len(decision.status.attempts) == 1 and decision.events == []


# ================================================================================================
# Out of memory: re-plan leaner
# ================================================================================================


@pytest.mark.parametrize("kind", ["OOMKilled", "trainer"])
def test_out_of_memory_replans_to_a_leaner_strategy(cluster: FakeCluster, kind: str) -> None:
    cluster.launch_running()
    cluster.step(Progress(step=5, total_steps=1000, percent=0, last_checkpoint_step=4))
    old = cluster.status.plan
    assert old is not None
    if kind == "OOMKilled":
        cluster.oom_killed("llama-chat-a1-n0")
    else:
        cluster.trainer_oom("llama-chat-a1-n0", step=3, measured=79 * GIB, planned=62 * GIB)
    decision = cluster.step()
    status = decision.status
    new = status.plan
    assert new is not None and new.strategy.summary() != old.strategy.summary()
    assert status.excluded_strategies == [old.strategy.identity()]
    assert new.memory.per_gpu.total < old.memory.per_gpu.total
    assert status.replans == 1 and status.restarts == 0 and status.phase is Phase.RESTARTING
    assert decision.replanned_after_oom and not decision.restarted and decision.planned == new
    assert status.gpus == new.strategy.gpus
    assert status.memory_per_gpu == f"{new.memory.per_gpu.total / GIB:.1f}/{new.gpu_memory_bytes / GIB:.1f} GiB"
    first, second = status.attempts
    assert first.outcome == "OutOfMemory"
    if kind == "OOMKilled":
        assert first.reason == "llama-chat-a1-n0: host memory exhausted (OOMKilled)"
    else:
        assert (
            first.reason == "llama-chat-a1-n0: CUDA out of memory at step 3 (measured peak 79.0 GiB, planned 62.0 GiB)"
        )
    assert second.strategy_summary == new.strategy.summary()
    assert reasons(decision.events) == [("Warning", "OutOfMemory"), ("Normal", "Replanned"), ("Normal", "Launching")]
    assert old.strategy.summary() in decision.events[0].message
    replanned = decision.events[1].message
    assert replanned.startswith(f"re-plan 1/3: {new.strategy.summary()}")
    assert f"estimated {status.memory_per_gpu} per GPU, was " in replanned
    # The example plan has a leaner sibling with the same checkpoint layout: resume from the checkpoint.
    assert "the checkpoint layout is unchanged: resuming from the last checkpoint" in replanned
    assert second.resumed_from_step == 4
    planned = cluster.condition("Planned")
    assert planned["status"] == "True" and new.strategy.summary() in planned["message"]
    assert sorted(decision.delete) == ["llama-chat-a1-n0"]
    assert pod_names(decision) == ["llama-chat-a2-n0"]
    config = trainer_config(cluster, 2)
    assert config["training"]["gradientCheckpointing"] == new.strategy.gradient_checkpointing
    assert config["training"]["microBatchSize"] == new.strategy.micro_batch_size


def test_oom_replans_keep_the_checkpoint_layout_until_only_another_layout_is_leaner(cluster: FakeCluster) -> None:
    """The example plan (full ZeRO-2 on 8 GPUs) can first get leaner with the same layout (checkpointing,
    smaller micro-batches, optimizer offload); once those are spent, a re-plan changes the ZeRO stage and
    the next attempt resumes from the last checkpoint, which the trainer converts to the new layout."""
    cluster.edit_spec(maxReplans=10)
    cluster.launch_running()
    changed = None
    for attempt in range(1, 10):
        cluster.step(Progress(step=10 * attempt + 5, total_steps=1000, percent=1, last_checkpoint_step=10 * attempt))
        old = cluster.status.plan
        cluster.trainer_oom(f"llama-chat-a{attempt}-n0")
        decision = cluster.step()
        new = decision.status.plan
        assert old is not None and new is not None and new.memory.per_gpu.total < old.memory.per_gpu.total
        message = next(e.message for e in decision.events if e.reason == "Replanned")
        launching = next(e.message for e in decision.events if e.reason == "Launching")
        started = decision.status.attempts[-1]
        same = (old.strategy.method, old.strategy.precision, old.strategy.zero_stage, old.strategy.gpus) == (
            new.strategy.method, new.strategy.precision, new.strategy.zero_stage, new.strategy.gpus)  # fmt: skip
        if same:
            assert "the checkpoint layout is unchanged: resuming from the last checkpoint" in message
            assert started.resumed_from_step == 10 * attempt
            assert f"from checkpoint step {10 * attempt}" in launching
        else:
            changed = (old, new, message, decision)
            break
        cluster.running()
        cluster.step()
    assert changed is not None, "a layout change never came"
    old, new, message, decision = changed
    assert attempt > 1, "the first re-plan keeps the layout: it exists for the example plan"
    was = f"full bf16 ZeRO-{old.strategy.zero_stage} on {old.strategy.gpus} GPU(s)"
    now = (f"full bf16 ZeRO-{new.strategy.zero_stage} on {new.strategy.gpus} GPU(s)"
           if new.strategy.engine == "deepspeed" else "full bf16 on fsdp2 (any GPU count)")  # fmt: skip
    converted = f"the checkpoint layout changes ({was} -> {now}): resuming from the last checkpoint, converted"
    assert converted in message
    assert decision.status.attempts[-1].resumed_from_step == 10 * attempt
    assert decision.status.progress is not None and decision.status.progress.last_checkpoint_step == 10 * attempt
    launching = next(e.message for e in decision.events if e.reason == "Launching")
    assert f"from checkpoint step {10 * attempt}" in launching


def test_an_oom_in_one_rank_deletes_the_whole_gang(gang: FakeCluster) -> None:
    gang.launch_running()
    old = gang.attempt_pods(1)
    gang.oom_killed(old[-1])
    decision = gang.step()
    assert sorted(decision.delete) == old and decision.status.replans == 1
    assert len(pod_names(decision)) == decision.status.plan.strategy.nodes


def test_out_of_memory_wins_over_an_ordinary_failure_in_the_same_gang(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.failed("llama-chat-a1-n0")
    gang.oom_killed("llama-chat-a1-n1")
    decision = gang.step()
    assert decision.status.replans == 1 and decision.status.restarts == 0


def test_successive_ooms_exclude_every_failed_strategy_and_keep_getting_leaner(cluster: FakeCluster) -> None:
    cluster.edit_spec(maxReplans=3)
    cluster.launch_running()
    plans = [cluster.status.plan]
    for attempt in (1, 2, 3):
        cluster.trainer_oom(f"llama-chat-a{attempt}-n0")
        status = cluster.step().status
        plans.append(status.plan)
        assert status.replans == attempt
        assert status.excluded_strategies == [p.strategy.identity() for p in plans[:-1]]
        cluster.running()
        cluster.step()
    totals = [p.memory.per_gpu.total for p in plans]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


def test_replans_are_bounded_by_max_replans(cluster: FakeCluster) -> None:
    cluster.edit_spec(maxReplans=1)
    cluster.launch_running()
    cluster.oom_killed("llama-chat-a1-n0")
    assert cluster.step().status.replans == 1
    cluster.running()
    cluster.step()
    summary = cluster.status.plan.strategy.summary()
    cluster.oom_killed("llama-chat-a2-n0")
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.FAILED and status.replans == 1
    assert status.attempts[-1].outcome == "OutOfMemory" and len(status.attempts) == 2
    assert status.plan is not None and status.plan.strategy.summary() == summary
    assert reasons(decision.events) == [("Warning", "OutOfMemory"), ("Warning", "Failed")]
    assert "all 1 re-plan(s) used (spec.maxReplans)" in decision.events[-1].message
    assert cluster.condition("Ready")["reason"] == "ReplanLimitReached"
    assert decision.delete == ["llama-chat-a2-n0"] and decision.create == []
    assert quiet(cluster.step()) and cluster.status.phase is Phase.FAILED


def test_max_replans_zero_fails_on_the_first_oom(cluster: FakeCluster) -> None:
    cluster.edit_spec(maxReplans=0)
    cluster.launch_running()
    cluster.trainer_oom("llama-chat-a1-n0")
    decision = cluster.step()
    assert decision.status.phase is Phase.FAILED and decision.status.replans == 0
    assert not decision.replanned_after_oom and decision.create == []


def test_an_oom_with_no_leaner_plan_fails_with_advice() -> None:
    # The leanest strategy there is on 8 GPUs (fsdp2 ZeRO-3, everything offloaded, checkpointing, activations on
    # the host, the chunked loss, micro-batch 1).
    pinned = {"engine": "fsdp2", "zeroStage": 3, "offloadOptimizer": "cpu", "offloadParameters": "cpu",
              "gradientCheckpointing": True, "activationOffloading": True, "chunkedLoss": True}  # fmt: skip
    document = job_document(method="full", strategy=pinned, resources={"pool": "a100-80gb", "maxGPUs": 8})
    document["spec"]["training"].update(globalBatchSize=8, precision="bf16")
    cluster = FakeCluster(document)
    cluster.launch_running()
    summary, identity = cluster.status.plan.strategy.summary(), cluster.status.plan.strategy.identity()
    cluster.trainer_oom("llama-chat-a1-n0")
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.FAILED and status.replans == 0 and not decision.replanned_after_oom
    assert status.excluded_strategies == [identity] and status.plan.strategy.summary() == summary
    assert reasons(decision.events) == [("Warning", "OutOfMemory"), ("Warning", "Failed")]
    assert "no leaner strategy fits the declared GPUPools. " in decision.events[-1].message
    assert "nearest miss" in decision.events[-1].message
    assert cluster.condition("Ready")["reason"] == "NoLeanerPlan"
    assert decision.create == [] and decision.delete == ["llama-chat-a1-n0"]
    assert quiet(cluster.step())


# ================================================================================================
# Suspend and resume
# ================================================================================================


def test_suspend_deletes_the_pods_and_resume_starts_a_new_attempt_from_the_checkpoint(gang: FakeCluster) -> None:
    gang.launch_running()
    gang.step(Progress(step=300, total_steps=1000, percent=30, last_checkpoint_step=200))
    old = gang.attempt_pods(1)
    plan = gang.status.plan
    gang.edit_spec(suspend=True)
    decision = gang.step()
    status = decision.status
    assert status.phase is Phase.SUSPENDED and sorted(decision.delete) == old and decision.create == []
    assert status.attempts[0].outcome == "Suspended" and status.attempts[0].reason == "spec.suspend is true"
    assert status.restarts == 0 and status.plan == plan and status.progress.last_checkpoint_step == 200
    assert reasons(decision.events) == [("Normal", "Suspended")]
    suspended = gang.condition("Suspended")
    assert (suspended["status"], suspended["reason"], suspended["observedGeneration"]) == (
        "True", "SuspendRequested", 2)  # fmt: skip
    assert gang.condition("Running")["status"] == "False" and gang.condition("Running")["reason"] == "Suspended"
    ready = gang.condition("Ready")
    assert ready["status"] == "True", "suspend is the one spec field that may change"
    assert gang.pods == {}
    assert quiet(gang.step()) and gang.status.phase is Phase.SUSPENDED

    gang.edit_spec(suspend=False)
    decision = gang.step()
    status = decision.status
    assert status.phase is Phase.LAUNCHING and [a.number for a in status.attempts] == [1, 2]
    assert status.attempts[1].resumed_from_step == 200 and status.restarts == 0 and status.replans == 0
    assert reasons(decision.events) == [("Normal", "Resumed"), ("Normal", "Launching")]
    resumed = gang.condition("Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "Resumed")
    assert pod_names(decision) == [f"llama-chat-a2-n{r}" for r in range(plan.strategy.nodes)]
    assert decision.planned is None and status.plan == plan
    gang.running()
    assert gang.step().status.phase is Phase.RUNNING


def test_a_job_created_suspended_is_planned_but_not_launched(cluster: FakeCluster) -> None:
    cluster.job["spec"]["suspend"] = True
    decision = cluster.step()
    assert decision.status.phase is Phase.SUSPENDED and decision.status.plan is not None
    assert decision.create == [] and decision.status.attempts == []
    assert reasons(decision.events) == [("Normal", "Planned"), ("Normal", "Suspended")]
    cluster.edit_spec(suspend=False)
    decision = cluster.step()
    assert decision.status.phase is Phase.LAUNCHING and [a.number for a in decision.status.attempts] == [1]
    assert pod_names(decision) == ["llama-chat-a1-n0"]


def test_a_spec_edited_while_suspended_before_launch_is_planned_anew(cluster: FakeCluster) -> None:
    """Before the first launch the spec may still change (nothing ran yet): the launch must follow the
    current spec, plan included (e.g. a job created suspended for a queue, then corrected)."""
    cluster.job["spec"]["suspend"] = True
    first = cluster.step().status.plan
    assert first is not None and first.strategy.method == "full"
    cluster.edit_spec(method="qlora", suspend=False)
    decision = cluster.step()
    status = decision.status
    assert status.launched_spec is not None and status.launched_spec.method.value == "qlora"
    assert status.plan is not None and status.plan.strategy.method == "qlora", (
        f"launched spec says qlora but the pods run the stale plan {status.plan.strategy.summary()}"
    )


def test_suspend_while_launching_and_while_restarting(gang: FakeCluster) -> None:
    gang.step()
    gang.edit_spec(suspend=True)
    decision = gang.step()
    assert decision.status.phase is Phase.SUSPENDED and gang.pods == {}
    assert decision.status.attempts[0].outcome == "Suspended"
    gang.edit_spec(suspend=False)
    gang.step()
    gang.failed("llama-chat-a2-n0")
    assert gang.step().status.phase is Phase.RESTARTING
    gang.edit_spec(suspend=True)
    decision = gang.step()
    assert decision.status.phase is Phase.SUSPENDED and gang.pods == {}
    assert [a.outcome for a in decision.status.attempts] == ["Suspended", "Failed", "Suspended"]
    assert decision.status.restarts == 1


def test_a_pool_deleted_while_suspended_is_planned_again_on_resume(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.edit_spec(suspend=True)
    cluster.step()
    cluster.pools = []
    cluster.edit_spec(suspend=False)
    decision = cluster.step()
    assert decision.status.phase is Phase.PENDING and decision.status.plan is None
    assert ("Warning", "PoolGone") in reasons(decision.events) and decision.create == []
    decision = cluster.step()
    assert decision.status.phase is Phase.UNSCHEDULABLE and decision.create == []
    cluster.pools = list(POOLS)
    decision = cluster.step()
    assert decision.status.phase is Phase.LAUNCHING and [a.number for a in decision.status.attempts] == [1, 2]
    assert pod_names(decision) == ["llama-chat-a2-n0"]


# ================================================================================================
# Invalid specs
# ================================================================================================


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"strategy": {"microBatchSize": 5}}, "not divisible by strategy.microBatchSize"),
        ({"model": {"name": "x/y", "architecture": {"preset": "no-such-model"}}}, "unknown preset"),
        ({"maxRestarts": -1}, "maxRestarts"),
    ],
)
def test_an_invalid_spec_is_reported_once_and_launches_nothing(edit: dict[str, Any], words: str) -> None:
    cluster = FakeCluster(job_document(**edit))
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.INVALID and status.plan is None and status.attempts == []
    assert status.launched_spec is None and decision.create == [] and decision.delete == []
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", "InvalidSpec", 1)
    assert words in ready["message"]
    assert reasons(decision.events) == [("Warning", "InvalidSpec")] and words in decision.events[0].message
    assert decision.planned is None
    for _ in range(3):
        assert quiet(cluster.step())
    assert cluster.status.phase is Phase.INVALID
    assert [e.reason for e in cluster.events] == ["InvalidSpec"]


def test_a_fixed_spec_is_then_planned_and_launched() -> None:
    cluster = FakeCluster(job_document(strategy={"microBatchSize": 5}))
    cluster.step()
    assert cluster.status.phase is Phase.INVALID
    cluster.edit_spec(strategy={"microBatchSize": 4})
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.LAUNCHING and status.plan is not None
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "SpecAccepted", 2)
    assert status.observed_generation == 2
    assert reasons(decision.events) == [("Normal", "Planned"), ("Normal", "Launching")]
    assert pod_names(decision) == ["llama-chat-a1-n0"]
    assert status.plan.strategy.micro_batch_size == 4


def test_a_launch_with_a_pinned_micro_batch_keeps_the_global_batch_exact() -> None:
    """micro-batch x accumulation x data-parallel GPUs must equal training.globalBatchSize, in the plan and in
    the trainer config the pods get."""
    cluster = FakeCluster(job_document(strategy={"microBatchSize": 4}))
    strategy = cluster.step().status.plan.strategy
    config = trainer_config(cluster, 1)["training"]
    assert (config["microBatchSize"], config["globalBatchSize"]) == (4, 64)
    assert strategy.micro_batch_size * strategy.gradient_accumulation_steps * strategy.data_parallel == 64, (
        f"{strategy.summary()} does not keep training.globalBatchSize 64 exact"
    )
    assert config["microBatchSize"] * config["gradientAccumulationSteps"] * strategy.data_parallel == 64


def test_a_spec_that_becomes_invalid_before_launch_is_reported() -> None:
    cluster = FakeCluster(job_document(suspend=True))
    cluster.step()
    cluster.edit_spec(strategy={"microBatchSize": 5})
    decision = cluster.step()
    assert decision.status.phase is Phase.INVALID
    assert reasons(decision.events) == [("Warning", "InvalidSpec")] and decision.create == []


# ================================================================================================
# The spec is immutable after launch, but for suspend
# ================================================================================================


def test_a_spec_change_after_launch_is_refused_and_the_launched_spec_kept(cluster: FakeCluster) -> None:
    cluster.launch_running()
    launched = copy.deepcopy(cluster.raw_status["launchedSpec"])
    plan = cluster.status.plan
    model = {**cluster.job["spec"]["model"], "name": "someone/else"}
    cluster.edit_spec(model=model, output={"pvc": "elsewhere", "path": "x/"})
    decision = cluster.step()
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", "SpecImmutable", 2)
    assert "spec.model, spec.output changed after launch; only spec.suspend may change" in ready["message"]
    assert reasons(decision.events) == [("Warning", "SpecImmutable")]
    assert decision.status.phase is Phase.RUNNING and decision.create == [] and decision.delete == []
    assert cluster.raw_status["launchedSpec"] == launched and decision.status.plan == plan
    assert quiet(cluster.step()), "the refusal is reported once"
    # A restart under the changed spec still runs the launched one.
    cluster.failed("llama-chat-a1-n0")
    decision = cluster.step()
    assert decision.status.restarts == 1 and decision.status.plan == plan
    assert trainer_config(cluster, 2)["model"]["nameOrPath"] == "meta-llama/Llama-3.1-8B-Instruct"
    pod = cluster.pods["llama-chat-a2-n0"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims["output"] == "checkpoints"
    assert cluster.condition("Ready")["reason"] == "SpecImmutable"
    # Reverting restores Ready.
    cluster.edit_spec(model=launched["model"], output=launched["output"])
    decision = cluster.step()
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "SpecAccepted", 3)
    assert decision.events == []


def test_an_invalid_spec_change_after_launch_is_refused_not_invalid(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.edit_spec(strategy={"microBatchSize": 5})
    decision = cluster.step()
    assert decision.status.phase is Phase.RUNNING
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "SpecImmutable")
    assert "the changed spec is invalid" in ready["message"] and "not divisible" in ready["message"]
    assert reasons(decision.events) == [("Warning", "SpecImmutable")]
    assert quiet(cluster.step())
    # suspend still works on top of the invalid edit
    cluster.edit_spec(suspend=True)
    decision = cluster.step()
    assert decision.status.phase is Phase.SUSPENDED and cluster.pods == {}


def test_suspend_is_the_one_field_that_may_change_after_launch(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.edit_spec(suspend=True)
    cluster.step()
    assert cluster.condition("Ready")["status"] == "True"
    assert all(e.reason != "SpecImmutable" for e in cluster.events)


# ================================================================================================
# Unschedulable
# ================================================================================================


def test_without_pools_the_job_is_unschedulable_with_advice_then_planned_when_pools_appear() -> None:
    cluster = FakeCluster(job_document(), pools=[])
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.UNSCHEDULABLE and status.plan is None and decision.create == []
    planned, ready = cluster.condition("Planned"), cluster.condition("Ready")
    assert (planned["status"], planned["reason"]) == ("False", "Unschedulable")
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable")
    assert planned["message"].startswith("nothing fits: ") and len(planned["message"]) > len("nothing fits: ") + 10
    assert reasons(decision.events) == [("Warning", "Unschedulable")]
    assert decision.events[0].message == planned["message"]
    assert quiet(cluster.step()) and quiet(cluster.step())
    cluster.pools = list(POOLS)
    decision = cluster.step()
    assert decision.status.phase is Phase.LAUNCHING and decision.status.plan is not None
    assert (cluster.condition("Planned")["status"], cluster.condition("Ready")["status"]) == ("True", "True")
    assert reasons(decision.events) == [("Normal", "Planned"), ("Normal", "Launching")]
    assert pod_names(decision) == ["llama-chat-a1-n0"]


def test_a_job_too_large_for_the_pools_is_unschedulable() -> None:
    only_l4 = [p for p in POOLS if p.metadata.name == "l4"]
    cluster = FakeCluster(job_document("llama-2-70b", method="full"), pools=only_l4)
    decision = cluster.step()
    assert decision.status.phase is Phase.UNSCHEDULABLE and decision.create == []
    assert "nothing fits" in cluster.condition("Planned")["message"]


def test_a_job_naming_a_missing_pool_is_unschedulable() -> None:
    cluster = FakeCluster(job_document(resources={"pool": "h100"}))
    decision = cluster.step()
    assert decision.status.phase is Phase.UNSCHEDULABLE and decision.create == []


# ================================================================================================
# Progress
# ================================================================================================


def test_progress_lands_in_status_and_display(cluster: FakeCluster) -> None:
    cluster.launch_running()
    progress = Progress(
        step=420,
        total_steps=1000,
        percent=42,
        tokens_per_second=1234.5,
        eta="2026-01-01T02:00:00Z",
        last_checkpoint_step=400,
        updated="2026-01-01T00:10:00Z",
    )
    decision = cluster.step(progress)
    assert decision.status.progress == progress and decision.status.progress_display == "42% 420/1000"
    assert cluster.raw_status["progress"]["tokensPerSecond"] == 1234.5
    assert cluster.raw_status["progressDisplay"] == "42% 420/1000"
    assert decision.events == [] and decision.create == []
    # A later read without a checkpoint (a new process) keeps the last checkpoint known.
    later = Progress(step=430, total_steps=1000, percent=43)
    status = cluster.step(later).status
    assert status.progress.step == 430 and status.progress.last_checkpoint_step == 400
    assert status.progress_display == "43% 430/1000"
    # No progress read in a pass: the last one stays.
    assert cluster.step().status.progress.step == 430


def test_progress_without_a_known_total_shows_the_step(cluster: FakeCluster) -> None:
    cluster.launch_running()
    status = cluster.step(Progress(step=17)).status
    assert status.progress_display == "step 17"


def test_success_without_a_known_total_keeps_the_last_step(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.step(Progress(step=17))
    cluster.succeeded()
    status = cluster.step().status
    assert status.phase is Phase.SUCCEEDED and status.progress.step == 17 and status.progress_display == "step 17"


# ================================================================================================
# Generations and conditions
# ================================================================================================


def test_observed_generation_follows_metadata_generation(cluster: FakeCluster) -> None:
    cluster.launch_running()
    cluster.edit_spec(suspend=True)
    status = cluster.step().status
    assert status.observed_generation == 2
    assert cluster.condition("Ready")["observedGeneration"] == 2
    assert cluster.condition("Suspended")["observedGeneration"] == 2


def test_condition_transition_times_move_only_when_the_status_flips(cluster: FakeCluster) -> None:
    cluster.step()
    ready_at = cluster.condition("Ready")["lastTransitionTime"]
    running_at = cluster.condition("Running")["lastTransitionTime"]
    cluster.running()
    cluster.step()
    assert cluster.condition("Ready")["lastTransitionTime"] == ready_at
    assert cluster.condition("Running")["lastTransitionTime"] != running_at


def test_a_trainer_config_error_fails_the_job_at_once(gang: FakeCluster) -> None:
    """A config or data error is permanent: restarting the gang would fail the same way."""
    gang.launch_running()
    message = json.dumps({"reason": "ConfigError", "message": "data path /mnt/data/chats/ matches no jsonl files"})
    gang.terminated("llama-chat-a1-n1", "Failed", 1, "Error", message)
    decision = gang.step()
    status = decision.status
    assert status.phase is Phase.FAILED and status.restarts == 0 and len(status.attempts) == 1
    assert status.attempts[0].outcome == "ConfigError"
    assert sorted(decision.delete) == [f"llama-chat-a1-n{r}" for r in range(status.plan.strategy.nodes)]
    assert pod_names(decision) == []
    assert reasons(decision.events) == [("Warning", "Failed")]
    assert "the trainer refused its config: data path /mnt/data/chats/ matches no jsonl files" in (
        decision.events[0].message
    )
    assert gang.condition("Succeeded")["reason"] == "TrainerConfigError"


def refuse_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.render.trainer_config import PathOutsideVolumeError
    from memfit_operator import reconcile as reconcile_module

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PathOutsideVolumeError("output.path '../x' leads outside its volume")

    monkeypatch.setattr(reconcile_module, "render_trainer_config", refuse)


def test_a_config_the_renderer_refuses_before_launch_makes_the_job_invalid_and_launches_nothing(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_rendering(monkeypatch)
    decision = cluster.step()
    status = decision.status
    assert status.phase is Phase.INVALID and status.attempts == [] and status.launched_spec is None
    assert decision.create == []
    ready = cluster.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "leads outside its volume" in ready["message"]
    assert ("Warning", "InvalidSpec") in reasons(decision.events)
    assert quiet(cluster.step()), "a repeated pass says nothing new"


def test_a_config_the_renderer_refuses_at_a_restart_fails_the_job(
    gang: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    gang.launch_running()
    refuse_rendering(monkeypatch)
    gang.failed(gang.attempt_pods(1)[0])
    decision = gang.step()
    assert decision.status.phase is Phase.FAILED
    assert [o for o in decision.create if o["kind"] == "Pod"] == []
    assert ("Warning", "Failed") in reasons(decision.events)
