"""The operator end to end on a real kube-apiserver, running as `memfit operator` under the operator's
ServiceAccount bound only to the roles the chart ships for an operator restricted to one namespace (its
ClusterRole of cluster-scoped reads, and a Role in each namespace it serves), with the chart's NetworkPolicy
settings. The test plays the kubelet (pod status) and rank 0 of the trainer (its real metrics exporter, which
the operator scrapes for progress)."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kopf.testing import KopfRunner
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.config import kube_config
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import load_documents
from memfit.api.vocabulary import MANAGED_BY, MANAGED_BY_LABEL
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.progress import (
    CHECKPOINT_STEP_METRIC,
    RESUMED_FROM_STEP_METRIC,
    SET_ASIDE_METRIC,
    STEP_METRIC,
    TOTAL_STEPS_METRIC,
)
from memfit.planner.search import plan_job
from memfit.profile import ModelProfile
from memfit.profiled_model import ProfiledModel
from memfit.render.trainer_config import render_trainer_config
from memfit_operator import objects as operator_objects
from memfit_operator.objects import ATTEMPT_LABEL, JOB_LABEL, RESTRICTED_SECURITY_CONTEXT, job_label
from memfit_operator.status import memory_per_gpu
from memfit_trainer.metrics import TrainerMetrics
from tests.hub_stand_in import hub_stand_in
from tests.k8s.apiserver import ApiServer
from tests.k8s.cluster import (
    GROUP,
    ROOT,
    VERSION,
    Kubelet,
    create_namespace,
    example,
    grant_namespace_role,
    grant_operator_role,
    install_crds,
    server_table,
    wait_for,
)
from tests.k8s.operator_process import OperatorProcess
from tests.trainer.new_families import tiny_config
from tests.trainer.test_metrics import trainer_config

pytestmark = pytest.mark.k8s
NAMESPACE = "research"
JOBS = "finetunejobs"
METRICS_PEERS = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "memfit-system"}},
     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "memfit", "app.kubernetes.io/component": "operator"}}},
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
]  # fmt: skip
"""What the chart passes the operator (tests/chart checks the rendered value)."""
CHART_SETTINGS = {"MEMFIT_NETWORK_POLICY": "true", "MEMFIT_NETWORK_POLICY_METRICS_FROM": json.dumps(METRICS_PEERS)}


@pytest.fixture(scope="module")
def api(server: ApiServer) -> client.ApiClient:
    api_client = config.new_client_from_config(str(server.kubeconfig))
    install_crds(api_client)
    create_namespace(api_client, NAMESPACE)
    grant_operator_role(api_client, NAMESPACE)
    objects = client.CustomObjectsApi(api_client)
    for pool in example("inventory.yaml"):
        objects.create_cluster_custom_object(GROUP, VERSION, "gpupools", pool)
    return api_client


@pytest.fixture(scope="module")
def rank0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerMetrics]:
    """The trainer's own exporter on a free port, standing in for rank 0 of every running job (pod IP
    127.0.0.1): 30 of 120 steps done, a checkpoint at step 25, a validation loss at step 20."""
    config_ = trainer_config(tmp_path_factory.mktemp("rank0") / "progress.json")
    metrics = TrainerMetrics(config_, rank=0, world_size=8, port=0, device=torch.device("cpu"))
    for step in range(1, 31):
        metrics.step(step=step, total_steps=120, loss=2.0, learning_rate=1e-5, tokens=8192, samples=2,
                     step_seconds=0.5)  # fmt: skip
        if step == 25:
            metrics.checkpoint(step=25, seconds=3.0)
        if step == 20:
            metrics.validation(step=20, loss=1.75, seconds=2.0)
    yield metrics
    metrics.close()


@pytest.fixture(scope="module")
def operator(
    server: ApiServer, api: client.ApiClient, rank0: TrainerMetrics, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(
        server.operator_kubeconfig, log, NAMESPACE, rank0.port, "--standalone", env=CHART_SETTINGS
    )
    yield process
    process.stop()


@pytest.fixture
def kubelet(api: client.ApiClient) -> Kubelet:
    return Kubelet(api)


@pytest.fixture(autouse=True)
def operator_log_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed and "operator" in request.fixturenames:
        print("operator log:\n" + request.getfixturevalue("operator").tail())


def job_manifest(name: str, **spec_changes: Any) -> dict[str, Any]:
    job = copy.deepcopy(example("llama-3.1-8b-lora.yaml")[0])
    job["metadata"]["name"] = name
    job["spec"].update(spec_changes)
    return job


def create_job(api: client.ApiClient, manifest: dict[str, Any]) -> dict[str, Any]:
    return client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, JOBS, manifest)


def read_job(api: client.ApiClient, name: str) -> dict[str, Any]:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, JOBS, name)


def patch_spec(api: client.ApiClient, name: str, spec: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, JOBS, name, {"spec": spec})


def pods(api: client.ApiClient, job: str, attempt: int | None = None) -> list[client.V1Pod]:
    selector = f"{JOB_LABEL}={job_label(job)}" + (f",{ATTEMPT_LABEL}={attempt}" if attempt is not None else "")
    return client.CoreV1Api(api).list_namespaced_pod(NAMESPACE, label_selector=selector).items


def phase_is(api: client.ApiClient, name: str, phase: str) -> dict[str, Any] | None:
    job = read_job(api, name)
    return job if job.get("status", {}).get("phase") == phase else None


def condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


def events(api: client.ApiClient, name: str) -> list[tuple[str, str, str]]:
    items = client.CoreV1Api(api).list_namespaced_event(NAMESPACE, field_selector=f"involvedObject.name={name}").items
    return [(e.type, e.reason, e.message) for e in items]


def has_event(api: client.ApiClient, name: str, reason: str) -> list[tuple[str, str, str]]:
    return [e for e in events(api, name) if e[1] == reason]


def launched(api: client.ApiClient, name: str, attempt: int, count: int) -> list[client.V1Pod]:
    return wait_for(f"{count} pod(s) of attempt {attempt} of {name}",
                    lambda: (found := pods(api, name, attempt)) and len(found) == count and found)  # fmt: skip


def expected_plan(manifest: dict[str, Any]) -> Any:
    documents = load_documents(ROOT / "examples" / "inventory.yaml")
    return plan_job(FineTuneJob.model_validate(manifest).spec, documents.pools).chosen


def test_a_new_job_is_planned_and_launched(api: client.ApiClient, operator: OperatorProcess) -> None:
    manifest = job_manifest("launch")
    created = create_job(api, manifest)
    plan = expected_plan(manifest)
    job = wait_for("phase Launching", lambda: phase_is(api, "launch", "Launching"))
    status = job["status"]
    assert status["plan"] == plan.to_api()  # the same fields as `memfit plan -o json`'s chosen candidate
    assert status["gpus"] == plan.strategy.gpus and status["memoryPerGPU"] == memory_per_gpu(plan)
    assert status["observedGeneration"] == created["metadata"]["generation"]
    for type_ in ("Ready", "Planned"):
        assert condition(job, type_)["status"] == "True"
        assert condition(job, type_)["observedGeneration"] == 1 and condition(job, type_)["lastTransitionTime"]
    assert status["attempts"][0]["number"] == 1 and status["launchedSpec"]["method"] == "auto"

    [pod] = launched(api, "launch", 1, plan.strategy.nodes)
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "FineTuneJob",
        "launch",
        created["metadata"]["uid"],
        True,
    )
    spec = pod.spec
    container = spec.containers[0]
    assert container.image == "registry.example/memfit-trainer:test"
    assert container.resources.limits["nvidia.com/gpu"] == str(plan.strategy.gpus_per_node)
    assert spec.node_selector["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert spec.hostname == "launch-a1-n0" and spec.subdomain == "launch"
    assert spec.automount_service_account_token is False
    security = container.security_context
    assert security.run_as_non_root and security.allow_privilege_escalation is False
    assert security.capabilities.drop == RESTRICTED_SECURITY_CONTEXT["capabilities"]["drop"]
    assert security.seccomp_profile.type == "RuntimeDefault"
    assert "--master-addr=launch-a1-n0.launch.research.svc" in container.command
    token = next(e for e in container.env if e.name == "HF_TOKEN")
    assert token.value is None and token.value_from.secret_key_ref.name == "hf-token"
    # Resources, a read-only root and bounded scratch volumes, as the API server stored them.
    host = plan.memory.per_node.cpu
    assert container.resources.requests["memory"] == f"{-(-host // 2**20)}Mi"
    assert {"cpu", "memory", "nvidia.com/gpu"} <= set(container.resources.limits)
    assert security.read_only_root_filesystem is True
    scratch = [v for v in spec.volumes if v.empty_dir is not None]
    assert {v.name for v in scratch} >= {"tmp", "cache", "torch-extensions", "shm"}
    assert all(v.empty_dir.size_limit for v in scratch)
    core = client.CoreV1Api(api)
    service = core.read_namespaced_service("launch", NAMESPACE)
    assert service.spec.cluster_ip == "None" and service.metadata.owner_references[0].uid == created["metadata"]["uid"]
    policy = client.NetworkingV1Api(api).read_namespaced_network_policy("launch-a1", NAMESPACE)
    assert policy.spec.pod_selector.match_labels == {"app.kubernetes.io/managed-by": "memfit", JOB_LABEL: "launch",
                                                     ATTEMPT_LABEL: "1"}  # fmt: skip
    assert policy.metadata.owner_references[0].uid == created["metadata"]["uid"]
    assert len(policy.spec.ingress) == 2 and policy.spec.ingress[1].ports[0].port == 9400
    config_map = core.read_namespaced_config_map("launch-a1", NAMESPACE)
    rendered = render_trainer_config(FineTuneJob.model_validate(created), plan)
    assert isinstance(rendered.engine, DeepSpeedEngineSection)
    assert json.loads(config_map.data["deepspeed.json"]) == rendered.engine.config
    assert wait_for("Planned and Launching events",
                    lambda: has_event(api, "launch", "Planned") and has_event(api, "launch", "Launching"))  # fmt: skip


def test_running_reports_progress_then_succeeds(
    server: ApiServer, api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet
) -> None:
    create_job(api, job_manifest("progress"))
    [pod] = launched(api, "progress", 1, 1)
    kubelet.run(NAMESPACE, pod.metadata.name)
    job = wait_for("phase Running", lambda: phase_is(api, "progress", "Running"))
    assert condition(job, "Running")["status"] == "True"
    job = wait_for("progress in status", lambda: (j := read_job(api, "progress"))["status"].get("progress") and j)
    progress = job["status"]["progress"]
    assert (progress["step"], progress["totalSteps"], progress["percent"]) == (30, 120, 25)
    assert progress["lastCheckpointStep"] == 25
    assert (progress["validationLoss"], progress["validationStep"]) == (1.75, 20)
    assert progress["tokensPerSecond"] == pytest.approx(8192 / 0.5 * 8)  # rank 0's rate x 8 ranks
    assert job["status"]["progressDisplay"] == "25% 30/120"

    rows = table_row(server, "progress")  # what `kubectl get finetunejobs` prints
    assert rows["Status"] == "Running" and rows["Progress"] == "25% 30/120" and rows["GPUs"] == 8

    kubelet.terminate(NAMESPACE, pod.metadata.name, 0, reason="Completed")
    job = wait_for("phase Succeeded", lambda: phase_is(api, "progress", "Succeeded"))
    assert condition(job, "Succeeded")["status"] == "True"
    assert job["status"]["progressDisplay"] == "100% 120/120"
    assert job["status"]["attempts"][0]["outcome"] == "Succeeded"


def table_row(server: ApiServer, name: str) -> dict[str, Any]:
    table = server_table(server, f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{JOBS}/{name}")
    columns = [c["name"] for c in table["columnDefinitions"]]
    return dict(zip(columns, table["rows"][0]["cells"], strict=True))


def test_a_failed_rank_restarts_the_whole_gang_until_the_limit(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet
) -> None:
    manifest = job_manifest("gang", method="qlora", resources={"pool": "l4", "maxGPUs": 2}, maxRestarts=1)
    assert expected_plan(manifest).strategy.nodes == 2  # two node ranks: a gang
    create_job(api, manifest)
    first = launched(api, "gang", 1, 2)
    for pod in first:
        kubelet.run(NAMESPACE, pod.metadata.name)
    wait_for("phase Running", lambda: phase_is(api, "gang", "Running"))
    kubelet.terminate(NAMESPACE, "gang-a1-n1", 1)

    second = launched(api, "gang", 2, 2)
    assert not pods(api, "gang", 1), "the failed attempt's pods are all removed, the healthy rank too"
    job = read_job(api, "gang")
    assert job["status"]["restarts"] == 1
    assert job["status"]["attempts"][0]["outcome"] == "Failed"
    assert "gang-a1-n1: exit code 1" in job["status"]["attempts"][0]["reason"]
    assert wait_for("a RankFailed event", lambda: has_event(api, "gang", "RankFailed"))

    kubelet.terminate(NAMESPACE, second[0].metadata.name, 137)
    job = wait_for("phase Failed", lambda: phase_is(api, "gang", "Failed"))
    assert condition(job, "Succeeded")["reason"] == "RestartLimitReached"
    assert wait_for("the last attempt's pods removed", lambda: not pods(api, "gang", 2))
    assert not pods(api, "gang", 3)


def test_out_of_memory_replans_to_a_leaner_strategy(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet
) -> None:
    manifest = job_manifest("oom")
    before = expected_plan(manifest)
    create_job(api, manifest)
    [pod] = launched(api, "oom", 1, 1)
    kubelet.run(NAMESPACE, pod.metadata.name)
    message = json.dumps({"reason": "OutOfMemory", "step": 1, "measuredPeakBytes": 85 * 2**30,
                          "plannedPeakBytes": 60 * 2**30})  # fmt: skip
    kubelet.terminate(NAMESPACE, pod.metadata.name, 1, message=message)

    launched(api, "oom", 2, 1)
    status = read_job(api, "oom")["status"]
    assert status["replans"] == 1 and status["restarts"] == 0
    assert status["excludedStrategies"] == [before.strategy.identity()]
    assert status["plan"]["memory"]["perGPU"]["total"] < before.memory.per_gpu.total
    assert status["attempts"][0]["outcome"] == "OutOfMemory"
    assert "CUDA out of memory at step 1" in status["attempts"][0]["reason"]
    [replanned] = wait_for("a Replanned event", lambda: has_event(api, "oom", "Replanned"))
    assert "resuming from the last checkpoint" in replanned[2] or "starting from the model weights" in replanned[2]

    [pod] = pods(api, "oom", 2)
    kubelet.terminate(NAMESPACE, pod.metadata.name, 137, reason="OOMKilled")  # the host's memory this time
    launched(api, "oom", 3, 1)
    assert read_job(api, "oom")["status"]["replans"] == 2


def test_suspend_removes_the_pods_and_resume_starts_a_new_attempt(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet
) -> None:
    create_job(api, job_manifest("pause"))
    [pod] = launched(api, "pause", 1, 1)
    kubelet.run(NAMESPACE, pod.metadata.name)
    wait_for("phase Running", lambda: phase_is(api, "pause", "Running"))
    patch_spec(api, "pause", {"suspend": True})
    job = wait_for("phase Suspended", lambda: phase_is(api, "pause", "Suspended"))
    assert condition(job, "Suspended")["status"] == "True"
    assert wait_for("pods removed", lambda: not pods(api, "pause"))
    assert job["status"]["plan"] and job["status"]["attempts"][0]["outcome"] == "Suspended"

    patch_spec(api, "pause", {"suspend": False})
    launched(api, "pause", 2, 1)
    job = read_job(api, "pause")
    assert condition(job, "Suspended")["status"] == "False" and job["status"]["restarts"] == 0


def test_a_bad_spec_is_reported_and_the_operator_carries_on(api: client.ApiClient, operator: OperatorProcess) -> None:
    bad = job_manifest("bad", strategy={"microBatchSize": 5})  # globalBatchSize 64 is not a multiple of 5
    create_job(api, bad)
    job = wait_for("phase Invalid", lambda: phase_is(api, "bad", "Invalid"))
    ready = condition(job, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "globalBatchSize (64) is not divisible by strategy.microBatchSize (5)" in ready["message"]
    [warning] = wait_for("an InvalidSpec event", lambda: has_event(api, "bad", "InvalidSpec"))
    assert warning[0] == "Warning"
    assert not pods(api, "bad")
    create_job(api, job_manifest("good-after-bad"))
    launched(api, "good-after-bad", 1, 1)
    assert operator.process.poll() is None


def test_the_spec_cannot_change_after_launch_except_suspend(api: client.ApiClient, operator: OperatorProcess) -> None:
    create_job(api, job_manifest("frozen"))
    launched(api, "frozen", 1, 1)
    plan = read_job(api, "frozen")["status"]["plan"]
    patch_spec(api, "frozen", {"training": {"sequenceLength": 1024}})

    def rejected() -> dict[str, Any] | None:
        job = read_job(api, "frozen")
        return job if condition(job, "Ready")["reason"] == "SpecImmutable" else None

    job = wait_for("Ready=False SpecImmutable", rejected)
    assert "spec.training changed after launch" in condition(job, "Ready")["message"]
    assert job["status"]["plan"] == plan and job["status"]["launchedSpec"]["training"]["sequenceLength"] == 4096
    assert wait_for("a SpecImmutable event", lambda: has_event(api, "frozen", "SpecImmutable"))
    assert [p.metadata.name for p in pods(api, "frozen")] == ["frozen-a1-n0"]


def test_deleting_a_job_stops_it(api: client.ApiClient, operator: OperatorProcess) -> None:
    created = create_job(api, job_manifest("doomed"))
    [pod] = launched(api, "doomed", 1, 1)
    assert pod.metadata.owner_references[0].uid == created["metadata"]["uid"]  # garbage collection removes them
    client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, JOBS, "doomed")

    def gone() -> bool:
        try:
            read_job(api, "doomed")
        except ApiException as error:
            return error.status == 404
        return False

    wait_for("the job deleted (finalizer released)", gone)
    client.CoreV1Api(api).delete_namespaced_pod(pod.metadata.name, NAMESPACE)  # what the garbage collector does
    create_job(api, job_manifest("after-doomed"))
    launched(api, "after-doomed", 1, 1)  # the operator is alive and has moved on
    assert not pods(api, "doomed"), "nothing is recreated for a deleted job"


def test_operator_metrics(api: client.ApiClient, operator: OperatorProcess) -> None:
    create_job(api, job_manifest("counted"))
    launched(api, "counted", 1, 1)
    text = wait_for("the job counted", lambda: (t := operator.metrics()) and "research/counted" in t and t)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("memfit_job_phase", (("finetunejob", "research/counted"), ("phase", "Launching")))] == 1
    assert samples[("memfit_operator_jobs", (("phase", "Launching"),))] >= 1
    strategy = read_job(api, "counted")["status"]["plan"]["strategy"]
    planned = (("method", strategy["method"]), ("zero_stage", str(strategy["zeroStage"])))
    assert samples[("memfit_operator_plans_total", planned)] >= 1
    assert samples[("memfit_operator_reconcile_duration_seconds_count", ())] > 0
    assert samples[("memfit_operator_handler_errors_total", (("handler", "follow_job"),))] == 0, operator.tail()
    log = operator.log.read_text()
    assert "Forbidden" not in log, "the shipped ClusterRole lacks a permission"
    assert "Traceback" not in log


def test_the_handlers_under_kopf_testing_runner(
    server: ApiServer, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same handlers through kopf's own test runner (in this process, the operator's identity)."""
    create_namespace(api, "kopfrunner")
    grant_namespace_role(api, "kopfrunner")
    monkeypatch.setenv("KUBECONFIG", str(server.operator_kubeconfig))
    # kopf's login reads the kubernetes client's default kubeconfig path, fixed when the client was imported
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(server.operator_kubeconfig))
    monkeypatch.setenv("MEMFIT_METRICS_PORT", "0")
    manifest = job_manifest("in-process")
    manifest["metadata"]["namespace"] = "kopfrunner"
    objects = client.CustomObjectsApi(api)
    arguments = ["run", "--standalone", "--namespace", "kopfrunner", "-m", "memfit_operator.handlers"]
    with KopfRunner(arguments) as runner:
        objects.create_namespaced_custom_object(GROUP, VERSION, "kopfrunner", JOBS, manifest)
        status = wait_for("the job launched", lambda: _status(objects, "kopfrunner", "in-process").get("attempts") and
                          _status(objects, "kopfrunner", "in-process"))  # fmt: skip
    assert runner.exception is None and runner.exit_code == 0
    assert status["phase"] == "Launching"
    assert "Traceback" not in runner.output


