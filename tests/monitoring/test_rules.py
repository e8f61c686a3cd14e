"""The chart's Prometheus rules: `promtool check rules` finds nothing, `promtool test rules` runs a unit
case for every alert (alert_cases.py), and each alert tells its reader what happened and what to do."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.chart.render import rule_groups
from tests.monitoring.alert_cases import CASES, Case
from tests.monitoring.expressions import alerts, dump, tool

SEVERITIES = {"warning", "critical"}


def rules_file(tmp_path: Path, values: dict[str, Any] | None = None) -> Path:
    return dump({"groups": rule_groups(values)}, tmp_path / "memfit.rules.yaml")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "values",
    [None, {"alerts": {"gpuMemoryRatio": 0.9, "abovePredictionRatio": 2, "throughputDropRatio": 0.25,
                       "throughputWindow": "1h", "oomReplans": 5, "noProgressMinutes": 45}}],
    ids=["defaults", "custom-thresholds"],
)  # fmt: skip
def test_promtool_check_rules(tmp_path: Path, values: dict[str, Any] | None) -> None:
    checked = promtool("check", "rules", "--lint=all", "--lint-fatal", str(rules_file(tmp_path, values)))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_thresholds_come_from_values() -> None:
    values = {"alerts": {"gpuMemoryRatio": 0.9, "oomReplans": 5, "noProgressMinutes": 45, "throughputWindow": "1h"}}
    custom = {
        rule["alert"]: rule["expr"] for group in rule_groups(values) for rule in group["rules"] if "alert" in rule
    }
    assert custom["MemfitGPUMemoryNearCapacity"].rstrip().endswith("> 0.9")
    assert custom["MemfitRepeatedOOMReplans"].rstrip().endswith(">= 5")
    assert "[45m]" in custom["MemfitNoProgress"] and "[1h]" in custom["MemfitThroughputCollapsed"]


def promtool_test(case: Case, rules: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rule = rules[case.alert]
    return {
        "interval": "1m",
        "input_series": [{"series": series, "values": values} for series, values in case.series.items()],
        "alert_rule_test": [
            {
                "eval_time": expect.at,
                "alertname": case.alert,
                "exp_alerts": [
                    {
                        "exp_labels": {**labels, "severity": rule["labels"]["severity"]},
                        "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]},
                    }
                    for labels, summary in expect.firing
                ],  # fmt: skip
            }
            for expect in case.expect
        ],
    }


def test_every_alert_has_unit_cases() -> None:
    tested = {
        case.alert for case in CASES if any(e.firing for e in case.expect) and any(not e.firing for e in case.expect)
    }
    assert tested == set(alerts()), "each alert needs a case where it fires and one where it does not"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.alert)
@pytest.mark.slow
def test_promtool_test_rules(tmp_path: Path, case: Case) -> None:
    rules_file(tmp_path)
    tests = {"rule_files": ["memfit.rules.yaml"], "evaluation_interval": "1m", "tests": [promtool_test(case, alerts())]}
    test_file = dump(tests, tmp_path / "test.yaml")
    result = promtool("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(alerts()))
def test_alert_tells_what_to_do(name: str) -> None:
    rule = alerts()[name]
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule["for"] and rule["for"] != "0s"
    summary, description = rule["annotations"]["summary"], rule["annotations"]["description"]
    assert "$labels.finetunejob" in summary and len(summary) < 120
    assert len(description) > 150 and "{{" not in description  # a paragraph, every Helm value filled in
    assert any(verb in description for verb in ("kubectl", "lower", "set", "look", "Look", "report", "Fix"))
