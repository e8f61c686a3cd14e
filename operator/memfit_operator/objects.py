"""Pure builders of the Kubernetes objects one attempt of a FineTuneJob runs as.

No cluster, no client: each function turns the job, its plan and its pool into a plain manifest dict,
so every field can be tested exhaustively. One attempt = a ConfigMap (trainer and DeepSpeed configs), a
headless Service (stable DNS for rendezvous), optionally a NetworkPolicy, and one Pod per node rank, all
owned by the job.

Child names: a FineTuneJob's name is any DNS subdomain (up to 253 characters, dots allowed, a digit first),
but a Service name must be a DNS-1035 label (63, a letter first, no dots), a pod's hostname and subdomain
DNS-1123 labels (63, no dots) and a label value at most 63 characters. Each child name is the job's name
with its suffix where that is valid as is; otherwise it is derived: dots become dashes, a Service name that
would start with a digit gets the prefix ``ftj-``, the name is cut to fit, and a short hash of the job's
full name is added, so the result is valid, deterministic and distinct from other jobs' children.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from memfit.api.base import API_VERSION, GROUP, SecretKeyRef
from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import GPU_PRODUCT_LABEL, GPUPool, pool_capacity
from memfit.api.plan import PlanCandidate
from memfit.api.runtime import IMAGE_RUNTIME, Runtime
from memfit.api.vocabulary import ALL_LINEAR, MANAGED_BY, MANAGED_BY_LABEL, Offload
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.lifetime import TEARDOWN_SECONDS, stop_seconds
from memfit.contract.sections import MetricsConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit.planner.evaluated import node_ram
from memfit.profile import PROFILE_VERSION, ModelProfile
from memfit.render.deepspeed import NVME_PATH
from memfit.render.trainer_config import POD_MOUNTS, inside, model_config
from memfit.units import GIB

CONFIG_DIR = "/etc/memfit"
CONFIG_FILE = "trainer-config.json"
DEEPSPEED_FILE = "deepspeed.json"
TERMINATION_LOG = "/dev/termination-log"
RENDEZVOUS_PORT = 29500
METRICS_PORT = 9400
GPU_RESOURCE = "nvidia.com/gpu"
SHM_LIMIT = "16Gi"
MIB = 1024**2

TMP_DIR = "/tmp"
CACHE_DIR = "/var/cache/memfit"
"""Hugging Face downloads and datasets (HF_HOME), XDG caches, Triton and CUDA JIT caches, HOME."""
TORCH_EXTENSIONS_DIR = "/var/cache/torch_extensions"
"""DeepSpeed's JIT-compiled ops (the trainer image ships them prebuilt; an op it lacks is built here)."""
TMP_BYTES = 4 * GIB
"""/tmp: torchrun's error files, small temporary files."""
TORCH_EXTENSIONS_BYTES = 2 * GIB
DEFAULT_CACHE_BYTES = 50 * GIB
"""Room for the Hugging Face datasets cache (Arrow files of the dataset) and the other caches, besides the
model weights a Hub download adds (settings.trainer_cache_gib)."""
WEIGHT_BYTES_PER_PARAMETER = 2
"""A checkpoint on disk: 16-bit safetensors (what the Hub serves for the models memfit knows)."""
DISK_MARGIN = 1.1
HOST_MEMORY_LIMIT_MARGIN = 1.25
"""The memory limit is the planned host memory plus a quarter (never above the node's declared memory):
the plan is an estimate, and an OOM kill costs the gang a restart."""
CPUS_PER_RANK = 2
"""CPU cores requested per rank (one process per GPU: its Python thread, data loading, NCCL proxies)."""
CPUS_PER_RANK_OFFLOADING = 4
"""Per rank when states are offloaded to CPU memory or NVMe: DeepSpeed's CPU Adam and async I/O threads."""
CPU_LIMIT_FACTOR = 2
"""CPU limit = request x this: bursts (checkpoint writes, data loading) are not throttled at once."""

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
    "readOnlyRootFilesystem": True,
}


HASH_LENGTH = 8
DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
SERVICE_PREFIX = "ftj-"
"""Prepended to a derived Service name that would start with a digit (DNS-1035 wants a letter)."""
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def name_hash(name: str) -> str:
    """A short, stable hash of a job's name (hex: valid in every kind of name)."""
    return hashlib.sha256(name.encode()).hexdigest()[:HASH_LENGTH]


