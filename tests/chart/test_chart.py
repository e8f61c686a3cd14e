"""charts/memfit rendered with every meaningful values combination: lint clean, every object valid against
the Kubernetes schemas (built-in kinds) or its CRD (GPUPool, kopf peering), and the objects wired to each
other and to the operator's contract (command, probes, ports, RBAC, the trainer pods it creates)."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from memfit.api.gpupool import GPUPool
from memfit.api.loading import load_documents
from memfit.planner.search import plan_job
from memfit_operator import objects as operator_objects
from tests.chart.render import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    PROMETHEUS_OPERATOR,
    ROOT,
    by_kind,
    chart,
    chart_crds,
    notes,
    one,
    render,
)
from tests.k8s.cluster import operator_rules

EXAMPLE_POOLS = [
    {"name": doc["metadata"]["name"], "spec": doc["spec"]}
    for doc in yaml.safe_load_all((ROOT / "examples" / "inventory.yaml").read_text())
]
MONITORING_OFF = {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": False},
                  "prometheusRule": {"enabled": False}, "dashboards": {"enabled": False}}  # fmt: skip
VARIANTS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "defaults": ({}, ()),
    "prometheus-operator": ({}, (PROMETHEUS_OPERATOR,)),
    "one-namespace": ({"watchNamespace": "research"}, (PROMETHEUS_OPERATOR,)),
    "inventory": ({"gpuPools": EXAMPLE_POOLS}, ()),
    "minimal": ({"operator": {"replicas": 1}, "serviceAccount": {"create": False, "name": "memfit-sa"},
                 "rbac": {"create": False}, "monitoring": MONITORING_OFF, "networkPolicy": {"enabled": False}},
                (PROMETHEUS_OPERATOR,)),
    "customised": ({
        "operator": {"image": {"repository": "registry.example/memfit-operator", "tag": "1.2.3"},
                     "extraArgs": ["--verbose"], "nodeSelector": {"pool": "system"},
                     "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": "pool", "operator": "In", "values": ["system"]}]}]}}},
                     "podAnnotations": {"team": "ml-platform"}, "priorityClassName": "system-cluster-critical"},
        "trainer": {"image": {"repository": "registry.example/memfit-trainer", "tag": "1.2.3-cuda"}},
        "imagePullSecrets": [{"name": "registry"}],
        "peering": {"name": "memfit-prod"},
        "networkPolicy": {"prometheus": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
                          "apiServer": {"ports": [6443], "cidrs": ["10.0.0.1/32"]}},
        "monitoring": {"serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
                       "dashboards": {"namespace": "grafana", "annotations": {"grafana_folder": "memfit"},
                                      "labels": {"grafana_dashboard": "memfit"}}},
    }, (PROMETHEUS_OPERATOR,)),
}  # fmt: skip
EXPECTED_KINDS = {
    "defaults": {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                 "PodDisruptionBudget", "ClusterKopfPeering", "ConfigMap", "NetworkPolicy"},
    "prometheus-operator": {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                            "PodDisruptionBudget", "ClusterKopfPeering", "ConfigMap", "ServiceMonitor", "PodMonitor",
                            "PrometheusRule", "NetworkPolicy"},
    "one-namespace": {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment",
                      "Service", "PodDisruptionBudget", "KopfPeering", "ConfigMap", "ServiceMonitor", "PodMonitor",
                      "PrometheusRule", "NetworkPolicy"},
    "inventory": {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                  "PodDisruptionBudget", "ClusterKopfPeering", "ConfigMap", "GPUPool", "NetworkPolicy"},
    "minimal": {"Deployment", "Service", "ClusterKopfPeering"},
    "customised": {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                   "PodDisruptionBudget", "ClusterKopfPeering", "ConfigMap", "ServiceMonitor", "PodMonitor",
                   "PrometheusRule", "NetworkPolicy"},
}  # fmt: skip
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
"""No schema of these is available offline: the tests below check the fields memfit relies on."""
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def rendered(variant: str) -> list[dict[str, Any]]:
    values, api_versions = VARIANTS[variant]
    return render(values, api_versions=api_versions)


def crd_validator(group: str, kind: str) -> jsonschema.Draft4Validator:
    """The CRD's openAPIV3Schema as JSON Schema (OpenAPI 3.0 schemas are draft 4 with extensions)."""
    for crd in chart_crds():
        if (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind):
            return jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    raise AssertionError(f"the chart ships no CRD for {group} {kind}")