def test_pods_do_not_exist_for_unknown_pools(api: client.ApiClient, operator: OperatorProcess) -> None:
    create_job(api, job_manifest("nowhere", resources={"pool": "h100-nowhere"}))
    job = wait_for("phase Unschedulable", lambda: phase_is(api, "nowhere", "Unschedulable"))
    assert condition(job, "Planned")["status"] == "False"
    assert "h100-nowhere" in condition(job, "Planned")["message"]
    assert not pods(api, "nowhere")


@pytest.fixture(scope="module")
def restart_namespace(api: client.ApiClient) -> str:
    create_namespace(api, "restarts")
    grant_namespace_role(api, "restarts")
    return "restarts"


def test_an_operator_killed_mid_launch_leaves_no_duplicates(
    server: ApiServer, api: client.ApiClient, restart_namespace: str, rank0: TrainerMetrics, tmp_path: Path
) -> None:
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    log = tmp_path / "operator.log"
    for round_, delay in enumerate((0.0, 0.15, 0.3, 0.6)):
        name = f"killed-{round_}"
        process = OperatorProcess(server.operator_kubeconfig, log, restart_namespace, rank0.port, "--standalone")
        manifest = job_manifest(name, method="qlora", resources={"pool": "l4", "maxGPUs": 2})
        manifest["metadata"]["namespace"] = restart_namespace
        objects.create_namespaced_custom_object(GROUP, VERSION, restart_namespace, JOBS, manifest)
        wait_for("the launch under way", lambda: _status(objects, restart_namespace, name).get("attempts"), every=0.02)  # noqa: B023
        time.sleep(delay)
        process.kill()
        process = OperatorProcess(server.operator_kubeconfig, log, restart_namespace, rank0.port, "--standalone")

        def names() -> list[str]:
            found = core.list_namespaced_pod(restart_namespace, label_selector=f"{JOB_LABEL}={name}").items  # noqa: B023
            return sorted(p.metadata.name for p in found)

        wait_for("both ranks", lambda: len(names()) == 2)
        time.sleep(3)  # a few passes of the new operator
        process.stop()
        assert names() == [f"{name}-a1-n0", f"{name}-a1-n1"], log.read_text()[-3000:]
        status = _status(objects, restart_namespace, name)
        assert len(status["attempts"]) == 1 and status["phase"] == "Launching" and status["restarts"] == 0