def _derived(name: str, suffix: str, limit: int, valid: re.Pattern[str], prefix: str = "") -> str:
    """``name + suffix`` when ``valid`` takes it within ``limit`` characters; else the name made safe (dots
    to dashes, ``prefix`` where it must start with a letter), cut to fit, with the hash of the full name."""
    plain = name + suffix
    if len(plain) <= limit and valid.fullmatch(plain):
        return plain
    base = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if prefix and not base[:1].isalpha():
        base = prefix + base
    room = limit - len(suffix) - HASH_LENGTH - 1
    base = base[:room].rstrip("-")
    return f"{base}-{name_hash(name)}{suffix}" if base else f"{prefix}{name_hash(name)}{suffix}"


def job_label(name: str) -> str:
    """The value of the job label of a job with this name: the name, or a derived one past 63 characters."""
    return _derived(name, "", LABEL_VALUE_MAX, LABEL_VALUE)


def job_label_value(job: FineTuneJob) -> str:
    """The value of the job label on every child of ``job``."""
    return job_label(job.metadata.name)


def labels(job: FineTuneJob, attempt: int | None = None) -> dict[str, str]:
    """The labels every child carries (and selects on)."""
    result = {
        "app.kubernetes.io/name": "memfit-trainer",
        MANAGED_BY_LABEL: MANAGED_BY,
        JOB_LABEL: job_label_value(job),
    }
    if attempt is not None:
        result[ATTEMPT_LABEL] = str(attempt)
    return result


def attempt_of(pod: Mapping[str, Any]) -> str | None:
    """The attempt number a pod's label says it belongs to."""
    return (pod.get("metadata", {}).get("labels") or {}).get(ATTEMPT_LABEL)


def owner_of(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the FineTuneJob that controls a pod, by its owner reference; None for a pod no
    FineTuneJob controls (labels alone prove nothing: anyone who can create pods can copy them)."""
    for owner in (pod.get("metadata") or {}).get("ownerReferences") or []:
        api_version = str(owner.get("apiVersion", ""))
        if owner.get("controller") and owner.get("kind") == "FineTuneJob" and api_version.startswith(GROUP + "/"):
            name, uid = owner.get("name"), owner.get("uid")
            if name and uid:
                return str(name), str(uid)
    return None


def owned_by(pod: Mapping[str, Any], job_uid: str | None) -> bool:
    """Whether the FineTuneJob with this uid controls the pod (created it, as the operator does)."""
    owner = owner_of(pod)
    return job_uid is not None and owner is not None and owner[1] == job_uid


def owned_pods(pods: Sequence[Mapping[str, Any]], job_uid: str | None) -> list[Mapping[str, Any]]:
    return [pod for pod in pods if owned_by(pod, job_uid)]


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
    """The headless Service, and the pods' subdomain: a DNS-1035 label."""
    return _derived(job.metadata.name, "", DNS_LABEL_MAX, DNS1035_LABEL, prefix=SERVICE_PREFIX)


def config_map_name(job: FineTuneJob, attempt: int) -> str:
    return _derived(job.metadata.name, f"-a{attempt}", DNS_SUBDOMAIN_MAX, DNS1123_SUBDOMAIN)


def network_policy_name(job: FineTuneJob, attempt: int) -> str:
    return config_map_name(job, attempt)


def pod_name(job: FineTuneJob, attempt: int, node_rank: int) -> str:
    return _derived(job.metadata.name, f"-a{attempt}-n{node_rank}", DNS_SUBDOMAIN_MAX, DNS1123_SUBDOMAIN)


def hostname(job: FineTuneJob, attempt: int, node_rank: int) -> str:
    """A pod's hostname: a DNS-1123 label, one per attempt. The Service publishes pods that are not ready, and
    a pod of the previous attempt still terminating (its torchrun agent waiting at its exit barrier, its
    rendezvous store still listening) would otherwise answer to the new rank 0's name too: a restarted gang
    could join the old store and wait forever."""
    return _derived(job.metadata.name, f"-a{attempt}-n{node_rank}", DNS_LABEL_MAX, DNS1123_LABEL)


def master_address(job: FineTuneJob, attempt: int) -> str:
    """The attempt's rank 0, by its DNS name through the headless Service."""
    return f"{hostname(job, attempt, 0)}.{service_name(job)}.{job.metadata.namespace}.svc"


def pod_trainer_config(trainer_config: TrainerConfig) -> TrainerConfig:
    """The trainer config as the pods see it: metrics on the fixed port (the operator reads progress from there,
    so no progress file), the termination message where the pod template puts it."""
    return trainer_config.model_copy(
        update={
            "metrics": MetricsConfig(port=METRICS_PORT),
            "termination_log": TERMINATION_LOG,
        }
    )


def config_map(job: FineTuneJob, trainer_config: TrainerConfig, attempt: int) -> dict[str, Any]:
    """The trainer config, and beside it (for people reading the ConfigMap) the DeepSpeed JSON it holds; the fsdp2
    engine has none."""
    config = pod_trainer_config(trainer_config)
    data = {CONFIG_FILE: config.to_json()}
    if isinstance(config.engine, DeepSpeedEngineSection):
        data[DEEPSPEED_FILE] = json.dumps(config.engine.config, indent=2) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job, attempt), attempt),
        "data": data,
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
            "selector": {JOB_LABEL: job_label_value(job)},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT},
            ],
        },
    }


