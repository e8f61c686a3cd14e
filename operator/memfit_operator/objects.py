"""Pure builders of the Kubernetes objects one attempt of a FineTuneJob runs as.

No cluster, no client: each function turns the job, its plan and its pool into a plain manifest dict,
so every field can be tested exhaustively. One attempt = a ConfigMap (trainer and DeepSpeed configs), a
headless Service (stable DNS for rendezvous) and one Pod per node rank, all owned by the job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from memfit.api.base import API_VERSION
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPU_PRODUCT_LABEL, GPUPool, pool_capacity
from memfit.api.plan import PlanCandidate
from memfit.contract.trainer_config import MetricsConfig, TrainerConfig
from memfit.render.deepspeed import NVME_PATH
from memfit.render.trainer_config import POD_MOUNTS

CONFIG_DIR = "/etc/memfit"
CONFIG_FILE = "trainer-config.json"
DEEPSPEED_FILE = "deepspeed.json"
PROGRESS_FILE = "/tmp/memfit/progress.json"
TERMINATION_LOG = "/dev/termination-log"
RENDEZVOUS_PORT = 29500
METRICS_PORT = 9400
GPU_RESOURCE = "nvidia.com/gpu"
SHM_LIMIT = "16Gi"

JOB_LABEL = "memfit.dev/job"
ATTEMPT_LABEL = "memfit.dev/attempt"
RANK_LABEL = "memfit.dev/node-rank"
PASSTHROUGH_LABEL_PREFIXES = ("kueue.x-k8s.io/",)
"""Job labels copied to the pods, so queueing systems (Kueue) see and admit them."""

RESTRICTED_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def labels(job: FineTuneJob, attempt: int | None = None) -> dict[str, str]:
    """The labels every child carries (and selects on)."""
    result = {
        "app.kubernetes.io/name": "memfit-trainer",
        "app.kubernetes.io/managed-by": "memfit",
        JOB_LABEL: job.metadata.name,
    }
    if attempt is not None:
        result[ATTEMPT_LABEL] = str(attempt)
    return result


def attempt_of(pod: Mapping[str, Any]) -> str | None:
    """The attempt number a pod's label says it belongs to."""
    return (pod.get("metadata", {}).get("labels") or {}).get(ATTEMPT_LABEL)


def owner_reference(job: FineTuneJob) -> dict[str, Any]:
    uid = job.metadata.model_extra.get("uid") if job.metadata.model_extra else None
    if not uid:
        raise ValueError(f"FineTuneJob {job.metadata.name!r} has no uid: read it from the API server first")
    return {
        "apiVersion": API_VERSION,
        "kind": "FineTuneJob",
        "name": job.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: FineTuneJob, name: str, attempt: int | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": labels(job, attempt),
        "ownerReferences": [owner_reference(job)],
    }


def service_name(job: FineTuneJob) -> str:
    return job.metadata.name


def config_map_name(job: FineTuneJob, attempt: int) -> str:
    return f"{job.metadata.name}-a{attempt}"


def pod_name(job: FineTuneJob, attempt: int, node_rank: int) -> str:
    return f"{job.metadata.name}-a{attempt}-n{node_rank}"


def hostname(job: FineTuneJob, node_rank: int) -> str:
    return f"{job.metadata.name}-n{node_rank}"


def master_address(job: FineTuneJob) -> str:
    """Rank 0's stable DNS name through the headless Service."""
    return f"{hostname(job, 0)}.{service_name(job)}.{job.metadata.namespace}.svc"


def pod_trainer_config(trainer_config: TrainerConfig) -> TrainerConfig:
    """The trainer config as the pods see it: metrics on the fixed port, progress and termination
    message where the pod template puts them."""
    return trainer_config.model_copy(
        update={
            "metrics": MetricsConfig(port=METRICS_PORT, progress_file=PROGRESS_FILE),
            "termination_log": TERMINATION_LOG,
        }
    )


def config_map(job: FineTuneJob, trainer_config: TrainerConfig, attempt: int) -> dict[str, Any]:
    config = pod_trainer_config(trainer_config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job, attempt), attempt),
        "data": {
            CONFIG_FILE: config.to_json(),
            DEEPSPEED_FILE: json.dumps(config.deepspeed, indent=2) + "\n",
        },
    }


def headless_service(job: FineTuneJob) -> dict[str, Any]:
    """Gives each pod (hostname + subdomain) a DNS name before it is ready: rendezvous needs it early."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, service_name(job)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job.metadata.name},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT},
            ],
        },
    }


def _volumes(job: FineTuneJob, attempt: int, nvme: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = job.spec
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(job, attempt)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_LIMIT}},
        {"name": "scratch", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/tmp"},
    ]
    claims: list[tuple[str, str | None, str | None, bool]] = [
        ("data", spec.dataset.source.pvc, POD_MOUNTS.data, True),
        ("output", spec.output.pvc, POD_MOUNTS.output, False),
    ]
    if spec.model.source is not None:
        claims.append(("model", spec.model.source.pvc, POD_MOUNTS.model, True))
    for name, claim, path, read_only in claims:
        if claim is None or path is None:
            continue
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}})
        mounts.append({"name": name, "mountPath": path, "readOnly": read_only})
    if nvme:
        volumes.append({"name": "nvme", "emptyDir": {}})  # the node's local disk (NVMe on GPU nodes)
        mounts.append({"name": "nvme", "mountPath": NVME_PATH})
    return volumes, mounts


def _environment(job: FineTuneJob) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "OMP_NUM_THREADS", "value": "4"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "MEMFIT_JOB", "value": f"{job.metadata.namespace}/{job.metadata.name}"},
    ]
    source = job.spec.model.source
    if source is not None and source.token_secret_ref is not None:
        secret = source.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    if source is None or source.pvc is not None:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # weights are on a volume: never reach out
    return env


def metrics_ports(ranks_per_node: int) -> list[dict[str, Any]]:
    """One container port per local rank (rank r serves on METRICS_PORT + r): `metrics` for rank 0, then
    `metrics-1`, ... so a PodMonitor scrapes every GPU of the node, not only the first."""
    return [
        {"name": "metrics" if rank == 0 else f"metrics-{rank}", "containerPort": METRICS_PORT + rank}
        for rank in range(ranks_per_node)
    ]


def trainer_pod(
    job: FineTuneJob, plan: PlanCandidate, pool: GPUPool, attempt: int, node_rank: int, image: str
) -> dict[str, Any]:
    """One node rank of the gang: torchrun starting one trainer process per GPU of the node."""
    strategy = plan.strategy
    capacity = pool_capacity(pool)
    nvme = "nvme" in (strategy.offload_optimizer, strategy.offload_parameters)
    volumes, mounts = _volumes(job, attempt, nvme)
    command = [
        "torchrun",
        f"--nnodes={strategy.nodes}",
        f"--nproc-per-node={strategy.gpus_per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_address(job)}",
        f"--master-port={RENDEZVOUS_PORT}",
        "-m",
        "memfit_trainer.main",
        "--config",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
    ]
    metadata = _metadata(job, pod_name(job, attempt, node_rank), attempt)
    metadata["labels"][RANK_LABEL] = str(node_rank)
    metadata["labels"].update(
        {k: v for k, v in job.metadata.labels.items() if k.startswith(PASSTHROUGH_LABEL_PREFIXES)}
    )
    metadata["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}
    gpus = str(strategy.gpus_per_node)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Never",
            "hostname": hostname(job, node_rank),
            "subdomain": service_name(job),
            "automountServiceAccountToken": False,
            "nodeSelector": {**pool.spec.node_selector, GPU_PRODUCT_LABEL: capacity.product},
            "tolerations": [t.to_api() for t in pool.spec.tolerations],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },  # fmt: skip
            "terminationGracePeriodSeconds": 60,
            "volumes": volumes,
            "containers": [
                {
                    "name": "trainer",
                    "image": image,
                    "command": command,
                    "env": _environment(job),
                    "ports": [
                        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
                        *metrics_ports(strategy.gpus_per_node),
                    ],
                    "resources": {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}},
                    "volumeMounts": mounts,
                    "terminationMessagePath": TERMINATION_LOG,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": RESTRICTED_SECURITY_CONTEXT,
                }
            ],
        },
    }


def attempt_objects(
    job: FineTuneJob, plan: PlanCandidate, pool: GPUPool, trainer_config: TrainerConfig, attempt: int, image: str
) -> list[dict[str, Any]]:
    """Everything one attempt needs, in creation order."""
    pods = [trainer_pod(job, plan, pool, attempt, rank, image) for rank in range(plan.strategy.nodes)]
    return [config_map(job, trainer_config, attempt), headless_service(job), *pods]