def validate_custom_resource(obj: dict[str, Any]) -> None:
    group = obj["apiVersion"].split("/")[0]
    errors = [e.message for e in crd_validator(group, obj["kind"]).iter_errors(obj)]
    assert not errors, f"{obj['kind']} {obj['metadata']['name']}: {errors}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.slow
def test_every_object_is_valid(variant: str) -> None:
    objects = rendered(variant)
    assert {o["kind"] for o in objects} == EXPECTED_KINDS[variant]
    for obj in objects:
        name = obj["metadata"]["name"]
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 63, f"bad name {name!r}"
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "memfit"
        if obj["apiVersion"].startswith(("memfit.dev/", "kopf.dev/")):
            validate_custom_resource(obj)
        elif obj["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)  # raises on any unknown or wrong field
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "two objects share kind, namespace and name"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_is_clean(variant: str) -> None:
    values, _ = VARIANTS[variant]
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=KUBE_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error; 1 is info
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"operator": {"replicas": "two"}}, "replicas"),
        ({"replicas": 2}, "replicas"),  # a misplaced key is refused, not ignored
        ({"gpuPools": [{"name": "l4", "spec": {"gpuProduct": "NVIDIA-L4", "nodes": 1, "cpuMemoryGiBPerNode": 60}}]},
         "gpusPerNode"),
        ({"watchNamespace": "Research_Team"}, "watchNamespace"),
        ({"alerts": {"gpuMemoryRatio": 1.5}}, "gpuMemoryRatio"),
        ({"monitoring": {"dashboards": {"labels": {"grafana_dashboard": 1}}}}, "grafana_dashboard"),  # a number
        ({"monitoring": {"podMonitor": {"interval": "often"}}}, "interval"),
        ({"networkPolicy": {"enabled": True, "prometheus": [{}]}}, "prometheus"),  # {} would be "from anywhere"
        ({"networkPolicy": {"enabled": True, "apiServer": {"ports": [70000]}}}, "ports"),
        ({"trainer": {"image": {"repository": "t"}, "cacheGiB": 0}}, "cacheGiB"),
    ],
)  # fmt: skip
def test_schema_refuses_bad_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=complaint):
        chart().validate_schema(values)
    with pytest.raises(helm_python.HelmError):
        render(values)


def test_schema_accepts_the_defaults_and_every_variant() -> None:
    for values, _ in VARIANTS.values():
        chart().validate_schema(values)


def test_schema_requires_what_the_gpupool_crd_requires() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    in_values = schema["properties"]["gpuPools"]["items"]["properties"]["spec"]["required"]
    crd = crd_validator("memfit.dev", "GPUPool").schema["properties"]["spec"]
    assert sorted(in_values) == sorted(crd["required"])


@pytest.mark.parametrize("watch", [None, "research"])
@pytest.mark.parametrize("network_policy", [True, False])
def test_roles_are_exactly_the_rules_the_operator_tests_run_under(watch: str | None, network_policy: bool) -> None:
    """tests/k8s grant what files/rbac-rules.yaml says (operator_rules); the chart renders the same roles."""
    objects = render({"watchNamespace": watch or "", "networkPolicy": {"enabled": network_policy}})
    expected = operator_rules(watch, network_policy)
    rendered_rules = {o["kind"]: o["rules"] for o in objects if o["kind"] in ("ClusterRole", "Role")}
    assert rendered_rules == expected
    if watch is not None:
        assert one(objects, "Role")["metadata"]["namespace"] == watch


def test_with_a_watched_namespace_writes_are_granted_in_that_namespace_only() -> None:
    """A ClusterRole grants in every namespace: with watchNamespace it keeps only cluster-scoped reads (the
    GPUPool inventory, CRD and namespace discovery), and a Role in that namespace grants the rest."""
    objects = render({"watchNamespace": "research"})
    cluster_rules = one(objects, "ClusterRole")["rules"]
    assert {r for rule in cluster_rules for r in rule["resources"]} == {"gpupools", "customresourcedefinitions",
                                                                         "namespaces"}  # fmt: skip
    assert {v for rule in cluster_rules for v in rule["verbs"]} == {"get", "list", "watch"}
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    assert (role["metadata"]["namespace"], binding["metadata"]["namespace"]) == ("research", "research")
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    for write in [
        ("pods", "create"),
        ("pods", "delete"),
        ("configmaps", "create"),
        ("services", "create"),
        ("networkpolicies", "create"),
        ("finetunejobs/status", "patch"),
        ("kopfpeerings", "patch"),
    ]:
        assert write in granted, write
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": one(objects, "ServiceAccount")["metadata"][
        "name"], "namespace": NAMESPACE}]  # fmt: skip
    everywhere = one(render(), "ClusterRole")["rules"]
    assert any("pods" in rule["resources"] for rule in everywhere)  # all namespaces: one ClusterRole
    assert not by_kind(render(), "Role")