@dataclass(frozen=True)
class TrainerOptions:
    """How this operator builds trainer pods beyond the job and its plan (its settings)."""

    cache_bytes: int = DEFAULT_CACHE_BYTES
    """Room in the cache volume besides downloaded weights (datasets cache and the rest)."""
    network_policy: bool = False
    """Create a NetworkPolicy per attempt: the gang's pods reach each other, ``metrics_peers`` reach the
    metrics ports, nothing else reaches the pods."""
    metrics_peers: tuple[Mapping[str, Any], ...] = ()
    """NetworkPolicy peers allowed to the metrics ports (the operator, Prometheus)."""
    cpu_image: str | None = None
    """Image of the trainer pods on CPU pools (``gpuProduct: cpu``: the trainer built for DeepSpeed's CPU
    accelerator); None: the one image of every pod."""
    runtime: Runtime = IMAGE_RUNTIME
    """The kernel packages the trainer image carries beyond torch (the chart's ``trainer.kernelPackages``):
    plans use only their kernels."""


def quantity(size: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to a whole MiB."""
    return f"{math.ceil(size / MIB)}Mi"


def weights_on_disk(plan: PlanCandidate) -> int:
    """Bytes of the model's checkpoint files."""
    return math.ceil(plan.parameter_count * WEIGHT_BYTES_PER_PARAMETER * DISK_MARGIN)


def _downloads_weights(job: FineTuneJob) -> bool:
    source = job.spec.model.source
    return not job.spec.model.random_init and (source is None or source.pvc is None)


def _uses_nvme(plan: PlanCandidate) -> bool:
    return Offload.NVME in (plan.strategy.offload_optimizer, plan.strategy.offload_parameters)


def volume_sizes(job: FineTuneJob, plan: PlanCandidate, pool: GPUPool, options: TrainerOptions) -> dict[str, int]:
    """sizeLimit of each scratch emptyDir, in bytes: what the plan says lands there, plus fixed room."""
    weights = weights_on_disk(plan)
    sizes = {
        # The trainer builds a random-init model in a temporary directory (its weights are written once).
        "tmp": TMP_BYTES + (weights if job.spec.model.random_init else 0),
        "cache": options.cache_bytes + (weights if _downloads_weights(job) else 0),
        "torch-extensions": TORCH_EXTENSIONS_BYTES,
    }
    if _uses_nvme(plan):  # offloaded states on the node's local disk: the planned bytes, within the pool's NVMe
        planned = plan.memory.per_node.nvme
        sizes["nvme"] = max(planned, min(math.ceil(planned * DISK_MARGIN), pool_capacity(pool).nvme_bytes_per_node))
    return sizes


def _volumes(
    job: FineTuneJob, plan: PlanCandidate, pool: GPUPool, attempt: int, options: TrainerOptions
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts. The root filesystem is read-only: every place the
    trainer writes is a volume of its own, each scratch one with a sizeLimit."""
    spec = job.spec
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(job, attempt)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_LIMIT}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    paths = {"tmp": TMP_DIR, "cache": CACHE_DIR, "torch-extensions": TORCH_EXTENSIONS_DIR, "nvme": NVME_PATH}
    for name, size in volume_sizes(job, plan, pool, options).items():  # the node's local disk (NVMe on GPU nodes)
        volumes.append({"name": name, "emptyDir": {"sizeLimit": quantity(size)}})
        mounts.append({"name": name, "mountPath": paths[name]})
    claims: list[tuple[str, str | None, str | None, bool]] = [
        ("data", spec.dataset.source.pvc, POD_MOUNTS.data, True),
        ("output", spec.output.pvc, POD_MOUNTS.output, False),
    ]
    if spec.model.source is not None:
        claims.append(("model", spec.model.source.pvc, POD_MOUNTS.model, True))
    # One volume per claim, mounted where each use wants it: a pod that names one claim in two volumes (the
    # model and the data on one claim) never starts (seen on a real node: FailedMount, "timed out waiting").
    shared: dict[str, dict[str, Any]] = {}
    for name, claim, path, read_only in claims:
        if claim is None or path is None:
            continue
        if claim not in shared:
            shared[claim] = {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
            volumes.append(shared[claim])
        volume = shared[claim]
        volume["persistentVolumeClaim"]["readOnly"] &= read_only  # read-only only where every use is
        mounts.append({"name": volume["name"], "mountPath": path, "readOnly": read_only})
    return volumes, mounts


def cpus_per_rank(plan: PlanCandidate, pool: GPUPool) -> float:
    """The pool's ``cpusPerRank``, else memfit's rule: more cores where states are offloaded to the host."""
    if pool.spec.cpus_per_rank is not None:
        return pool.spec.cpus_per_rank
    offloading = {plan.strategy.offload_optimizer, plan.strategy.offload_parameters} - {Offload.NONE}
    return CPUS_PER_RANK_OFFLOADING if offloading else CPUS_PER_RANK


def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity (whole cores plainly, fractions in millicores)."""
    return str(int(cores)) if cores == int(cores) else f"{math.ceil(cores * 1000)}m"


def _pod(metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A Pod that runs once (no restart: the operator decides what follows), with no API credentials, as a
    non-root user under the runtime's seccomp profile."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            # No Docker-link variables of the namespace's Services: a Service named like memfit-... would set
            # MEMFIT_* variables the trainer reads.
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            **spec,
        },
    }


def _hub_token(secret: SecretKeyRef) -> dict[str, Any]:
    """``HF_TOKEN`` from the job's Secret (the token itself never appears in a spec)."""
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}


