"""`memfit operator` with no flags on a cluster where only crds/ was applied: kopf waits for its peering object
and would say nothing; the operator says which object, and how to get out, at start and while it waits, and
goes to work once the object exists."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from memfit.api.crd import CRD_FILES, PEERING_CRD_FILES
from tests.k8s.apiserver import ApiServer
from tests.k8s.cluster import (
    GROUP,
    ROOT,
    VERSION,
    create_namespace,
    example,
    grant_operator_role,
    install_crds,
    wait_for,
)
from tests.k8s.operator_process import OperatorProcess

pytestmark = pytest.mark.k8s
NOTICE = "Waiting for the kopf peering object ClusterKopfPeering 'memfit' (cluster-scoped)"
EVERY_SECOND = {"MEMFIT_PEERING_NOTICE_SECONDS": "1"}


@pytest.fixture(scope="module")
def api(server: ApiServer) -> client.ApiClient:
    api_client = config.new_client_from_config(str(server.kubeconfig))
    install_crds(api_client, *[ROOT / "crds" / name for name in CRD_FILES])  # memfit's own CRDs only, at first
    grant_operator_role(api_client)  # an operator of the whole cluster, as the chart's default install
    create_namespace(api_client, "team-a")
    for pool in example("inventory.yaml"):
        client.CustomObjectsApi(api_client).create_cluster_custom_object(GROUP, VERSION, "gpupools", pool)
    return api_client


def notices(operator: OperatorProcess) -> list[str]:
    return [line for line in operator.log.read_text().splitlines() if NOTICE in line]


def test_standalone_needs_no_peering_and_says_nothing_about_it(
    server: ApiServer, api: client.ApiClient, tmp_path: Path
) -> None:
    process = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", None, 9, "--standalone",
                              env=EVERY_SECOND)  # fmt: skip
    try:
        time.sleep(3)
        assert not notices(process)
    finally:
        process.stop()


@pytest.fixture
def operator(server: ApiServer, api: client.ApiClient, tmp_path: Path) -> Iterator[OperatorProcess]:
    """`memfit operator` with its defaults (no --standalone, no --peering), the notice every second."""
    process = OperatorProcess(server.operator_kubeconfig, tmp_path / "operator.log", None, 9, env=EVERY_SECOND)
    yield process
    process.stop()


def test_the_operator_says_what_it_waits_for_until_it_can_work(
    api: client.ApiClient, operator: OperatorProcess
) -> None:
    objects = client.CustomObjectsApi(api)

    def status(name: str) -> dict[str, Any]:
        job = objects.get_namespaced_custom_object(GROUP, VERSION, "team-a", "finetunejobs", name)
        return job.get("status") or {}

    # No peering CRD yet (crds/ of an older release): the notice says so, at once.
    [first] = wait_for("the first notice", lambda: notices(operator), timeout=30)
    assert "its CRD clusterkopfpeerings.kopf.dev is not installed" in first
    assert "memfit crd | kubectl apply -f -" in first and "--standalone" in first

    # crds/ as it is now: the peering CRDs are there, the object is not; the notice repeats while it waits.
    install_crds(api, *[ROOT / "crds" / name for name in PEERING_CRD_FILES])
    wait_for("a notice that the object does not exist",
             lambda: [n for n in notices(operator) if "it does not exist" in n], timeout=30)  # fmt: skip
    manifest = copy.deepcopy(example("llama-3.1-8b-lora.yaml")[0])
    manifest["metadata"].update(name="waiting", namespace="team-a")
    objects.create_namespaced_custom_object(GROUP, VERSION, "team-a", "finetunejobs", manifest)
    count = len(notices(operator))
    wait_for("the notice again", lambda: len(notices(operator)) >= count + 2, timeout=30)
    assert not status("waiting"), "kopf keeps the handlers paused: nothing is done meanwhile"
    assert "Traceback" not in operator.log.read_text()

    # The way out the notice gives: create the object. The operator resumes and handles the waiting job.
    objects.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "memfit"}})  # fmt: skip
    wait_for("the job launched", lambda: status("waiting").get("attempts"), timeout=60)
    resumed = "The kopf peering object ClusterKopfPeering 'memfit' exists: handlers resume."
    wait_for("the notice that it is over", lambda: resumed in operator.log.read_text(), timeout=10)
    settled = len(notices(operator))
    time.sleep(3)
    assert len(notices(operator)) == settled, "no notice once the object exists"
