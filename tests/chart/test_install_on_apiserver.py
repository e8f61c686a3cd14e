"""`helm install` on a real kube-apiserver, as far as one goes without a kubelet: the chart's CRDs and every
rendered object are accepted by the server, and the operator, started with the rendered Deployment's own
arguments under the rendered ServiceAccount (its ClusterRole and binding, nothing else), peers through the
rendered ClusterKopfPeering, plans against the rendered GPUPools and launches a job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.dynamic import DynamicClient

from tests.chart.render import CHART, NAMESPACE, by_kind, render
from tests.k8s.apiserver import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, ApiServer, running_apiserver
from tests.k8s.cluster import GROUP, VERSION, create_namespace, example, install_crds, wait_for
from tests.k8s.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s
VALUES = {
    "serviceAccount": {"name": OPERATOR_SERVICE_ACCOUNT},
    "gpuPools": [{"name": p["metadata"]["name"], "spec": p["spec"]} for p in example("inventory.yaml")],
}
CRD_FILES = sorted((CHART / "crds").glob("*.yaml"))
ENVTEST_KUBE_VERSION = "v1.20.2"
"""The API server here (shared/k8s builds 1.20): the chart picks the API versions it serves."""


@pytest.fixture(scope="module")
def installed() -> Iterator[tuple[ApiServer, client.ApiClient, list[dict[str, Any]]]]:
    assert NAMESPACE == OPERATOR_NAMESPACE  # the test's ServiceAccount identity is the release's
    objects = render(VALUES, kube_version=ENVTEST_KUBE_VERSION)
    with running_apiserver() as server:
        api = config.new_client_from_config(str(server.kubeconfig))
        install_crds(api, *CRD_FILES)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
        dynamic = DynamicClient(api)  # discovery after the CRDs: every kind the chart renders, by its API version
        for item in objects:
            resource = dynamic.resources.get(api_version=item["apiVersion"], kind=item["kind"])
            resource.create(body=item, namespace=NAMESPACE if resource.namespaced else None)
        yield server, api, objects


def test_every_rendered_object_is_accepted(installed: tuple[ApiServer, client.ApiClient, list[dict[str, Any]]]) -> None:
    _, api, objects = installed
    apps, rbac = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    [deployment] = by_kind(objects, "Deployment")
    stored = apps.read_namespaced_deployment(deployment["metadata"]["name"], NAMESPACE)
    assert stored.spec.replicas == 2 and stored.spec.template.spec.service_account_name == OPERATOR_SERVICE_ACCOUNT
    [role] = by_kind(objects, "ClusterRole")
    assert rbac.read_cluster_role(role["metadata"]["name"]).rules
    pools = client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, "gpupools")["items"]
    assert sorted(p["metadata"]["name"] for p in pools) == sorted(p["name"] for p in VALUES["gpuPools"])


def test_the_operator_runs_as_installed(
    installed: tuple[ApiServer, client.ApiClient, list[dict[str, Any]]], tmp_path: Path
) -> None:
    server, api, objects = installed
    [deployment] = by_kind(objects, "Deployment")
    arguments = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert arguments[0] == "operator"
    flags = [a for a in arguments[1:] if not a.startswith(("--metrics-port", "--health-port"))]  # free ports here
    assert "--peering=memfit" in flags and not any(a.startswith("--standalone") for a in flags)
    operator = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", None, 9, *flags)
    try:
        create_namespace(api, "team-a")
        job = example("llama-3.1-8b-lora.yaml")[0]
        job["metadata"]["namespace"] = "team-a"
        client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, "team-a", "finetunejobs", job)
        core = client.CoreV1Api(api)
        [pod] = wait_for("the job's pod", lambda: core.list_namespaced_pod("team-a").items, timeout=60)
        image = next(a for a in flags if a.startswith("--trainer-image=")).split("=", 1)[1]
        assert pod.spec.containers[0].image == image
        log = operator.log.read_text()
        assert "Forbidden" not in log and "Traceback" not in log, operator.tail()
    finally:
        operator.stop()
