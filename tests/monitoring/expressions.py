"""What the monitoring tests share: the dashboards and rules the chart ships, their PromQL, and the
Prometheus tools (Debian's prometheus package)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser
import pytest

from tests.chart.render import CHART, ROOT, rule_groups

DASHBOARDS = CHART / "files" / "dashboards"
INSTALL = "apt-get install prometheus (Debian's package: promtool and prometheus; `make tools` installs it)"
SET_OPERATORS = {"and", "or", "unless"}
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__range": "2m", "$__interval": "5s"}
"""Grafana's built-in variables as it would fill them for a short time range and a 1 s scrape interval."""


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH; install it with: {INSTALL}")
    return path


@cache
def generator() -> ModuleType:
    """charts/tools/dashboards.py (a script, not a package) loaded as a module."""
    spec = importlib.util.spec_from_file_location("memfit_dashboards", ROOT / "charts" / "tools" / "dashboards.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard / panel / refId, expr) of every target of every dashboard."""
    return [
        (f"{name} / {panel['title']} / {target['refId']}", target["expr"])
        for name, dashboard in dashboards().items()
        for panel in panels(dashboard)
        for target in panel["targets"]
    ]


def with_variables(expr: str, finetunejob: str) -> str:
    """The query Grafana sends for one job: its variables replaced."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr.replace("$finetunejob", finetunejob)


def rules() -> list[dict[str, Any]]:
    """Every rule of the chart's default rule groups."""
    return [rule for group in rule_groups() for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def signal(expr: str) -> str:
    """The measured quantity of an alert: its expression without the threshold comparison (and without the
    set operators that filter it). It returns data whenever the inputs exist, firing or not."""
    node = promql_parser.parse(expr)
    while isinstance(node, promql_parser.BinaryExpr) and str(node.op) in SET_OPERATORS:
        node = node.lhs
    if isinstance(node, promql_parser.BinaryExpr) and str(node.op) in COMPARISONS:
        node = node.lhs
    return str(node)


def metric_names(expr: str) -> set[str]:
    """memfit series and recording rules an expression reads."""
    return set(re.findall(r"\b(?:finetunejob[a-z_]*:)?memfit_[a-z_]+(?::[a-z_]+)?", expr))


def dump(data: Any, path: Path) -> Path:
    path.write_text(json.dumps(data, indent=2))  # JSON is YAML: promtool and prometheus read it
    return path