def _python_environment(job: FineTuneJob, threads: str) -> list[dict[str, Any]]:
    """What every memfit container runs Python with: its threads, the job's name, and (the root filesystem is
    read-only) the temporary, home and cache directories in writable volumes."""
    return [
        {"name": "OMP_NUM_THREADS", "value": threads},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "MEMFIT_JOB", "value": f"{job.metadata.namespace}/{job.metadata.name}"},
        {"name": "TMPDIR", "value": TMP_DIR},
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]


def _environment(job: FineTuneJob, plan: PlanCandidate, pool: GPUPool) -> list[dict[str, Any]]:
    # On a CPU pool DeepSpeed is told its accelerator (it would only warn and guess without a GPU).
    accelerator = [{"name": "DS_ACCELERATOR", "value": "cpu"}] if pool.spec.cpu_only else []
    threads = max(1, math.floor(cpus_per_rank(plan, pool) * CPU_LIMIT_FACTOR))
    env = (
        _python_environment(job, str(threads))
        + accelerator
        + [
            # Every other cache of the trainer's libraries into the writable cache volume, too.
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/torchinductor"},
            {"name": "CUDA_CACHE_PATH", "value": f"{CACHE_DIR}/nv"},
            {"name": "TORCH_EXTENSIONS_DIR", "value": TORCH_EXTENSIONS_DIR},
        ]
    )
    source = job.spec.model.source
    if source is not None and source.token_secret_ref is not None:
        env.append(_hub_token(source.token_secret_ref))
    if source is None or source.pvc is not None:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # weights are on a volume: never reach out
    return env


