"""The chart installed on the real node once for the session, the way the README tells a user: CRDs, then
every object ``helm install`` renders (Helm's own Go code through helm-python-sdk), applied with kubectl.

``make e2e`` starts the node and loads the images before pytest and stops the node after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.cluster import E2E_LABEL, KUBECONFIG, REPO, ApiBridge, api_endpoints, apply, kubectl, namespace
from tests.chart.render import NAMESPACE, chart_crds, render

NODE_KUBE_VERSION = "v1.20.2"
OPERATOR_IMAGE = ("localhost/memfit-operator", "dev")
TRAINER_CPU_IMAGE = ("localhost/memfit-trainer", "dev-cpu")
"""What ``make images`` builds and ``make images-load`` puts into the node's containerd."""
INSTALL_SECONDS = 300.0
GPU_POOL, GPU_PRODUCT = "l4", "NVIDIA-L4"
TEST_NAMESPACES = ("e2e",)


def cpu_pool() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((REPO / "examples" / "cpu" / "pool.yaml").read_text())
    return {"name": document["metadata"]["name"], "spec": document["spec"]}


VALUES: dict[str, Any] = {
    "operator": {"image": {"repository": OPERATOR_IMAGE[0], "tag": OPERATOR_IMAGE[1]}},
    "trainer": {
        "image": {"repository": TRAINER_CPU_IMAGE[0], "tag": TRAINER_CPU_IMAGE[1]},
        "cpuImage": {"repository": TRAINER_CPU_IMAGE[0], "tag": TRAINER_CPU_IMAGE[1]},
        "cacheGiB": 1,
    },
    "gpuPools": [cpu_pool(), {"name": GPU_POOL, "spec": {
        "gpuProduct": GPU_PRODUCT, "gpusPerNode": 1, "nodes": 1, "cpuMemoryGiBPerNode": 8.0, "cpusPerRank": 0.5}}],
}  # fmt: skip
"""The chart's values for this node: the images built here, its CPU pool, and a GPU pool whose GPUs the node
advertises (:func:`advertised_gpus`) without having any."""


def reset() -> None:
    """What an earlier run left: its jobs (their finalizers dropped, in case no operator is left to remove
    them), its namespaces and volumes."""
    listed = kubectl("get", "finetunejobs", "-A", "-o", "json", check=False)  # nothing before the CRDs exist
    for job in json.loads(listed)["items"] if listed.strip() else []:
        kubectl("patch", "finetunejob", job["metadata"]["name"], "-n", job["metadata"]["namespace"], "--type=merge",
                "-p", '{"metadata": {"finalizers": []}}')  # fmt: skip
    kubectl("delete", "namespace", *TEST_NAMESPACES, NAMESPACE, "--ignore-not-found", "--timeout=300s")
    kubectl("delete", "pv", "-l", f"{E2E_LABEL}=true", "--ignore-not-found")


@pytest.fixture(scope="session")
def installed() -> Iterator[list[dict[str, Any]]]:
    if not KUBECONFIG.exists() or kubectl("get", "--raw", "/readyz", check=False).strip() != "ok":
        pytest.fail(f"no node answers at {KUBECONFIG}: run `make e2e` (it starts hack/node first)")
    reset()
    bridge = ApiBridge()
    apply([api_endpoints()])
    crds = chart_crds()
    # The node is Kubernetes 1.20 (the chart asks for 1.25+): its kubectl does not know the CRDs' CEL rules
    # (x-kubernetes-validations), which the 1.20 server drops; everything else is validated as usual.
    apply(crds, validate=False)
    for crd in crds:
        kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
    apply([namespace(NAMESPACE)])
    objects = render(VALUES, kube_version=NODE_KUBE_VERSION)
    apply(objects, namespace=NAMESPACE)
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    kubectl("rollout", "status", f"deployment/{deployment['metadata']['name']}", "-n", NAMESPACE,
            f"--timeout={INSTALL_SECONDS:.0f}s")  # fmt: skip
    yield objects
    bridge.shutdown()


@pytest.fixture(scope="session")
def advertised_gpus(installed: list[dict[str, Any]]) -> Iterator[str]:
    """The node labelled as a GPU node and advertising two ``nvidia.com/gpu`` (a status patch, the documented
    way to advertise a node-level extended resource): GPU pods schedule, and see no device."""
    node = kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}")
    kubectl("label", "node", node, "--overwrite", f"nvidia.com/gpu.product={GPU_PRODUCT}")
    patch = [{"op": "add", "path": f"/status/{field}/nvidia.com~1gpu", "value": "2"}
             for field in ("capacity", "allocatable")]  # fmt: skip
    kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(patch))
    yield node
    kubectl("label", "node", node, "nvidia.com/gpu.product-")
    removal = [{"op": "remove", "path": f"/status/{field}/nvidia.com~1gpu"} for field in ("capacity", "allocatable")]
    kubectl("patch", "node", node, "--subresource=status", "--type=json", "-p", json.dumps(removal), check=False)