def _status(objects: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    return objects.get_namespaced_custom_object(GROUP, VERSION, namespace, JOBS, name).get("status") or {}


def test_two_replicas_share_the_work_through_peering(
    server: ApiServer, api: client.ApiClient, rank0: TrainerMetrics, tmp_path: Path
) -> None:
    """Two operators, one active at a time: no job is handled twice, and the standby takes over (the peering
    CRDs came with crds/)."""
    create_namespace(api, "peering")
    grant_namespace_role(api, "peering")
    objects = client.CustomObjectsApi(api)
    wait_for("KopfPeering served", lambda: _create_peering(objects), timeout=30)
    peered = ("--peering", "memfit")
    kubeconfig = server.operator_kubeconfig
    replicas = [OperatorProcess(kubeconfig, tmp_path / f"{i}.log", "peering", rank0.port, *peered) for i in range(2)]
    try:
        # Settled: both replicas have announced themselves, and had a moment to see each other (until then a
        # starting higher-priority replica and the running one may both act, harmlessly: names are fixed).
        peers = lambda: len(objects.get_namespaced_custom_object("kopf.dev", "v1", "peering", "kopfpeerings",  # noqa: E731
                                                                "memfit").get("status") or {}) == 2  # fmt: skip
        wait_for("both replicas in the peering", peers)
        time.sleep(2)
        for name in ("shared-1", "shared-2"):
            manifest = job_manifest(name)
            manifest["metadata"]["namespace"] = "peering"
            objects.create_namespaced_custom_object(GROUP, VERSION, "peering", JOBS, manifest)
        for name in ("shared-1", "shared-2"):
            wait_for(f"{name} launched", lambda name=name: _status(objects, "peering", name).get("attempts"))
        time.sleep(3)  # passes enough for a second, unpaused replica to act
        # Which replica pauses depends on their random priorities; the one that acts logs the job's Events.
        active = [r for r in replicas if "[peering/shared-1] Launching" in r.log.read_text()]
        assert len(active) == 1, "\n".join(r.tail() for r in replicas)
        [standby] = [r for r in replicas if r is not active[0]]
        assert "[peering/" not in standby.log.read_text(), standby.tail()
        for name in ("shared-1", "shared-2"):
            status = _status(objects, "peering", name)
            assert len(status["attempts"]) == 1 and status["phase"] == "Launching"

        active[0].stop()  # a rolling update: the active replica leaves, the standby resumes
        manifest = job_manifest("after-handover")
        manifest["metadata"]["namespace"] = "peering"
        objects.create_namespaced_custom_object(GROUP, VERSION, "peering", JOBS, manifest)
        handed_over = lambda: _status(objects, "peering", "after-handover").get("attempts")  # noqa: E731
        wait_for("the standby launching a new job", handed_over, timeout=60)
        # Its log line follows the status patch and the pods' creation (``_apply``): wait for it, do not race it.
        logged = lambda: "[peering/after-handover] Launching" in standby.log.read_text()  # noqa: E731
        wait_for("the standby's log line of that launch", logged, describe=standby.tail)
    finally:
        for replica in replicas:
            replica.stop()


def _create_peering(objects: client.CustomObjectsApi) -> bool:
    try:
        objects.create_namespaced_custom_object(
            "kopf.dev", "v1", "peering", "kopfpeerings", {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                                                           "metadata": {"name": "memfit"}})  # fmt: skip
    except ApiException as error:
        if error.status == 404:  # discovery has not caught up with the new CRD yet
            return False
        raise
    return True


# ------------------------------------------------------------------------------------------------
# Names the CRD takes, children the API server takes
# ------------------------------------------------------------------------------------------------

LONG_NAME = "llama-3-1-8b-instruct-customer-support-chat-finetune-for-the-emea-team-v2"  # 74 characters


@pytest.mark.parametrize("name", ["llama.chat", "8b-chat", LONG_NAME])
def test_any_valid_job_name_launches_and_runs(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet, name: str
) -> None:
    """A dot (no Service, hostname or subdomain may have one), a digit first (no Service name may), more than
    63 characters (no label value, Service name or hostname may): derived child names, accepted by the API
    server, and the operator still finds the job's pods (by owner reference, not by name)."""
    created = create_job(api, job_manifest(name))
    job = FineTuneJob.model_validate(created)
    [pod] = launched(api, name, 1, 1)
    assert pod.spec.hostname == operator_objects.hostname(
        job, 1, 0
    ) and pod.spec.subdomain == operator_objects.service_name(job)
    core = client.CoreV1Api(api)
    service = core.read_namespaced_service(operator_objects.service_name(job), NAMESPACE)
    assert service.spec.selector == {JOB_LABEL: job_label(name)}
    core.read_namespaced_config_map(operator_objects.config_map_name(job, 1), NAMESPACE)
    kubelet.run(NAMESPACE, pod.metadata.name)
    wait_for("phase Running", lambda: phase_is(api, name, "Running"))
    assert not [e for e in events(api, name) if e[0] == "Warning"]


def test_pods_with_the_jobs_labels_that_it_does_not_own_are_left_alone(
    api: client.ApiClient, operator: OperatorProcess
) -> None:
    """Labels can be copied by anyone who may create pods: the operator neither deletes such a pod (as a stale
    attempt) nor scrapes it; only the owner reference with the job's uid makes a pod the job's."""
    created = create_job(api, job_manifest("decoyed"))
    launched(api, "decoyed", 1, 1)
    core = client.CoreV1Api(api)
    spoofed_owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FineTuneJob", "name": "decoyed",
                     "uid": "00000000-0000-0000-0000-000000000000", "controller": True}  # fmt: skip
    assert created["metadata"]["uid"] != spoofed_owner["uid"]
    for decoy, owners in (("decoy-labels", []), ("decoy-owner-name", [spoofed_owner])):
        labels = {MANAGED_BY_LABEL: MANAGED_BY, JOB_LABEL: "decoyed", ATTEMPT_LABEL: "7",
                  operator_objects.RANK_LABEL: "0"}  # fmt: skip
        core.create_namespaced_pod(NAMESPACE, {
            "metadata": {"name": decoy, "labels": labels, "ownerReferences": owners},
            "spec": {"automountServiceAccountToken": False, "containers": [{"name": "c", "image": "busybox"}]},
        })  # fmt: skip
    time.sleep(5)  # several passes (every 2 s, and at once on each pod event)
    names = {p.metadata.name for p in core.list_namespaced_pod(NAMESPACE).items}
    assert {"decoy-labels", "decoy-owner-name"} <= names, operator.tail()
    status = read_job(api, "decoyed")["status"]
    assert len(status["attempts"]) == 1 and status["phase"] == "Launching"


