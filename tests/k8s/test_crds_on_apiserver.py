"""The generated CRDs on a real kube-apiserver: they register, the examples are accepted with their
defaults applied, bad objects are refused by the schema, a status the planner writes survives pruning,
and `kubectl get` (the server-side table) shows the printer columns."""

from __future__ import annotations

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from memfit.api.loading import load_documents
from memfit.planner.search import plan_job
from memfit_operator.status import memory_per_gpu, progress_display
from tests.k8s.apiserver import ApiServer
from tests.k8s.cluster import GROUP, ROOT, VERSION, example, install_crds, server_table

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def api(server: ApiServer) -> client.ApiClient:
    api_client = config.new_client_from_config(str(server.kubeconfig))
    install_crds(api_client)
    client.CoreV1Api(api_client).create_namespace({"metadata": {"name": "research"}})
    return api_client


def test_examples_are_accepted_with_defaults(api: client.ApiClient) -> None:
    objects = client.CustomObjectsApi(api)
    for pool in example("inventory.yaml"):
        objects.create_cluster_custom_object(GROUP, VERSION, "gpupools", pool)
    job = example("llama-3.1-8b-lora.yaml")[0]
    created = objects.create_namespaced_custom_object(GROUP, VERSION, "research", "finetunejobs", job)
    spec = created["spec"]
    assert spec["maxRestarts"] == 3 and spec["suspend"] is False  # defaults from the models, applied by the server
    assert spec["training"]["warmupRatio"] == 0.03 and spec["training"]["globalBatchSize"] == 64
    assert created["metadata"]["generation"] == 1


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda s: s["training"].update(sequenceLength="long"), "spec.training.sequenceLength"),
        (lambda s: s.update(method="dora"), "spec.method"),
        (lambda s: s["resources"].update(maxGPUs=0), "spec.resources.maxGPUs"),
        (lambda s: s.pop("output"), "spec.output"),
    ],
)
def test_the_schema_refuses_bad_objects(api: client.ApiClient, change, field: str) -> None:  # type: ignore[no-untyped-def]
    job = example("llama-3.1-8b-lora.yaml")[0]
    job["metadata"]["name"] = "bad"
    change(job["spec"])
    with pytest.raises(ApiException) as refused:
        client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, "research", "finetunejobs", job)
    assert refused.value.status == 422 and field in refused.value.body


def test_planner_status_survives_pruning_and_shows_in_kubectl_get(api: client.ApiClient, server: ApiServer) -> None:
    objects = client.CustomObjectsApi(api)
    job = example("llama-3.1-8b-lora.yaml")[0]
    job["metadata"]["name"] = "with-status"
    objects.create_namespaced_custom_object(GROUP, VERSION, "research", "finetunejobs", job)
    documents = load_documents(ROOT / "examples" / "llama-3.1-8b-lora.yaml", ROOT / "examples" / "inventory.yaml")
    plan = plan_job(documents.jobs[0].spec, documents.pools).chosen
    assert plan is not None
    status = {
        "phase": "Running",
        "observedGeneration": 1,
        "plan": plan.to_api(),
        "gpus": plan.strategy.gpus,
        "memoryPerGPU": memory_per_gpu(plan),
        "progressDisplay": progress_display(42, 100),
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Running",
                "message": "8 ranks running",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "observedGeneration": 1,
            }
        ],  # fmt: skip
    }
    written = objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, "research", "finetunejobs", "with-status", {"status": status}
    )
    assert written["status"]["plan"] == plan.to_api()  # nothing pruned: the schema holds every field
    table = server_table(server, f"/apis/{GROUP}/{VERSION}/namespaces/research/finetunejobs/with-status")
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:8] == ["Name", "Status", "Method", "ZeRO", "GPUs", "Mem/GPU", "Progress", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[1:7] == ["Running", plan.strategy.method, plan.strategy.zero_stage, plan.strategy.gpus,
                          memory_per_gpu(plan), "42% 42/100"]  # fmt: skip
