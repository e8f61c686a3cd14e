"""The manifests of one attempt, field by field (pure functions: no cluster needed)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import load_documents
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.memory.estimate import activation_setup, peak_memory, static_memory
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import StaticSetup
from memfit.planner.search import lora_settings, plan_job
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
    isolated = objects.TrainerOptions(network_policy=True)
    with_policy = objects.attempt_objects(job, plan, pool, render_trainer_config(job, plan), 2, IMAGE, isolated)
    assert [m["kind"] for m in with_policy] == ["ConfigMap", "Service", "NetworkPolicy"] + ["Pod"] * plan.strategy.nodes
    for manifest in manifests:
        owner = manifest["metadata"]["ownerReferences"][0]
        assert owner == {"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob", "name": "llama-chat",
                         "uid": "1234-abcd", "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        assert manifest["metadata"]["namespace"] == "research"
        assert manifest["metadata"]["labels"]["memfit.dev/job"] == "llama-chat"
    names = [m["metadata"]["name"] for m in manifests[2:]]
    assert names == [f"llama-chat-a2-n{rank}" for rank in range(plan.strategy.nodes)]


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_configmap_holds_exactly_the_rendered_configs(job, engine: str) -> None:  # type: ignore[no-untyped-def]
    job, plan, _ = plan_for(job, engine=engine)
    assert plan.strategy.engine == engine
    rendered = render_trainer_config(job, plan)
    data = objects.config_map(job, rendered, 1)["data"]
    config = json.loads(data[objects.CONFIG_FILE])
    assert config["engine"]["kind"] == engine
    if isinstance(rendered.engine, DeepSpeedEngineSection):
        assert config["engine"]["config"] == json.loads(data[objects.DEEPSPEED_FILE]) == rendered.engine.config
    else:  # the fsdp2 engine has no DeepSpeed JSON
        assert objects.DEEPSPEED_FILE not in data and "config" not in config["engine"]
        assert "reshardAfterForward" in config["engine"]  # its settings
    assert config["metrics"] == {"port": objects.METRICS_PORT}  # no progress file: the operator scrapes /metrics
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
        "--node-rank=1", "--master-addr=llama-chat-a1-n0.llama-chat.research.svc", "--master-port=29500",
    ]  # fmt: skip
    assert container["command"][-2:] == ["--config", "/etc/memfit/trainer-config.json"]
    assert (spec["hostname"], spec["subdomain"]) == ("llama-chat-a1-n1", "llama-chat")
    gpus = str(plan.strategy.gpus_per_node)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert spec["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a100-pool",
                                    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}  # fmt: skip
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False  # no MEMFIT_* variables from Services named memfit-...
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert "team" not in pod["metadata"]["labels"]


def test_pod_security_and_volumes(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, pool = planned
    pod = objects.trainer_pod(job, plan, pool, attempt=1, node_rank=0, image=IMAGE)
    container = pod["spec"]["containers"][0]
    assert container["securityContext"] == {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}, "readOnlyRootFilesystem": True,
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


@pytest.mark.parametrize(("model_claim", "output_claim"), [("datasets", "checkpoints"), ("datasets", "datasets")])
def test_one_volume_per_claim_mounted_where_each_use_wants_it(job, planned, model_claim, output_claim) -> None:  # type: ignore[no-untyped-def]
    """A pod naming one claim in two volumes never starts (the kubelet times out mounting the second)."""
    plan, pool = planned
    spec = job.spec.model_copy(deep=True)
    spec.model.source = spec.model.source.model_copy(update={"pvc": model_claim, "hub": None, "path": "llama"})
    spec.output = spec.output.model_copy(update={"pvc": output_claim})
    pod = objects.trainer_pod(job.model_copy(update={"spec": spec}), plan, pool, attempt=1, node_rank=0, image=IMAGE)
    claims = [v["persistentVolumeClaim"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert sorted(c["claimName"] for c in claims) == sorted({"datasets", model_claim, output_claim})
    by_claim = {c["claimName"]: c for c in claims}
    assert by_claim["datasets"]["readOnly"] is (output_claim != "datasets")  # writable where the output is
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert (mounts["/mnt/data"]["readOnly"], mounts["/mnt/model"]["readOnly"], mounts["/mnt/output"]["readOnly"]) == (
        True, True, False)  # fmt: skip
    assert mounts["/mnt/data"]["name"] == mounts["/mnt/model"]["name"]


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


# ------------------------------------------------------------------------------------------------
# Child names: valid for the API server whatever name the CRD accepts
# ------------------------------------------------------------------------------------------------

# The API server's own rules (k8s.io/apimachinery/pkg/util/validation), written out independently.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # Service names
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # pod hostname and subdomain
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # pods, ConfigMaps
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LONG = "llama-3-1-8b-instruct-customer-support-chat-finetune-for-the-emea-team-v2"  # 74 characters
NAMES = ["llama-chat", "llama.chat", "8b-chat", "8b.chat.v2", "7", LONG, LONG.replace("-", "."), "x" * 253,
         "a" + "-b" * 126]  # fmt: skip


def named(job: FineTuneJob, name: str) -> FineTuneJob:
    return job.model_copy(update={"metadata": job.metadata.model_copy(update={"name": name})})


@pytest.mark.parametrize("name", NAMES)
def test_every_child_name_is_valid_for_the_api_server(job, planned, name: str) -> None:  # type: ignore[no-untyped-def]
    """Names the CRD takes (any DNS subdomain up to 253 characters) give children the API server takes."""
    plan, pool = planned
    job = named(job, name)
    service = objects.service_name(job)
    assert DNS1035_LABEL.match(service) and len(service) <= 63, service
    for manifest in objects.attempt_objects(job, plan, pool, render_trainer_config(job, plan), 12, IMAGE,
                                            objects.TrainerOptions(network_policy=True)):  # fmt: skip
        metadata = manifest["metadata"]
        assert DNS1123_SUBDOMAIN.match(metadata["name"]) and len(metadata["name"]) <= 253, metadata["name"]
        for value in metadata["labels"].values():
            assert LABEL_VALUE.match(value) and len(value) <= 63, value
        if manifest["kind"] == "Service":
            assert metadata["name"] == service
            assert manifest["spec"]["selector"][objects.JOB_LABEL] == objects.job_label(name)
        if manifest["kind"] == "Pod":
            spec = manifest["spec"]
            assert spec["subdomain"] == service
            assert DNS1123_LABEL.match(spec["hostname"]) and len(spec["hostname"]) <= 63, spec["hostname"]
            master = next(a for a in spec["containers"][0]["command"] if a.startswith("--master-addr="))
            assert master == f"--master-addr={objects.hostname(job, 12, 0)}.{service}.research.svc"
        if manifest["kind"] == "NetworkPolicy":
            assert manifest["spec"]["podSelector"]["matchLabels"][objects.JOB_LABEL] == objects.job_label(name)


def test_valid_names_are_kept_and_derived_ones_are_stable_and_distinct(job) -> None:  # type: ignore[no-untyped-def]
    plain = named(job, "llama-chat")
    assert (objects.service_name(plain), objects.hostname(plain, 1, 0), objects.job_label_value(plain)) == (
        "llama-chat", "llama-chat-a1-n0", "llama-chat")  # fmt: skip
    dotted, dashed = named(job, "llama.chat"), named(job, "llama-chat")
    assert objects.service_name(dotted).startswith("llama-chat-") and objects.service_name(dotted) != "llama-chat"
    assert objects.service_name(dotted) == objects.service_name(named(job, "llama.chat"))  # deterministic
    assert objects.hostname(dotted, 1, 1) != objects.hostname(dashed, 1, 1)
    # A restarted gang's rank 0 has a name of its own: the previous attempt's pod, still terminating and
    # published by the Service, never answers for it.
    assert objects.master_address(plain, 2) != objects.master_address(plain, 1)
    assert objects.service_name(named(job, "8b-chat")).startswith("ftj-8b-chat-")
    assert objects.hostname(named(job, "8b-chat"), 1, 0) == "8b-chat-a1-n0"  # a DNS-1123 label may start with a digit
    # Two long names that share their first 63 characters still get different children.
    first, second = named(job, LONG), named(job, LONG[:-1] + "3")
    assert objects.service_name(first) != objects.service_name(second)
    assert objects.job_label_value(first) != objects.job_label_value(second)
    assert objects.service_name(first).endswith(objects.name_hash(LONG))


# ------------------------------------------------------------------------------------------------
# Resources, read-only root filesystem, bounded scratch volumes
# ------------------------------------------------------------------------------------------------


def plan_for(job: FineTuneJob, **strategy: object):  # type: ignore[no-untyped-def]
    pools = load_documents(ROOT / "examples" / "inventory.yaml").pools
    spec = job.spec.model_copy(update={"strategy": job.spec.strategy.model_copy(update=strategy)})
    job = job.model_copy(update={"spec": spec})
    plan = plan_job(job.spec, pools).chosen
    assert plan is not None
    return job, plan, next(p for p in pools if p.metadata.name == plan.strategy.pool)


def mebibytes(quantity: str) -> int:
    assert quantity.endswith("Mi"), quantity
    return int(quantity[:-2]) * 2**20


def test_cpu_and_memory_requests_and_limits_come_from_the_plan(job) -> None:  # type: ignore[no-untyped-def]
    for strategy in ({}, {"offload_optimizer": "cpu"}):
        job_, plan, pool = plan_for(job, **strategy)
        container = objects.trainer_pod(job_, plan, pool, 1, 0, IMAGE)["spec"]["containers"][0]
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        host = plan.memory.per_node.cpu  # offloaded states and model loading of the node's ranks
        assert host <= mebibytes(requests["memory"]) < host + 2**20
        node = pool.spec.cpu_memory_gib_per_node * 2**30
        assert mebibytes(requests["memory"]) <= mebibytes(limits["memory"]) <= max(node, mebibytes(requests["memory"]))
        assert mebibytes(limits["memory"]) >= min(host * 1.2, node)  # headroom over an estimate
        ranks = plan.strategy.gpus_per_node
        per_rank = 4 if strategy else 2  # DeepSpeed's CPU Adam needs cores when the optimizer is offloaded
        assert (int(requests["cpu"]), int(limits["cpu"])) == (per_rank * ranks, 2 * per_rank * ranks)
        threads = next(e["value"] for e in container["env"] if e["name"] == "OMP_NUM_THREADS")
        assert int(threads) == int(limits["cpu"]) // ranks  # each rank's threads fit its share of the limit


def test_offloaded_activations_are_in_the_pods_memory_request(job) -> None:  # type: ignore[no-untyped-def]
    job_, plan, pool = plan_for(job, gradient_checkpointing=True, activation_offloading=True)
    strategy = plan.strategy
    assert strategy.activation_offloading
    spec = job_.spec
    shape = spec.planned_model()
    lora = lora_settings(spec, shape)
    sequence = spec.training.sequence_length
    host = model_activations(shape, activation_setup(shape, strategy, sequence, lora)).host_bytes
    assert host > 0
    without = dataclasses.replace(strategy, activation_offloading=False)
    activations = model_activations(shape, activation_setup(shape, without, sequence, lora))
    cpu_without = peak_memory(static_memory(shape, StaticSetup.of(without), lora), activations, 1).per_node.cpu
    assert plan.memory.per_node.cpu == cpu_without + strategy.gpus_per_node * host  # every rank's inputs
    container = objects.trainer_pod(job_, plan, pool, 1, 0, IMAGE)["spec"]["containers"][0]
    assert mebibytes(container["resources"]["requests"]["memory"]) >= plan.memory.per_node.cpu


def writable(pod: dict, path: str) -> dict | None:
    """The volume that holds ``path`` if it is writable (the root filesystem is not)."""
    container = pod["spec"]["containers"][0]
    mounts = sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    mount = next((m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")), None)
    if mount is None or mount.get("readOnly"):
        return None
    return next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])


@pytest.mark.parametrize("source", ["hub", "pvc", "random"])
def test_every_place_the_trainer_writes_is_a_bounded_volume(job, source: str) -> None:  # type: ignore[no-untyped-def]
    model = job.spec.model
    if source == "pvc":
        model = model.model_copy(update={"source": type(model.source).model_validate({"pvc": "models"})})
    elif source == "random":
        model = model.model_copy(update={"random_init": True, "source": None})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})
    job, plan, pool = plan_for(job, zero_stage=3, offload_optimizer="nvme", offload_parameters="nvme")
    pod = objects.trainer_pod(job, plan, pool, 1, 0, IMAGE)
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    caches = ("TMPDIR", "HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
              "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR")  # fmt: skip
    written = [env[name] for name in caches]
    written += ["/tmp", "/dev/shm", "/mnt/output/llama-chat", "/local_nvme"]
    for path in written:
        assert writable(pod, path) is not None, f"{path} is not on a writable volume"
    for volume in pod["spec"]["volumes"]:
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), f"emptyDir {volume['name']} has no sizeLimit"
    sizes = {v["name"]: mebibytes(v["emptyDir"]["sizeLimit"]) for v in pod["spec"]["volumes"]
             if "emptyDir" in v and v["name"] != "shm"}  # fmt: skip
    weights = plan.parameter_count * 2  # the 16-bit checkpoint
    assert sizes["nvme"] >= plan.memory.per_node.nvme > 0  # the offloaded states the plan puts there
    assert (sizes["cache"] >= weights) is (source == "hub")  # Hub downloads land in HF_HOME
    assert (sizes["tmp"] >= weights) is (source == "random")  # a random-init model is written to TMPDIR once
    assert writable(pod, "/mnt/data") is None  # the dataset stays read-only


def test_network_policy_isolates_an_attempt(job, planned) -> None:  # type: ignore[no-untyped-def]
    plan, _ = planned
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    options = objects.TrainerOptions(network_policy=True, metrics_peers=(prometheus,))
    policy = objects.network_policy(job, plan, 3, options)
    gang = {"app.kubernetes.io/managed-by": "memfit", "memfit.dev/job": "llama-chat", "memfit.dev/attempt": "3"}
    assert policy["metadata"]["name"] == "llama-chat-a3"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    assert policy["spec"]["podSelector"] == {"matchLabels": gang}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    among, metrics = policy["spec"]["ingress"]
    assert among == {"from": [{"podSelector": {"matchLabels": gang}}]}  # the gang, on its rendezvous ports
    assert metrics["from"] == [prometheus]
    assert [p["port"] for p in metrics["ports"]] == [
        objects.METRICS_PORT + r for r in range(plan.strategy.gpus_per_node)
    ]
    pod = objects.trainer_pod(job, plan, planned[1], 3, 0, IMAGE)
    assert gang.items() <= pod["metadata"]["labels"].items()
    assert objects.network_policy(job, plan, 3, objects.TrainerOptions(network_policy=True))["spec"]["ingress"] == [
        among]  # no peers: nothing reaches the metrics ports  # fmt: skip
