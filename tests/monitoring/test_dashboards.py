"""The Grafana dashboards: generated from charts/tools/dashboards.py without drift, and valid Grafana
dashboard models (what Grafana's importer and the sidecar need), every query valid PromQL."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import promql_parser
import pytest

from tests.monitoring.expressions import dashboards, generator, panels, with_variables

PANEL_TYPES = {"timeseries", "stat", "table", "row"}
UNITS = {"short", "bytes", "s", "percentunit"}


def test_generated_json_is_up_to_date() -> None:
    module = generator()
    assert module.main(["--check"]) == 0, "run: python charts/tools/dashboards.py"
    assert set(dashboards()) == set(module.DASHBOARDS)


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_is_a_grafana_dashboard_model(name: str) -> None:
    dashboard = dashboards()[name]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"].startswith("memfit-") and len(dashboard["uid"]) <= 40
    assert dashboard["title"].startswith("memfit / ") and "memfit" in dashboard["tags"]
    assert dashboard["id"] is None  # Grafana assigns it; a fixed id collides on import
    assert {"from", "to"} <= set(dashboard["time"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES and panel["title"]
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["description"], f"{panel['title']}: say what the panel shows"
        assert panel["fieldConfig"]["defaults"]["unit"] in UNITS
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"]


def overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ga, gb = a["gridPos"], b["gridPos"]
    return (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
            and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"])  # fmt: skip


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_panels_do_not_overlap(name: str) -> None:
    for a, b in combinations(dashboards()[name]["panels"], 2):
        assert not overlap(a, b), f"{a['title']!r} overlaps {b['title']!r}"


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_every_query_is_valid_promql(name: str) -> None:
    for panel in panels(dashboards()[name]):
        for target in panel["targets"]:
            promql_parser.parse(with_variables(target["expr"], "default/tiny"))  # raises on a syntax error


def test_job_dashboard_has_the_job_variable_in_every_query() -> None:
    job = dashboards()["job.json"]
    (variable,) = [v for v in job["templating"]["list"] if v["name"] == "finetunejob"]
    assert variable["type"] == "query" and variable["query"]["query"].startswith("label_values(")
    assert variable["definition"] == variable["query"]["query"] and not variable["multi"]
    for panel in panels(job):
        for target in panel["targets"]:
            assert 'finetunejob="$finetunejob"' in target["expr"], panel["title"]


def test_job_dashboard_covers_what_the_issue_asks() -> None:
    text = " ".join(t["expr"] for p in panels(dashboards()["job.json"]) for t in p["targets"])
    for series in ("memfit_predicted_peak_allocated_bytes", "memfit_gpu_memory_peak_allocated_bytes",
                   "memfit_train_tokens_per_second", "memfit_train_loss", "memfit_train_step_duration_seconds",
                   "memfit_train_estimated_mfu_ratio", "memfit_checkpoint_last_step"):  # fmt: skip
        assert series in text
    fleet = " ".join(t["expr"] for p in panels(dashboards()["fleet.json"]) for t in p["targets"])
    for series in ("memfit_operator_jobs", "memfit_job_gpus", "memfit_train_tokens_per_second",
                   "memfit_operator_oom_replans_total"):  # fmt: skip
        assert series in fleet


def test_job_dashboard_shows_the_validation_loss_beside_the_training_loss() -> None:
    by_title = {p["title"]: p for p in panels(dashboards()["job.json"])}
    training, validation = by_title["Loss"], by_title["Validation loss"]
    assert validation["gridPos"]["y"] == training["gridPos"]["y"]  # the same line of the grid
    assert validation["gridPos"]["x"] == training["gridPos"]["x"] + training["gridPos"]["w"]
    assert [t["expr"] for t in validation["targets"]] == [
        'max(memfit_validation_loss{finetunejob="$finetunejob", rank="0"})'
    ]