def test_a_child_the_api_server_refuses_is_reported_on_the_job(
    server: ApiServer, api: client.ApiClient, rank0: TrainerMetrics, tmp_path: Path
) -> None:
    """A job must not sit in Launching in silence: the refusal (here a LimitRange's CPU maximum, under the
    CPU a trainer pod asks for) becomes a Warning Event on the job."""
    create_namespace(api, "limited")
    grant_namespace_role(api, "limited")
    core = client.CoreV1Api(api)
    limits = {"metadata": {"name": "small"}, "spec": {"limits": [{"type": "Container", "max": {"cpu": "1"}}]}}
    core.create_namespaced_limit_range("limited", limits)
    process = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", "limited", rank0.port,
                              "--standalone", env=CHART_SETTINGS)  # fmt: skip
    try:
        manifest = job_manifest("refused")
        manifest["metadata"]["namespace"] = "limited"
        client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, "limited", JOBS, manifest)

        def warnings() -> list[str]:
            items = core.list_namespaced_event("limited", field_selector="involvedObject.name=refused").items
            return [e.message for e in items if e.type == "Warning" and e.reason == "Launching"]

        [message] = wait_for("a Warning about the refused pod", warnings)
        assert "the API server refused Pod refused-a1-n0: 403" in message
        assert "maximum cpu usage per Container is 1" in message
        time.sleep(5)  # more passes, refused the same way: no more Events
        assert len(warnings()) == 1
        assert "Traceback" not in process.log.read_text()  # said once, as a warning, not as a crash
    finally:
        process.stop()