def resources(plan: PlanCandidate, pool: GPUPool) -> dict[str, dict[str, str]]:
    """GPUs, CPU and memory of one node rank. Memory: the plan's host memory of the node (offloaded states, with
    the buffers DeepSpeed pins as the pinned allocator rounds them: the cgroup is charged for them and cannot
    swap them; model loading, each rank's runtime; on a CPU pool also the ranks' memory, and no GPU) as the request; the
    limit a quarter above it, never above the node's declared memory. CPU: the pool's cores per rank, else by
    the plan's offload; the limit twice that."""
    strategy = plan.strategy
    capacity = pool_capacity(pool)
    memory = node_ram(plan.memory.per_gpu.total, plan.memory.per_node.cpu, capacity, strategy.gpus_per_node)
    memory_limit = max(memory, min(math.ceil(memory * HOST_MEMORY_LIMIT_MARGIN), capacity.cpu_memory_bytes_per_node))
    cpus = cpus_per_rank(plan, pool) * strategy.gpus_per_node
    gpus = {} if capacity.cpu_only else {GPU_RESOURCE: str(strategy.gpus_per_node)}
    return {
        "requests": {**gpus, "cpu": cpu_quantity(cpus), "memory": quantity(memory)},
        "limits": {**gpus, "cpu": cpu_quantity(cpus * CPU_LIMIT_FACTOR), "memory": quantity(memory_limit)},
    }


def metrics_ports(ranks_per_node: int) -> list[dict[str, Any]]:
    """One container port per local rank (rank r serves on METRICS_PORT + r): `metrics` for rank 0, then
    `metrics-1`, ... so a PodMonitor scrapes every GPU of the node, not only the first."""
    return [
        {"name": "metrics" if rank == 0 else f"metrics-{rank}", "containerPort": METRICS_PORT + rank}
        for rank in range(ranks_per_node)
    ]


def _shutdown_timeout(plan: PlanCandidate) -> dict[str, str]:
    """How long torchrun, signalled, waits for its ranks' checkpoint before it kills them (30 s by default)."""
    return {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(stop_seconds(plan))}