def test_clusterrole_binding_and_service_account() -> None:
    objects = rendered("defaults")
    binding = one(objects, "ClusterRoleBinding")
    account = one(objects, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": one(objects, "ClusterRole")["metadata"]["name"]}  # fmt: skip
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]  # fmt: skip
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_without_rbac_the_named_service_account_is_used() -> None:
    pod = one(rendered("minimal"), "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "memfit-sa"


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (operator,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return operator


def test_deployment_runs_the_operator_command() -> None:
    objects = rendered("defaults")
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # Service links would put MEMFIT_METRICS_PORT=tcp://... (the memfit-metrics Service) in its environment.
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    operator = container(objects)
    assert operator["image"] == f"ghcr.io/memfit/memfit-operator:{chart().metadata['appVersion']}"
    assert operator["args"] == [
        "operator",
        "--peering=memfit",
        "--metrics-port=8080",
        "--health-port=8081",
        f"--trainer-image=ghcr.io/memfit/memfit-trainer:{chart().metadata['appVersion']}",
        f"--trainer-cpu-image=ghcr.io/memfit/memfit-trainer:{chart().metadata['appVersion']}-cpu",
    ]
    ports = {p["name"]: p["containerPort"] for p in operator["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert operator[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert operator["resources"]["requests"] and operator["resources"]["limits"]["memory"]
    env = {e["name"]: e["value"] for e in operator["env"]}
    assert env["MEMFIT_TRAINER_CACHE_GIB"] == "50" and env["MEMFIT_NETWORK_POLICY"] == "true"
    assert json.loads(env["MEMFIT_NETWORK_POLICY_METRICS_FROM"])  # see test_the_trainer_policies_*

    custom = container(rendered("customised"))
    assert custom["image"] == "registry.example/memfit-operator:1.2.3"
    assert "--trainer-image=registry.example/memfit-trainer:1.2.3-cuda" in custom["args"]
    assert "--peering=memfit-prod" in custom["args"] and custom["args"][-1] == "--verbose"
    assert container(rendered("one-namespace"))["args"][1] == "--namespace=research"


def test_operator_pods_meet_the_restricted_pod_security_standard() -> None:
    """The restricted profile's rules (pod-security-admission), checked field by field."""
    pod = one(rendered("defaults"), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER (tests/chart/test_dockerfile.py)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    assert all(set(volume) <= {"name", "emptyDir", "configMap", "secret", "projected"} for volume in pod["volumes"])
    for box in pod["containers"]:
        security = box["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
        assert security["readOnlyRootFilesystem"] is True
        assert not security.get("privileged")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_metrics_service_and_servicemonitor_reach_the_operator() -> None:
    objects = rendered("prometheus-operator")
    pod = one(objects, "Deployment")["spec"]["template"]
    service, monitor = one(objects, "Service"), one(objects, "ServiceMonitor")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert selects(one(objects, "Deployment")["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (port["name"], "/metrics")
    assert "prometheus.io/scrape" not in pod["metadata"]["annotations"]  # scraped through the ServiceMonitor
    budget = one(objects, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])


def test_without_the_prometheus_operator_scrape_annotations_and_a_rules_configmap() -> None:
    objects = rendered("defaults")
    assert not MONITORING_KINDS & {o["kind"] for o in objects}
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("8080", "/metrics")
    (rules,) = [c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-rules")]
    groups = yaml.safe_load(rules["data"]["memfit.rules.yaml"])["groups"]
    assert groups == one(rendered("prometheus-operator"), "PrometheusRule")["spec"]["groups"]


def a_trainer_pod() -> dict[str, Any]:
    """A trainer pod as the operator builds it (operator/memfit_operator/objects.py), for the 8B example."""
    documents = load_documents(ROOT / "examples" / "llama-3.1-8b-lora.yaml")
    pools = load_documents(ROOT / "examples" / "inventory.yaml").pools
    (job,) = documents.jobs
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "0000-1111"})})
    plan = plan_job(job.spec, pools).chosen
    assert plan is not None
    (pool,) = [p for p in pools if p.metadata.name == plan.strategy.pool]
    return operator_objects.trainer_pod(job, plan, pool, attempt=1, node_rank=0, image="trainer:test")


def test_podmonitor_selects_the_trainer_pods_metrics_ports() -> None:
    pod = a_trainer_pod()
    monitor = one(rendered("prometheus-operator"), "PodMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"any": True}  # jobs live in their teams' namespaces
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (keep,) = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    kept = {p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]
            if re.fullmatch(keep["regex"], p["name"])}  # fmt: skip
    ranks = int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert ranks > 1  # a multi-GPU node: every local rank's port is scraped, the rendezvous port is not
    assert kept == {operator_objects.METRICS_PORT + rank for rank in range(ranks)}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(operator_objects.METRICS_PORT)
    one_namespace = one(rendered("one-namespace"), "PodMonitor")
    assert one_namespace["spec"]["namespaceSelector"] == {"matchNames": ["research"]}


def test_peering_object_matches_the_operator_scope() -> None:
    cluster = one(rendered("defaults"), "ClusterKopfPeering")
    assert cluster["metadata"]["name"] == "memfit" and "namespace" not in cluster["metadata"]
    assert one(rendered("customised"), "ClusterKopfPeering")["metadata"]["name"] == "memfit-prod"
    namespaced = one(rendered("one-namespace"), "KopfPeering")
    # kopf keeps a namespaced peering in the namespace it serves, not the one it runs in
    assert (namespaced["metadata"]["name"], namespaced["metadata"]["namespace"]) == ("memfit", "research")
    scopes = {crd["spec"]["names"]["kind"]: crd["spec"]["scope"] for crd in chart_crds()}
    assert (scopes["ClusterKopfPeering"], scopes["KopfPeering"]) == ("Cluster", "Namespaced")


def test_gpu_pools_are_the_declared_inventory() -> None:
    pools = by_kind(rendered("inventory"), "GPUPool")
    assert [p["metadata"]["name"] for p in pools] == [p["name"] for p in EXAMPLE_POOLS]
    for pool, declared in zip(pools, EXAMPLE_POOLS, strict=True):
        assert pool["spec"] == declared["spec"]
        assert "namespace" not in pool["metadata"]  # cluster-scoped
        GPUPool.model_validate(pool)  # what the operator reads it with


def test_commented_pool_examples_are_valid_pools() -> None:
    """The examples in values.yaml's comments, uncommented, render to GPUPools the operator accepts."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    start = lines.index("gpuPools: []") + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        block.append(line[2:])
    pools = yaml.safe_load("\n".join(block))
    assert len(pools) >= 3
    for pool in by_kind(render({"gpuPools": pools}), "GPUPool"):
        validate_custom_resource(pool)
        GPUPool.model_validate(pool)


def test_dashboards_are_configmaps_for_the_grafana_sidecar() -> None:
    files = {p.name: p.read_text() for p in (CHART / "files" / "dashboards").glob("*.json")}
    maps = [c for c in by_kind(rendered("defaults"), "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
    assert sorted(name for m in maps for name in m["data"]) == sorted(files) and len(files) >= 2
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == NAMESPACE
        ((name, text),) = config_map["data"].items()
        assert json.loads(text) == json.loads(files[name])
    custom = [c for c in by_kind(rendered("customised"), "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
    assert {c["metadata"]["namespace"] for c in custom} == {"grafana"}
    assert all(c["metadata"]["labels"]["grafana_dashboard"] == "memfit" for c in custom)
    assert all(c["metadata"]["annotations"] == {"grafana_folder": "memfit"} for c in custom)


def test_pod_disruption_budget_only_with_a_standby() -> None:
    assert not by_kind(render({"operator": {"replicas": 1}}), "PodDisruptionBudget")
    assert one(rendered("defaults"), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_notes_say_what_to_do_next() -> None:
    text = notes()
    assert "rollout status deployment/memfit" in text and "kubectl get gpupools" in text
    assert "None is declared yet" in text  # no pools: how to declare them
    assert "memfit plan job.yaml" in text and "kubectl apply -f job.yaml" in text
    assert "ConfigMap memfit-rules" in text and "PrometheusRule memfit holds" not in text
    with_api = notes(api_versions=(PROMETHEUS_OPERATOR,))
    assert "PrometheusRule memfit holds" in with_api and "PodMonitor memfit-trainers" in with_api
    assert "None is declared yet" not in notes({"gpuPools": EXAMPLE_POOLS})
    assert "-n research" in notes({"watchNamespace": "research"})


def test_release_name_is_not_repeated() -> None:
    assert one(rendered("defaults"), "Deployment")["metadata"]["name"] == "memfit"  # not memfit-memfit
    assert one(render({}, api_versions=()), "Service")["metadata"]["name"] == "memfit-metrics"


# ------------------------------------------------------------------------------------------------
# NetworkPolicies
# ------------------------------------------------------------------------------------------------


def operator_policy(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "NetworkPolicy")["spec"]


def peers_selecting(peers: list[dict[str, Any]], namespace_labels: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether one of ``peers`` selects a pod with ``labels`` in a namespace with ``namespace_labels`` (peers
    without a namespaceSelector, i.e. of the policy's own namespace, do not occur here)."""
    for peer in peers:
        namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector")
        in_namespace = namespaces is not None and selects(namespaces.get("matchLabels", {}), namespace_labels)
        if in_namespace and (pods is None or selects(pods.get("matchLabels", {}), labels)):
            return True
    return False


def test_the_operator_pods_are_isolated_but_reach_what_they_need() -> None:
    objects = rendered("defaults")
    policy = one(objects, "NetworkPolicy")
    pod = one(objects, "Deployment")["spec"]["template"]
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod["metadata"]["labels"])
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    [scrape] = spec["ingress"]  # Prometheus on the metrics port, nothing else
    assert scrape["ports"] == [{"protocol": "TCP", "port": 8080}]
    prometheus_labels = {"app.kubernetes.io/name": "prometheus"}
    assert peers_selecting(scrape["from"], {"kubernetes.io/metadata.name": "monitoring"}, prometheus_labels)
    assert not peers_selecting(scrape["from"], {"kubernetes.io/metadata.name": "research"}, {"app": "curious"})
    api_server, dns, trainers = spec["egress"]
    assert api_server == {"ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert trainers["ports"] == [{"protocol": "TCP", "port": operator_objects.METRICS_PORT}]
    trainer = a_trainer_pod()
    assert peers_selecting(trainers["to"], {"kubernetes.io/metadata.name": "research"}, trainer["metadata"]["labels"])


def test_network_policy_values() -> None:
    custom = operator_policy(rendered("customised"))
    api_server = {"ports": [{"protocol": "TCP", "port": 6443}], "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]}
    assert custom["egress"][0] == api_server
    assert custom["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    closed = operator_policy(render({"networkPolicy": {"enabled": True, "prometheus": []}}))
    assert closed["ingress"] == []  # no scraper named: nobody gets in (an empty `from` would mean everybody)
    one_namespace = operator_policy(rendered("one-namespace"))
    assert one_namespace["egress"][2]["to"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "research"}}  # fmt: skip
    off = render({"networkPolicy": {"enabled": False}})
    assert not by_kind(off, "NetworkPolicy")
    assert "MEMFIT_NETWORK_POLICY" not in {e["name"] for e in container(off)["env"]}
    assert not any("networkpolicies" in rule["resources"] for rule in one(off, "ClusterRole")["rules"])


def test_the_trainer_policies_let_the_operator_and_prometheus_into_the_metrics_ports() -> None:
    """The operator creates a NetworkPolicy per attempt with the peers the chart gives it: the operator's own
    pods (by their namespace and labels) and Prometheus."""
    objects = rendered("defaults")
    env = {e["name"]: e["value"] for e in container(objects)["env"]}
    peers = json.loads(env["MEMFIT_NETWORK_POLICY_METRICS_FROM"])
    operator_pod = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    release_namespace = {"kubernetes.io/metadata.name": NAMESPACE}
    assert peers_selecting(peers, release_namespace, operator_pod)
    assert peers_selecting(
        peers, {"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"}
    )
    assert not peers_selecting(peers, {"kubernetes.io/metadata.name": "research"}, operator_pod)  # a lookalike
    documents = load_documents(ROOT / "examples" / "llama-3.1-8b-lora.yaml")
    (job,) = documents.jobs
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "0000-1111"})})
    plan = plan_job(job.spec, load_documents(ROOT / "examples" / "inventory.yaml").pools).chosen
    assert plan is not None
    options = operator_objects.TrainerOptions(network_policy=True, metrics_peers=tuple(peers))
    policy = operator_objects.network_policy(job, plan, 1, options)
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    assert policy["spec"]["ingress"][1]["from"] == peers
    # Before Kubernetes 1.21 namespaces have no kubernetes.io/metadata.name label: any namespace, by pod labels.
    old = render(kube_version="v1.20.2")
    old_peers = json.loads({e["name"]: e["value"] for e in container(old)["env"]}["MEMFIT_NETWORK_POLICY_METRICS_FROM"])
    assert old_peers[0]["namespaceSelector"] == {}
