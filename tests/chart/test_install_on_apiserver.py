"""`helm install` on a real kube-apiserver, as far as one goes without a kubelet: the chart's CRDs and every
rendered object are accepted by the server, and the operator, started with the rendered Deployment's own
arguments and environment under the rendered ServiceAccount (its roles and bindings, nothing else), peers
through the rendered (Cluster)KopfPeering, plans against the rendered GPUPools and launches a job. Twice: an
operator of every namespace, and one restricted to a namespace (whose RBAC grants no writes elsewhere)."""

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
VARIANTS = {"all-namespaces": VALUES, "one-namespace": {**VALUES, "watchNamespace": "team-a"}}
CRD_FILES = sorted((CHART / "crds").glob("*.yaml"))
ENVTEST_KUBE_VERSION = "v1.20.2"
"""The API server ``hack/envtest-assets`` builds: the chart picks the API versions it serves."""
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}"
Installed = tuple[ApiServer, client.ApiClient, list[dict[str, Any]], str]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def installed(request: pytest.FixtureRequest) -> Iterator[Installed]:
    assert NAMESPACE == OPERATOR_NAMESPACE  # the test's ServiceAccount identity is the release's
    variant: str = request.param
    objects = render(VARIANTS[variant], kube_version=ENVTEST_KUBE_VERSION)
    with running_apiserver() as server:
        api = config.new_client_from_config(str(server.kubeconfig))
        install_crds(api, *CRD_FILES)
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
        for namespace in ("team-a", "team-b"):  # a watched namespace exists before the install
            create_namespace(api, namespace)
        dynamic = DynamicClient(api)  # discovery after the CRDs: every kind the chart renders, by its API version
        for item in objects:
            resource = dynamic.resources.get(api_version=item["apiVersion"], kind=item["kind"])
            namespace = item["metadata"].get("namespace", NAMESPACE) if resource.namespaced else None
            resource.create(body=item, namespace=namespace)
        yield server, api, objects, variant


def test_every_rendered_object_is_accepted(installed: Installed) -> None:
    _, api, objects, _ = installed
    apps, rbac = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    [deployment] = by_kind(objects, "Deployment")
    stored = apps.read_namespaced_deployment(deployment["metadata"]["name"], NAMESPACE)
    assert stored.spec.replicas == 2 and stored.spec.template.spec.service_account_name == OPERATOR_SERVICE_ACCOUNT
    [role] = by_kind(objects, "ClusterRole")
    assert rbac.read_cluster_role(role["metadata"]["name"]).rules
    pools = client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, "gpupools")["items"]
    assert sorted(p["metadata"]["name"] for p in pools) == sorted(p["name"] for p in VALUES["gpuPools"])
    [policy] = by_kind(objects, "NetworkPolicy")
    assert client.NetworkingV1Api(api).read_namespaced_network_policy(policy["metadata"]["name"], NAMESPACE)


def allowed(api: client.ApiClient, verb: str, resource: str, namespace: str | None, group: str = "") -> bool:
    """What RBAC grants the operator's ServiceAccount (a SubjectAccessReview, as `kubectl auth can-i --as`)."""
    attributes = {"verb": verb, "resource": resource, "group": group, **({"namespace": namespace} if namespace else {})}
    review = client.AuthorizationV1Api(api).create_subject_access_review(
        {"spec": {"user": OPERATOR_USER, "groups": ["system:serviceaccounts", "system:authenticated"],
                  "resourceAttributes": attributes}})  # fmt: skip
    return bool(review.status.allowed)


def test_rbac_grants_writes_only_where_the_operator_works(installed: Installed) -> None:
    _, api, _, variant = installed
    everywhere = variant == "all-namespaces"
    for verb, resource, group in (("create", "pods", ""), ("delete", "pods", ""), ("create", "configmaps", ""),
                                  ("create", "services", ""), ("create", "networkpolicies", "networking.k8s.io"),
                                  ("patch", "finetunejobs", GROUP), ("create", "events", "")):  # fmt: skip
        assert allowed(api, verb, resource, "team-a", group), (verb, resource)
        assert allowed(api, verb, resource, "team-b", group) is everywhere, (verb, resource)
    assert allowed(api, "watch", "gpupools", None, GROUP)  # the inventory is cluster-scoped: read everywhere
    assert not allowed(api, "create", "gpupools", None, GROUP)
    assert allowed(api, "patch", "clusterkopfpeerings", None, "kopf.dev") is everywhere
    assert allowed(api, "patch", "kopfpeerings", "team-a", "kopf.dev") is not everywhere


def test_the_operator_runs_as_installed(installed: Installed, tmp_path: Path) -> None:
    server, api, objects, variant = installed
    [deployment] = by_kind(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    arguments = container["args"]
    assert arguments[0] == "operator"
    flags = [a for a in arguments[1:] if not a.startswith(("--metrics-port", "--health-port"))]  # free ports here
    assert "--peering=memfit" in flags and not any(a.startswith("--standalone") for a in flags)
    assert ("--namespace=team-a" in flags) is (variant == "one-namespace")
    env = {e["name"]: e["value"] for e in container["env"]}
    operator = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", None, 9, *flags, env=env)
    try:
        job = example("llama-3.1-8b-lora.yaml")[0]
        job["metadata"]["namespace"] = "team-a"
        created = client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, "team-a",
                                                                               "finetunejobs", job)  # fmt: skip
        core = client.CoreV1Api(api)
        [pod] = wait_for("the job's pod", lambda: core.list_namespaced_pod("team-a").items, timeout=60)
        image = next(a for a in flags if a.startswith("--trainer-image=")).split("=", 1)[1]
        assert pod.spec.containers[0].image == image
        # The chart turns the per-attempt NetworkPolicy on, and lets its operator into the metrics ports.
        policy = client.NetworkingV1Api(api).read_namespaced_network_policy(f"{job['metadata']['name']}-a1", "team-a")
        assert policy.metadata.owner_references[0].uid == created["metadata"]["uid"]
        assert any(peer.pod_selector and peer.pod_selector.match_labels.get("app.kubernetes.io/component") == "operator"
                   for peer in policy.spec.ingress[1]._from)  # fmt: skip
        log = operator.log.read_text()
        assert "Forbidden" not in log and "Traceback" not in log, operator.tail()
    finally:
        operator.stop()