def test_where_the_trainer_resumed_lands_on_the_attempt_with_one_warning(
    server: ApiServer, api: client.ApiClient, kubelet: Kubelet, tmp_path: Path
) -> None:
    """Rank 0 (a stand-in exporter with the trainer's series) set a checkpoint aside and resumed from step 100:
    the attempt holds the trainer's word, and one Warning Event says it however many passes follow."""
    namespace, name = "resumes", "resumed"
    create_namespace(api, namespace)
    grant_namespace_role(api, namespace)
    registry = CollectorRegistry()
    series = {STEP_METRIC: 101, TOTAL_STEPS_METRIC: 120, CHECKPOINT_STEP_METRIC: 100, RESUMED_FROM_STEP_METRIC: 100,
              SET_ASIDE_METRIC: 1}  # fmt: skip
    for metric, value in series.items():
        gauge = Gauge(metric, metric, ["finetunejob", "rank"], registry=registry)
        gauge.labels(f"{namespace}/{name}", "0").set(value)
    exporter, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    process = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", namespace, exporter.server_port,
                              "--standalone")  # fmt: skip
    core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
    try:
        manifest = job_manifest(name)
        manifest["metadata"]["namespace"] = namespace
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, JOBS, manifest)
        [pod] = wait_for("the pod", lambda: core.list_namespaced_pod(namespace).items)
        kubelet.run(namespace, pod.metadata.name)

        def attempt() -> dict[str, Any] | None:
            job = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, JOBS, name)
            first = (job.get("status", {}).get("attempts") or [{}])[0]
            return first if "checkpointsSetAside" in first else None

        first = wait_for("the trainer's word on the attempt", attempt)
        assert (first["resumedFromStep"], first["checkpointsSetAside"]) == (100, 1)

        def warnings() -> list[str]:
            items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
            return [e.message for e in items if e.type == "Warning" and e.reason == "CheckpointSetAside"]

        [message] = wait_for("a CheckpointSetAside Warning", warnings)
        assert message.startswith("attempt 1: 1 newer checkpoint(s) failed verification") and "step 100" in message
        time.sleep(3)  # passes reading the same metrics every second: no second Event
        assert len(warnings()) == 1
    finally:
        process.stop()
        exporter.shutdown()
        thread.join(timeout=5)


