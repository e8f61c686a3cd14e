"""Setting up the envtest API server the way a cluster with memfit installed looks, and playing the parts
that do not exist here: the kubelet (pod status), the controller-manager (default ServiceAccounts)."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client

from memfit.api.crd import ALL_CRD_FILES
from memfit.api.vocabulary import TIMESTAMP_FORMAT
from tests.k8s.apiserver import OPERATOR_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, ApiServer

ROOT = Path(__file__).parent.parent.parent
GROUP, VERSION = "memfit.dev", "v1alpha1"
RBAC_RULES = ROOT / "charts" / "memfit" / "files" / "rbac-rules.yaml"
T = TypeVar("T")


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "examples" / name).read_text()) if d]


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    every: float = 0.2,
    describe: Callable[[], str] = lambda: "",
) -> T:
    """Poll ``probe`` until it returns something truthy; past ``timeout`` seconds an AssertionError that says
    what was awaited and ``describe()`` (the state it was left in)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{describe()}".rstrip())
        time.sleep(every)


def install_crds(api: client.ApiClient, *paths: Path) -> None:
    """Every CRD in crds/ (memfit's and kopf's peering CRDs: `kubectl apply -f crds/`), or the CRD files
    given, waiting until they are served."""
    extensions = client.ApiextensionsV1Api(api)
    crds = [yaml.safe_load(path.read_text()) for path in paths or [ROOT / "crds" / name for name in ALL_CRD_FILES]]
    for crd in crds:
        extensions.create_custom_resource_definition(crd)
    for crd in crds:
        name = crd["metadata"]["name"]

        def established(name: str = name) -> bool:
            status = extensions.read_custom_resource_definition(name).status
            conditions = (status.conditions if status is not None else None) or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_for(f"CRD {name} established", established, timeout=60)
    time.sleep(1)  # discovery catches up


def create_namespace(api: client.ApiClient, name: str) -> None:
    """A namespace (`default` exists already) with its `default` ServiceAccount, as the controller-manager
    would make it."""
    # The client types each body as its model (V1Namespace, ...) but sends a plain dict just the same.
    core = client.CoreV1Api(api)
    if name != "default":
        core.create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})  # type: ignore[arg-type]


def operator_rules(watch_namespace: str | None, network_policy: bool = True) -> dict[str, list[dict[str, Any]]]:
    """The rules the chart grants (templates/rbac.yaml, from files/rbac-rules.yaml): "ClusterRole", and with
    a watched namespace "Role" (in that namespace). tests/chart checks the rendered chart says the same."""
    groups = yaml.safe_load(RBAC_RULES.read_text())
    local = groups["namespaced"] + (groups["networkPolicies"] if network_policy else [])
    if watch_namespace is None:
        return {"ClusterRole": groups["cluster"] + groups["clusterPeering"] + local}
    return {"ClusterRole": groups["cluster"], "Role": local + groups["namespacedPeering"]}


def grant_operator_role(api: client.ApiClient, *watched: str) -> None:
    """The operator's ServiceAccount bound to the roles the chart ships, and nothing else: the ClusterRole of
    an operator of every namespace, or with ``watched`` namespaces (each must exist) the ClusterRole of an
    operator restricted to one and its Role in each of them (a test runs several such operators)."""
    # The client types each body as its model (V1Namespace, ...) but sends a plain dict just the same.
    rbac, core = client.RbacAuthorizationV1Api(api), client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})  # type: ignore[arg-type]
    account = {"metadata": {"name": OPERATOR_SERVICE_ACCOUNT}}
    core.create_namespaced_service_account(OPERATOR_NAMESPACE, account)  # type: ignore[arg-type]
    subjects = [{"kind": "ServiceAccount", "name": OPERATOR_SERVICE_ACCOUNT, "namespace": OPERATOR_NAMESPACE}]
    rules = operator_rules(watched[0] if watched else None)
    rbac.create_cluster_role({"metadata": {"name": "memfit-operator"}, "rules": rules["ClusterRole"]})  # type: ignore[arg-type]
    rbac.create_cluster_role_binding({  # type: ignore[arg-type]
        "metadata": {"name": "memfit-operator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "memfit-operator"},
        "subjects": subjects,
    })  # fmt: skip
    for namespace in watched:
        grant_namespace_role(api, namespace)


def grant_namespace_role(api: client.ApiClient, namespace: str) -> None:
    """The Role the chart ships for a watched namespace, in ``namespace``, bound to the operator."""
    rbac = client.RbacAuthorizationV1Api(api)
    metadata = {"name": "memfit-operator", "namespace": namespace}
    rbac.create_namespaced_role(namespace, {"metadata": metadata, "rules": operator_rules(namespace)["Role"]})  # type: ignore[arg-type]
    rbac.create_namespaced_role_binding(namespace, {  # type: ignore[arg-type]
        "metadata": metadata,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "memfit-operator"},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SERVICE_ACCOUNT, "namespace": OPERATOR_NAMESPACE}],
    })  # fmt: skip


def server_get(server: ApiServer, path: str, accept: str = "application/json") -> bytes:
    """GET ``path`` from the API server as the admin."""
    request = urllib.request.Request(
        f"{server.url}{path}", headers={"Authorization": f"Bearer {server.token}", "Accept": accept}
    )
    with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(server.ca_file))) as response:
        body: bytes = response.read()
        return body


def server_table(server: ApiServer, path: str) -> dict[str, Any]:
    """What `kubectl get` prints: the server-side Table of ``path``."""
    table: dict[str, Any] = json.loads(server_get(server, path, accept="application/json;as=Table;v=v1;g=meta.k8s.io"))
    return table


def _now() -> str:
    return datetime.now(UTC).strftime(TIMESTAMP_FORMAT)


class Kubelet:
    """Writes pod status through the status subresource, as a kubelet (or kwok) would."""

    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)

    def _status(self, namespace: str, name: str, phase: str, state: dict[str, Any], ready: bool) -> None:
        pod = self.core.read_namespaced_pod(name, namespace)
        assert pod.spec is not None
        container = pod.spec.containers[0]
        status = {
            "phase": phase,
            "podIP": "127.0.0.1",
            "startTime": _now(),
            "containerStatuses": [{
                "name": container.name, "image": container.image, "imageID": "", "ready": ready,
                "restartCount": 0, "state": state,
            }],
        }  # fmt: skip
        self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    def run(self, namespace: str, name: str) -> None:
        self._status(namespace, name, "Running", {"running": {"startedAt": _now()}}, ready=True)

    def terminate(
        self, namespace: str, name: str, exit_code: int, reason: str = "Error", message: str | None = None
    ) -> None:
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}
        if message is not None:
            terminated["message"] = message
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self._status(namespace, name, phase, {"terminated": terminated}, ready=False)
