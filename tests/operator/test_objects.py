"""The manifests of one attempt, field by field (pure functions: no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import load_documents
from memfit.planner.search import plan_job
from memfit.render.trainer_config import render_trainer_config
from memfit_operator import objects

ROOT = Path(__file__).parent.parent.parent
IMAGE = "registry.example/memfit-trainer:0.1.0"


@pytest.fixture
def job() -> FineTuneJob:
    document = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())
    document["metadata"]["uid"] = "1234-abcd"
    document["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "research", "team": "nlp"}
    document["spec"]["model"]["architecture"] = {"preset": "llama-2-70b"}  # needs several nodes
    document["spec"]["method"] = "full"
    document["spec"]["resources"] = {"pool": "a100-80gb"}
    return FineTuneJob.model_validate(document)


@pytest.fixture
def planned(job: FineTuneJob):  # type: ignore[no-untyped-def]
    pools = load_documents(ROOT / "examples" / "inventory.yaml").pools
    pool = next(p for p in pools if p.metadata.name == "a100-80gb")
    plan = plan_job(job.spec, [pool]).chosen
    assert plan is not None and plan.strategy.nodes > 1
    return plan, pool


def test_attempt_is_a_configmap_a_headless_service_and_a_pod_per_node(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, pool = planned
    manifests = objects.attempt_objects(job, plan, pool, render_trainer_config(job, plan), 2, IMAGE)
    kinds = [m["kind"] for m in manifests]
    assert kinds == ["ConfigMap", "Service"] + ["Pod"] * plan.strategy.nodes
    for manifest in manifests:
        owner = manifest["metadata"]["ownerReferences"][0]
        assert owner == {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "name": "llama-chat",
                         "uid": "1234-abcd", "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        assert manifest["metadata"]["namespace"] == "research"
        assert manifest["metadata"]["labels"]["memfit.dev/job"] == "llama-chat"
    names = [m["metadata"]["name"] for m in manifests[2:]]
    assert names == [f"llama-chat-a2-n{rank}" for rank in range(plan.strategy.nodes)]


def test_configmap_holds_exactly_the_rendered_configs(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, _ = planned
    rendered = render_trainer_config(job, plan)
    data = objects.config_map(job, rendered, 1)["data"]
    config = json.loads(data[objects.CONFIG_FILE])
    assert config["deepspeed"] == json.loads(data[objects.DEEPSPEED_FILE]) == rendered.deepspeed
    assert config["metrics"] == {"port": objects.METRICS_PORT, "progressFile": objects.PROGRESS_FILE}
    assert config["terminationLog"] == "/dev/termination-log"
    assert "secret" not in json.dumps(config).lower()  # the token reaches the pod through the env only
    assert config["model"]["tokenEnv"] == "HF_TOKEN"


def test_headless_service_for_rendezvous(job) -> None:  # type: ignore[no-untyped-def]
    service = objects.headless_service(job)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"memfit.dev/job": "llama-chat"}


def test_pod_runs_torchrun_for_its_node_rank(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, pool = planned
    pod = objects.trainer_pod(job, plan, pool, attempt=1, node_rank=1, image=IMAGE)
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert container["command"][:6] == [
        "torchrun", f"--nnodes={plan.strategy.nodes}", f"--nproc-per-node={plan.strategy.gpus_per_node}",
        "--node-rank=1", "--master-addr=llama-chat-n0.llama-chat.research.svc", "--master-port=29500",
    ]  # fmt: skip
    assert container["command"][-2:] == ["--config", "/etc/memfit/trainer-config.json"]
    assert (spec["hostname"], spec["subdomain"]) == ("llama-chat-n1", "llama-chat")
    assert container["resources"]["limits"] == {"nvidia.com/gpu": str(plan.strategy.gpus_per_node)}
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a100-pool",
                                    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}  # fmt: skip
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert "team" not in pod["metadata"]["labels"]


def test_pod_security_and_volumes(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, pool = planned
    pod = objects.trainer_pod(job, plan, pool, attempt=1, node_rank=0, image=IMAGE)
    container = pod["spec"]["containers"][0]
    assert container["securityContext"] == {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["terminationMessagePath"] == "/dev/termination-log"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "shm" and mounts["/mnt/data"]["readOnly"] is True
    assert mounts["/mnt/output"]["readOnly"] is False
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    assert volumes["config"]["configMap"]["name"] == "llama-chat-a1"


def test_hub_token_only_through_a_secret_reference(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, pool = planned
    env = objects.trainer_pod(job, plan, pool, attempt=1, node_rank=0, image=IMAGE)["spec"]["containers"][0]["env"]
    token = next(e for e in env if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert all("value" not in e or "hf_" not in e["value"] for e in env)


def test_a_job_without_uid_is_refused(job) -> None:  # type: ignore[no-untyped-def]
    job.metadata.__pydantic_extra__.pop("uid")
    with pytest.raises(ValueError, match="has no uid"):
        objects.headless_service(job)