# ================================================================================================
# A model without typed sizes: profiled in the cluster
# ================================================================================================


def profiled_job_manifest(name: str, claim_path: str) -> dict[str, Any]:
    """The example job without spec.model.architecture, its model on the claim `models` at ``claim_path``."""
    manifest = job_manifest(name, method="lora", resources={"pool": "l4", "maxGPUs": 1})
    manifest["spec"]["training"]["globalBatchSize"] = 8
    manifest["spec"]["lora"]["dropout"] = 0  # peft adapts the fused experts in place, without dropout
    manifest["spec"]["model"] = {"name": "tiny-qwen3-moe", "source": {"pvc": "models", "path": claim_path}}
    return manifest


def run_profiling_pod(
    api: client.ApiClient, kubelet: Kubelet, pod: client.V1Pod, work: Path, claim: Path | None = None, hub: str = ""
) -> int:
    """The kubelet's part: run the profiling pod's command exactly as its container would (the same argv, the
    claim's directory where the pod mounts it, its environment with the Secrets it references resolved, a
    temporary file as its termination log), then write the exit code and the termination message into the
    pod's status. ``hub``: the Hub stand-in's address (``HF_ENDPOINT``), the one thing added, as nothing here
    reaches the Hub."""
    [container] = pod.spec.containers
    mounts = {m.name: m.mount_path for m in container.volume_mounts}
    assert container.termination_message_path == "/dev/termination-log"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "termination-log"
    argv = list(container.command)
    if claim is not None:
        assert mounts["model"] == "/mnt/model"
        argv = [arg.replace(mounts["model"], str(claim), 1) if arg.startswith(mounts["model"]) else arg
                for arg in argv]  # fmt: skip
    argv = [str(log) if arg == container.termination_message_path else arg for arg in argv]
    assert argv[:3] == ["python", "-m", "memfit_trainer.profile"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update({e.name: e.value for e in container.env if e.value is not None})
    for variable in container.env:
        if variable.value_from is not None:
            ref = variable.value_from.secret_key_ref
            secret = client.CoreV1Api(api).read_namespaced_secret(ref.name, pod.metadata.namespace)
            env[variable.name] = base64.b64decode(secret.data[ref.key]).decode()
    env.update({"HOME": str(work), "TMPDIR": str(work), "XDG_CACHE_HOME": str(work), "HF_HOME": str(work / "hf")})
    if hub:
        env["HF_ENDPOINT"] = hub
    done = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, text=True, check=False)
    message = log.read_text(encoding="utf-8") if log.exists() else None
    reason = "Completed" if done.returncode == 0 else "Error"
    kubelet.terminate(NAMESPACE, pod.metadata.name, done.returncode, reason=reason, message=message)
    if done.returncode not in (0, 2):  # neither profiled nor refused in one line: show why in the failure
        print(f"profiler exited {done.returncode}; its stderr:\n{done.stderr[-6000:]}")
    return done.returncode


