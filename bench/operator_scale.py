"""500 FineTuneJobs on a real kube-apiserver: how long until every one is planned and has its pods, against a
plain client creating the same objects itself, in the same run; and API requests per job.

    KUBEBUILDER_ASSETS=... python bench/operator_scale.py [--jobs 500]

Both sides talk to the same API server (envtest: kube-apiserver + etcd on loopback). The direct side
creates, per job, the FineTuneJob and exactly the objects the operator would (ConfigMap, Service, pods,
built by the same pure builders), one request at a time. The operator side creates the FineTuneJobs and
waits for `memfit operator` (its own process, the shipped ClusterRole) to plan and launch them all.
Requests are counted from the API server's own apiserver_request_total, minus the bench's requests.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the envtest harness lives with the tests

from memfit.api.finetunejob import FineTuneJob  # noqa: E402
from memfit.api.gpupool import pool_capacity  # noqa: E402
from memfit.api.loading import load_documents  # noqa: E402
from memfit.planner.search import plan_job  # noqa: E402
from memfit.planner.throughput import peak_flops  # noqa: E402
from memfit.render.trainer_config import render_trainer_config  # noqa: E402
from memfit_operator.objects import JOB_LABEL, attempt_objects  # noqa: E402
from tests.k8s.apiserver import ApiServer, running_apiserver  # noqa: E402
from tests.k8s.cluster import (  # noqa: E402
    GROUP,
    VERSION,
    create_namespace,
    example,
    grant_operator_role,
    install_crds,
    server_get,
)
from tests.k8s.operator_process import OperatorProcess  # noqa: E402

IMAGE = "registry.example/memfit-trainer:bench"


def manifest(name: str, namespace: str) -> dict[str, Any]:
    job = copy.deepcopy(example("llama-3.1-8b-lora.yaml")[0])
    job["metadata"].update(name=name, namespace=namespace)
    return job


def request_count(server: ApiServer) -> float:
    """All requests the API server has served (apiserver_request_total, every verb and resource)."""
    text = server_get(server, "/metrics", accept="text/plain").decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "apiserver_request"
        for sample in family.samples
        if sample.name == "apiserver_request_total"
    )


def direct(api: client.ApiClient, namespace: str, jobs: int) -> tuple[float, int]:
    """A plain client creating every job and its children itself; (seconds, requests made)."""
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    pools = load_documents(ROOT / "examples" / "inventory.yaml").pools
    # The client types each body as its model (V1Pod, ...) but sends a plain dict just the same.
    creators: dict[str, Callable[[str, Any], object]] = {
        "ConfigMap": core.create_namespaced_config_map, "Service": core.create_namespaced_service,
        "Pod": core.create_namespaced_pod,
    }  # fmt: skip
    requests = 0
    started = time.perf_counter()
    for index in range(jobs):
        created = objects.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "finetunejobs", manifest(f"direct-{index}", namespace)
        )
        job = FineTuneJob.model_validate(created)
        plan = plan_job(job.spec, pools).chosen
        assert plan is not None
        pool = next(p for p in pools if p.metadata.name == plan.strategy.pool)
        config_ = render_trainer_config(job, plan, peak_flops(pool_capacity(pool), plan.strategy.precision))
        for item in attempt_objects(job, plan, pool, config_, 1, IMAGE):
            creators[item["kind"]](namespace, item)
            requests += 1
        requests += 1
    return time.perf_counter() - started, requests


def through_operator(api: client.ApiClient, namespace: str, jobs: int, deadline: float) -> tuple[float, int]:
    """Create the FineTuneJobs, wait until each has a plan and its pods; (seconds, the bench's requests)."""
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    requests = 0
    started = time.perf_counter()
    for index in range(jobs):
        objects.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "finetunejobs", manifest(f"operated-{index}", namespace)
        )
        requests += 1
    last_report = 0.0
    while True:
        # The client types a custom object list as object: it is the JSON dict.
        found = cast(dict[str, Any], objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "finetunejobs"))
        listed = found["items"]
        planned = sum(1 for job in listed if (job.get("status") or {}).get("plan"))
        pods = core.list_namespaced_pod(namespace, label_selector=JOB_LABEL).items
        requests += 2
        with_pods = len({p.metadata.labels[JOB_LABEL] for p in pods if p.metadata and p.metadata.labels})
        if planned == jobs and with_pods == jobs:
            return time.perf_counter() - started, requests
        if time.perf_counter() - last_report > 5:
            print(f"  {time.perf_counter() - started:5.1f} s: {planned}/{jobs} planned, {with_pods}/{jobs} with pods",
                  file=sys.stderr)  # fmt: skip
            if time.perf_counter() - started > deadline:
                raise TimeoutError(f"not all jobs launched within {deadline} s")
            last_report = time.perf_counter()
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    args = parser.parse_args()
    with running_apiserver() as server, tempfile.TemporaryDirectory() as scratch:
        api = config.new_client_from_config(str(server.kubeconfig))  # type: ignore[no-untyped-call]  # unannotated
        install_crds(api)
        grant_operator_role(api)
        for pool in example("inventory.yaml"):
            client.CustomObjectsApi(api).create_cluster_custom_object(GROUP, VERSION, "gpupools", pool)
        for namespace in ("bench-direct", "bench-operator"):
            create_namespace(api, namespace)

        print(f"direct: creating {args.jobs} jobs and their children with a plain client ...", file=sys.stderr)
        direct_seconds, direct_requests = direct(api, "bench-direct", args.jobs)

        log = Path(scratch) / "operator.log"
        operator = OperatorProcess(server.operator_kubeconfig, log, "bench-operator", 9, "--standalone")
        try:
            before = request_count(server)
            print(f"operator: {args.jobs} FineTuneJobs through `memfit operator` ...", file=sys.stderr)
            operator_seconds, own_requests = through_operator(api, "bench-operator", args.jobs, 60 + args.jobs)
            time.sleep(2)  # let in-flight passes land before counting
            operator_requests = request_count(server) - before - own_requests - 2
        except TimeoutError:
            print(operator.tail(), file=sys.stderr)
            raise
        finally:
            operator.stop()

    print(f"jobs: {args.jobs}")
    print(f"direct client (plan + create every object itself): {direct_seconds:7.1f} s")
    print(f"through the operator (apply jobs, wait for plan + pods): {operator_seconds:7.1f} s")
    print(f"ratio operator/direct: {operator_seconds / direct_seconds:.2f}")
    print(f"API requests per job: operator {operator_requests / args.jobs:.1f} (watches, status writes, creates, "
          f"events), direct client {direct_requests / args.jobs:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