def trainer_pod(
    job: FineTuneJob,
    plan: PlanCandidate,
    pool: GPUPool,
    attempt: int,
    node_rank: int,
    image: str,
    options: TrainerOptions | None = None,
) -> dict[str, Any]:
    """One node rank of the gang: torchrun starting one trainer process per GPU of the node."""
    strategy = plan.strategy
    capacity = pool_capacity(pool)
    options = options or TrainerOptions()
    volumes, mounts = _volumes(job, plan, pool, attempt, options)
    product = {} if capacity.cpu_only else {GPU_PRODUCT_LABEL: capacity.product}
    command = [
        "torchrun",
        f"--nnodes={strategy.nodes}",
        f"--nproc-per-node={strategy.gpus_per_node}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_address(job, attempt)}",
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
    return _pod(
        metadata,
        {
            "hostname": hostname(job, attempt, node_rank),
            "subdomain": service_name(job),
            "nodeSelector": {**pool.spec.node_selector, **product},
            "tolerations": [t.to_api() for t in pool.spec.tolerations],
            # SIGTERM: the ranks finish their step and checkpoint it (memfit.contract.lifetime.stop_seconds).
            "terminationGracePeriodSeconds": stop_seconds(plan) + TEARDOWN_SECONDS,
            "volumes": volumes,
            "containers": [
                {
                    "name": "trainer",
                    "image": options.cpu_image if capacity.cpu_only and options.cpu_image else image,
                    "command": command,
                    "env": [*_environment(job, plan, pool), _shutdown_timeout(plan)],
                    "ports": [
                        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
                        *metrics_ports(strategy.gpus_per_node),
                    ],
                    "resources": resources(plan, pool),
                    "volumeMounts": mounts,
                    "terminationMessagePath": TERMINATION_LOG,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": RESTRICTED_SECURITY_CONTEXT,
                }
            ],
        },
    )


def network_policy(job: FineTuneJob, plan: PlanCandidate, attempt: int, options: TrainerOptions) -> dict[str, Any]:
    """Ingress of one attempt's pods: from the pods of the same attempt on any port (torchrun's rendezvous
    on 29500, and NCCL's and Gloo's bootstrap and data sockets, which listen on ephemeral ports), and from
    ``options.metrics_peers`` on the metrics ports. Nothing else reaches them while it exists."""
    gang = {MANAGED_BY_LABEL: MANAGED_BY, JOB_LABEL: job_label_value(job), ATTEMPT_LABEL: str(attempt)}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": gang}}]}]
    if options.metrics_peers:
        ports = [{"protocol": "TCP", "port": METRICS_PORT + rank} for rank in range(plan.strategy.gpus_per_node)]
        ingress.append({"from": [dict(peer) for peer in options.metrics_peers], "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, network_policy_name(job, attempt), attempt),
        "spec": {"podSelector": {"matchLabels": gang}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def attempt_objects(
    job: FineTuneJob,
    plan: PlanCandidate,
    pool: GPUPool,
    trainer_config: TrainerConfig,
    attempt: int,
    image: str,
    options: TrainerOptions | None = None,
) -> list[dict[str, Any]]:
    """Everything one attempt needs, in creation order (the NetworkPolicy before the pods it isolates)."""
    options = options or TrainerOptions()
    pods = [trainer_pod(job, plan, pool, attempt, rank, image, options) for rank in range(plan.strategy.nodes)]
    policy = [network_policy(job, plan, attempt, options)] if options.network_policy else []
    return [config_map(job, trainer_config, attempt), headless_service(job), *policy, *pods]


# --- profiling a model the job types no sizes for -------------------------------------------------------------

PROFILING_LABEL = "memfit.dev/profiling"
"""On the profiling pod of a job (value ``"true"``): not a rank of any attempt."""
GENERATION_LABEL = "memfit.dev/generation"
"""The job's metadata.generation a profiling pod was made for: a changed spec gets a pod of its own."""
PROFILE_LABEL = "memfit.dev/profile"
"""On a profile ConfigMap: the hash of the model reference and LoRA targets (its name's suffix)."""
CONFIG_SHA256_LABEL = "memfit.dev/config-sha256"
"""On a profile ConfigMap: the profiled config.json's sha256 (its first 63 hex digits: a label value's most)."""
MODEL_REFERENCE_ANNOTATION = "memfit.dev/model-reference"
CONFIG_SHA256_ANNOTATION = "memfit.dev/config-sha256"
LORA_TARGETS_ANNOTATION = "memfit.dev/lora-targets"
PROFILE_FILE = "profile.json"
PROFILE_CONFIG_MAP_PREFIX = "memfit-profile-"
PROFILING_REQUESTS = {"cpu": "1", "memory": "2Gi"}
PROFILING_LIMITS = {"cpu": "2", "memory": "6Gi"}
"""The profiler builds the model on the meta device and traces a truncated copy under FakeTensorMode: no
weights in memory, tens of seconds of one or two cores for a full-size config."""
PROFILING_DEADLINE_SECONDS = 900
PROFILING_TMP_BYTES = 1 * GIB
PROFILING_CACHE_BYTES = 1 * GIB
"""HF_HOME and the other caches: a Hub model's config.json is all the profiler downloads."""


def model_reference(spec: FineTuneJobSpec) -> str:
    """Which model a job names, as a profile is cached for it: ``pvc:CLAIM/PATH`` on a claim (the path normalized
    as the pod mounts it), else ``hub:ID`` (what the trainer loads with ``from_pretrained``)."""
    model = spec.model
    if model.source is not None and model.source.pvc is not None:
        path = inside("/", model.source.path).lstrip("/")
        return f"pvc:{model.source.pvc}/{path}"
    return f"hub:{model.name}"


def profile_lora_targets(spec: FineTuneJobSpec) -> list[str]:
    """The ``--lora-targets`` the job needs resolved besides ``all-linear`` (which every profile resolves)."""
    targets = spec.lora.target_modules
    return [] if ALL_LINEAR in targets else [",".join(sorted(targets))]


def profile_key(spec: FineTuneJobSpec) -> str:
    """A hash of what a profile depends on: the profile format's version, the model reference, the LoRA targets."""
    key = json.dumps([PROFILE_VERSION, model_reference(spec), profile_lora_targets(spec)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def profile_config_map_name(spec: FineTuneJobSpec) -> str:
    """The ConfigMap holding the profile of the job's model: shared by every job of the namespace naming the same
    model with the same LoRA targets."""
    return PROFILE_CONFIG_MAP_PREFIX + profile_key(spec)


def profile_config_map(job: FineTuneJob, profile: ModelProfile) -> dict[str, Any]:
    """The profile of the job's model, kept for every job of the same model: immutable, owned by no job (deleting
    the job keeps it; deleting the ConfigMap makes the next job profile the model again)."""
    spec = job.spec
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": profile_config_map_name(spec),
            "namespace": job.metadata.namespace,
            "labels": {
                "app.kubernetes.io/name": "memfit-profile",
                MANAGED_BY_LABEL: MANAGED_BY,
                PROFILE_LABEL: profile_key(spec),
                CONFIG_SHA256_LABEL: profile.config_sha256[:LABEL_VALUE_MAX],
            },
            "annotations": {
                MODEL_REFERENCE_ANNOTATION: model_reference(spec),
                CONFIG_SHA256_ANNOTATION: profile.config_sha256,
                LORA_TARGETS_ANNOTATION: ";".join([ALL_LINEAR, *profile_lora_targets(spec)]),
            },
        },
        "immutable": True,
        "data": {PROFILE_FILE: profile.model_dump_json() + "\n"},
    }


def profile_of(config_map: Mapping[str, Any]) -> ModelProfile:
    """The profile a profile ConfigMap holds; ValueError when it holds none memfit reads."""
    text = (config_map.get("data") or {}).get(PROFILE_FILE)
    if not isinstance(text, str):
        raise ValueError(f"it has no {PROFILE_FILE}")
    try:
        return ModelProfile.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first['loc']) or PROFILE_FILE}: {first['msg']}") from error


def profiling_pod_name(job: FineTuneJob, generation: int) -> str:
    return _derived(job.metadata.name, f"-profile-g{generation}", DNS_SUBDOMAIN_MAX, DNS1123_SUBDOMAIN)


def is_profiling_pod(pod: Mapping[str, Any]) -> bool:
    return (pod.get("metadata", {}).get("labels") or {}).get(PROFILING_LABEL) == "true"


def profiled_path(spec: FineTuneJobSpec) -> str:
    """What the profiler reads: the model's directory where the pod mounts its claim, else the Hub id."""
    return model_config(spec.model, POD_MOUNTS.model).name_or_path


def profiling_command(spec: FineTuneJobSpec) -> list[str]:
    """The profiling pod's argv: the profile goes to the termination message (memfit.contract.profile_message)."""
    command = ["python", "-m", "memfit_trainer.profile", profiled_path(spec), "--activations"]
    for targets in profile_lora_targets(spec):
        command += ["--lora-targets", targets]
    if not _on_claim(spec):
        command.append("--hub")
    return [*command, "--termination-log", TERMINATION_LOG]


def _on_claim(spec: FineTuneJobSpec) -> bool:
    return spec.model.source is not None and spec.model.source.pvc is not None


def profiling_pod(job: FineTuneJob, generation: int, image: str) -> dict[str, Any]:
    """One short CPU-only pod that profiles the job's model from its config.json (no GPU, no weights read): the
    trainer image, the trainer pods' security context, the model's claim read-only where the trainer pods mount
    it (or, for a Hub model, the job's token Secret as HF_TOKEN)."""
    spec = job.spec
    metadata = _metadata(job, profiling_pod_name(job, generation))
    metadata["labels"].update({PROFILING_LABEL: "true", GENERATION_LABEL: str(generation)})
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": quantity(PROFILING_TMP_BYTES)}},
        {"name": "cache", "emptyDir": {"sizeLimit": quantity(PROFILING_CACHE_BYTES)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    env = _python_environment(job, PROFILING_LIMITS["cpu"])
    source = spec.model.source
    if source is not None and source.pvc is not None:
        claim = {"claimName": source.pvc, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": POD_MOUNTS.model, "readOnly": True})
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # the config is on the claim: never reach out
    elif source is not None and source.token_secret_ref is not None:
        env.append(_hub_token(source.token_secret_ref))
    return _pod(
        metadata,
        {
            "activeDeadlineSeconds": PROFILING_DEADLINE_SECONDS,
            "volumes": volumes,
            "containers": [
                {
                    "name": "profiler",
                    "image": image,
                    "command": profiling_command(spec),
                    "env": env,
                    "resources": {"requests": dict(PROFILING_REQUESTS), "limits": dict(PROFILING_LIMITS)},
                    "volumeMounts": mounts,
                    "terminationMessagePath": TERMINATION_LOG,
                    # The profile is the message: never replaced by the log's tail (which FallbackToLogsOnError
                    # would do on a failure without a message: the reconciler reports the exit code then).
                    "terminationMessagePolicy": "File",
                    "securityContext": RESTRICTED_SECURITY_CONTEXT,
                }
            ],
        },
    )