def profiling_pod(api: client.ApiClient, job: str) -> client.V1Pod:
    def found() -> client.V1Pod | None:
        items = [p for p in pods(api, job) if (p.metadata.labels or {}).get(operator_objects.PROFILING_LABEL)]
        return items[0] if items else None

    return wait_for(f"the profiling pod of {job}", found)


def test_a_job_without_typed_sizes_is_profiled_in_a_pod_then_planned_and_launched(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet, tmp_path: Path
) -> None:
    claim = tmp_path / "models"
    (claim / "qwen").mkdir(parents=True)
    (claim / "qwen" / "config.json").write_text(tiny_config("qwen3_moe").to_json_string(), encoding="utf-8")
    manifest = profiled_job_manifest("profiled", "qwen/")
    created = create_job(api, manifest)
    pod = profiling_pod(api, "profiled")
    assert pod.metadata.name == "profiled-profile-g1"
    assert pod.metadata.owner_references[0].uid == created["metadata"]["uid"]
    [container] = pod.spec.containers
    assert set(container.resources.requests) == {"cpu", "memory"} and pod.spec.restart_policy == "Never"
    job = wait_for("phase Pending, profiling", lambda: phase_is(api, "profiled", "Pending"))
    assert (condition(job, "Planned")["status"], condition(job, "Planned")["reason"]) == ("False", "Profiling")
    assert wait_for("a Profiling event", lambda: has_event(api, "profiled", "Profiling"))

    assert run_profiling_pod(api, kubelet, pod, tmp_path, claim) == 0
    job = wait_for("phase Launching", lambda: phase_is(api, "profiled", "Launching"))
    spec = FineTuneJob.model_validate(created).spec
    core = client.CoreV1Api(api)
    stored = core.read_namespaced_config_map(operator_objects.profile_config_map_name(spec), NAMESPACE)
    assert stored.immutable is True and not stored.metadata.owner_references
    profile = ModelProfile.model_validate_json(stored.data[operator_objects.PROFILE_FILE])
    assert profile.model_type == "qwen3_moe" and profile.activations is not None
    assert stored.metadata.labels[operator_objects.CONFIG_SHA256_LABEL] == profile.config_sha256[:63]
    assert stored.metadata.annotations[operator_objects.MODEL_REFERENCE_ANNOTATION] == "pvc:models/qwen"
    model = ProfiledModel(profile)
    plan = plan_job(spec, load_documents(ROOT / "examples" / "inventory.yaml").pools, model=model).chosen
    assert job["status"]["plan"] == plan.to_api()
    assert condition(job, "Planned")["status"] == "True"
    launched(api, "profiled", 1, plan.strategy.nodes)
    config_map = core.read_namespaced_config_map("profiled-a1", NAMESPACE)
    trainer = json.loads(config_map.data[operator_objects.CONFIG_FILE])
    assert trainer["model"]["plannedFields"] == model.planned_fields()
    assert trainer["model"]["nameOrPath"] == "/mnt/model/qwen"
    assert wait_for("a Profiled event", lambda: has_event(api, "profiled", "Profiled"))
    assert wait_for("the profiling pod removed", lambda: not client.CoreV1Api(api).list_namespaced_pod(
        NAMESPACE, field_selector="metadata.name=profiled-profile-g1").items)  # fmt: skip

    # A second job of the same model plans from the stored profile: no profiling pod.
    create_job(api, profiled_job_manifest("profiled-again", "/qwen"))
    launched(api, "profiled-again", 1, plan.strategy.nodes)
    assert read_job(api, "profiled-again")["status"]["plan"] == plan.to_api()
    assert not [
        p for p in pods(api, "profiled-again") if (p.metadata.labels or {}).get(operator_objects.PROFILING_LABEL)
    ]
    assert not has_event(api, "profiled-again", "Profiling")


