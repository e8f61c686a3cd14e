"""Render charts/memfit the way `helm install` would, with Helm's own Go code as a library (helm-python-sdk).

``render`` returns the manifests as parsed objects. ``api_versions`` plays the cluster's discovery: Helm's
offline default has no monitoring.coreos.com/v1, so the Prometheus Operator objects appear only when a test
names that API, exactly as `.Capabilities.APIVersions.Has` sees it on a real cluster.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "memfit"
RELEASE, NAMESPACE = "memfit", "memfit-system"
KUBE_VERSION = "v1.31.0"
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"


@functools.cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_files(
    values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = (), kube_version: str = KUBE_VERSION
) -> dict[str, str]:
    """Template path -> rendered text. Chart.render() does not expose the capabilities, so the call goes to
    the library's render entry point with the same options `helm template --api-versions --kube-version` set."""
    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True, "kube_version": kube_version,
               "api_versions": list(api_versions)}  # fmt: skip
    payload = _native.call_string("helm_render", chart()._raw(), json.dumps(values or {}), json.dumps(options))
    rendered: dict[str, str] = json.loads(payload)
    return rendered


def render(
    values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = (), kube_version: str = KUBE_VERSION
) -> list[dict[str, Any]]:
    """Every object the templates produce (NOTES.txt excluded); CRDs are in :func:`chart_crds`."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(render_files(values, api_versions=api_versions, kube_version=kube_version).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def notes(values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = ()) -> str:
    return render_files(values, api_versions=api_versions)[f"{CHART.name}/templates/NOTES.txt"]


def chart_crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(crd["data"]) for crd in chart().crds]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Prometheus rule groups the chart ships (from the PrometheusRule; the rules ConfigMap holds the
    same groups, which test_chart checks)."""
    rule = one(render(values, api_versions=(PROMETHEUS_OPERATOR,)), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups
