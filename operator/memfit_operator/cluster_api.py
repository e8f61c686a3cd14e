"""Typed calls to the API server, each idempotent: creating what exists and deleting what is gone are
no-ops, so a reconcile pass can always be repeated. Synchronous (the official client); the handlers run
them in worker threads."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from memfit.api.base import API_VERSION

GROUP, VERSION = API_VERSION.split("/")
JOBS = "finetunejobs"
KOPF_GROUP, KOPF_VERSION = "kopf.dev", "v1"
CLUSTER_PEERINGS, PEERINGS = "clusterkopfpeerings", "kopfpeerings"


class Peering(Enum):
    """Whether the peering object kopf waits for exists."""

    FOUND = "found"
    NO_OBJECT = "no object"
    """Its CRD is served, the object is not there."""
    NO_CRD = "no CRD"
    """Its CRD is not installed."""


def load_credentials() -> client.ApiClient:
    """In-cluster credentials in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    # KUBECONFIG is read now, not at import. (kubernetes.config's loaders are unannotated, unlike the generated
    # client: hence the ignores.)
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
    return client.ApiClient()


class ClusterApi:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.networking = client.NetworkingV1Api(api)

    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch ``status`` (keys set to None are removed) through the status subresource."""
        patched = self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, JOBS, name, {"status": dict(status)}
        )
        return cast(dict[str, Any], patched)  # the client types a custom object as object: it is the JSON dict

    def create(self, manifest: Mapping[str, Any]) -> bool:
        """Create a Pod, ConfigMap, Service or NetworkPolicy; False when it already exists."""
        namespace = manifest["metadata"]["namespace"]
        # The client types each body as its model (V1Pod, ...) but serializes a plain dict the same way.
        creators: dict[str, Callable[[str, Any], object]] = {
            "Pod": self.core.create_namespaced_pod,
            "ConfigMap": self.core.create_namespaced_config_map,
            "Service": self.core.create_namespaced_service,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }
        try:
            creators[manifest["kind"]](namespace, dict(manifest))
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ConfigMap's name and data; None when there is none of that name."""
        try:
            found = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return {"metadata": {"name": name, "namespace": namespace}, "data": dict(found.data or {})}

    def delete_pod(self, namespace: str, name: str) -> bool:
        """False when the pod was already gone."""
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def peering(self, namespace: str | None, name: str) -> Peering:
        """Whether kopf's peering object exists: a KopfPeering in ``namespace``, or with None the
        ClusterKopfPeering."""
        try:
            if namespace is None:
                self.custom.get_cluster_custom_object(KOPF_GROUP, KOPF_VERSION, CLUSTER_PEERINGS, name)
            else:
                self.custom.get_namespaced_custom_object(KOPF_GROUP, KOPF_VERSION, namespace, PEERINGS, name)
        except ApiException as error:
            if error.status != 404:
                raise
            # A missing object is a NotFound Status that names it; a resource the server does not serve is not.
            try:
                details = json.loads(error.body or "{}").get("details") or {}
            except (ValueError, AttributeError):
                details = {}
            return Peering.NO_OBJECT if details.get("name") == name else Peering.NO_CRD
        return Peering.FOUND