def test_a_claim_without_config_json_makes_the_job_invalid_with_the_profilers_line(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet, tmp_path: Path
) -> None:
    claim = tmp_path / "models"
    (claim / "empty").mkdir(parents=True)
    create_job(api, profiled_job_manifest("unprofiled", "empty/"))
    pod = profiling_pod(api, "unprofiled")
    assert run_profiling_pod(api, kubelet, pod, tmp_path, claim) == 2
    job = wait_for("phase Invalid", lambda: phase_is(api, "unprofiled", "Invalid"))
    planned = condition(job, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "ModelUnreadable")
    # The profiler's own line (in a pod it names /mnt/model/empty; here the claim's directory stands in).
    assert f"{claim / 'empty'}: no config.json in this directory (pod unprofiled-profile-g1)" in planned["message"]
    [warning] = wait_for("a ModelUnreadable event", lambda: has_event(api, "unprofiled", "ModelUnreadable"))
    assert warning[0] == "Warning" and "no config.json" in warning[2]
    assert [p.metadata.name for p in pods(api, "unprofiled")] == ["unprofiled-profile-g1"]  # kept for its logs
    assert "Forbidden" not in operator.log.read_text()


def test_a_hub_model_is_profiled_with_the_jobs_token_and_a_gated_one_without_it_is_one_line(
    api: client.ApiClient, operator: OperatorProcess, kubelet: Kubelet, tmp_path: Path
) -> None:
    """A model on the Hub (a stand-in at ``HF_ENDPOINT``): the profiling pod reads its config.json with the
    token of the job's Secret and nothing else; a gated model whose job names no token is refused in the
    profiler's one line, on the job's condition and in a Warning Event."""
    config = {"config.json": tiny_config("qwen3_moe").to_json_string().encode()}
    repos = {"memfit-tests/tiny-qwen3-moe": config, "memfit-tests/gated": config}
    tokens = {repo: "hf_memfit_test_token" for repo in repos}
    token = {"token": "hf_memfit_test_token"}
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name="hf-token"), string_data=token)
    client.CoreV1Api(api).create_namespaced_secret(NAMESPACE, secret)
    with hub_stand_in(repos, tokens) as hub:
        manifest = profiled_job_manifest("from-hub", "unused")
        repo = "memfit-tests/tiny-qwen3-moe"
        manifest["spec"]["model"] = {"name": repo, "source": {"hub": repo, "tokenSecretRef": {"name": "hf-token"}}}
        create_job(api, manifest)
        pod = profiling_pod(api, "from-hub")
        assert "model" not in {m.name for m in pod.spec.containers[0].volume_mounts}  # nothing but config.json
        assert run_profiling_pod(api, kubelet, pod, tmp_path / "one", hub=hub.url) == 0
        job = wait_for("phase Launching", lambda: phase_is(api, "from-hub", "Launching"))
        assert condition(job, "Planned")["status"] == "True"
        stored = client.CoreV1Api(api).read_namespaced_config_map(
            operator_objects.profile_config_map_name(FineTuneJob.model_validate(job).spec), NAMESPACE
        )
        reference = stored.metadata.annotations[operator_objects.MODEL_REFERENCE_ANNOTATION]
        assert reference == "hub:memfit-tests/tiny-qwen3-moe"
        fetched = [(method, auth) for method, path, auth in hub.requests if path.endswith("/config.json")]
        assert fetched and all(auth == "Bearer hf_memfit_test_token" for _, auth in fetched)

        gated = profiled_job_manifest("gated-no-token", "unused")
        gated["spec"]["model"] = {"name": "memfit-tests/gated", "source": {"hub": "memfit-tests/gated"}}
        create_job(api, gated)
        pod = profiling_pod(api, "gated-no-token")
        assert run_profiling_pod(api, kubelet, pod, tmp_path / "two", hub=hub.url) == 2
    job = wait_for("phase Invalid", lambda: phase_is(api, "gated-no-token", "Invalid"))
    planned = condition(job, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "ModelUnreadable")
    assert "memfit-tests/gated: the Hub refuses access to this gated repository" in planned["message"]
    assert "tokenSecretRef" in planned["message"] and planned["message"].count("\n") == 0
    assert wait_for("a ModelUnreadable event", lambda: has_event(api, "gated-no-token", "ModelUnreadable"))
