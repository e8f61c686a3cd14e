"""Generate memfit's Grafana dashboards (charts/memfit/files/dashboards/*.json) from one description.

Written as code rather than JSON so that the two dashboards share their panel shapes, every panel gets a
gridPos that tiles the 24-column grid, and a query is written once. The chart ships the generated JSON
(Grafana's sidecar imports it from ConfigMaps); tests/monitoring fails when the JSON and this file differ,
and runs every query here against a real Prometheus.

    python charts/tools/dashboards.py           # rewrite the JSON files
    python charts/tools/dashboards.py --check   # exit 1 if they are out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent.parent / "memfit" / "files" / "dashboards"
SCHEMA_VERSION = 39
"""Grafana 10.4/11's dashboard schema; newer Grafana migrates it on load."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'finetunejob="$finetunejob"'
"""The per-job selector: the variable holds namespace/name, the label every memfit series carries."""


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    """One panel; ``width``/``height`` in grid units, placed left to right, wrapping at 24 columns."""

    title: str
    description: str
    queries: list[Query]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    options: dict[str, Any] = field(default_factory=dict)
    custom: dict[str, Any] = field(default_factory=dict)
    extra_defaults: dict[str, Any] = field(default_factory=dict)


def timeseries(title: str, description: str, *queries: Query, unit: str = "short", width: int = 12,
               stack: bool = False, **extra_defaults: Any) -> Panel:  # fmt: skip
    custom = {"fillOpacity": 10, "lineWidth": 1, "showPoints": "never", "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
        custom["fillOpacity"] = 40
    options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}  # fmt: skip
    return Panel(title, description, list(queries), unit=unit, width=width, options=options, custom=custom,
                 extra_defaults=extra_defaults)  # fmt: skip


def stat(title: str, description: str, query: Query, unit: str = "short", width: int = 4, text_mode: str = "auto",
         **extra: Any) -> Panel:  # fmt: skip
    query.instant = True
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "value", "graphMode": "none", "textMode": text_mode}  # fmt: skip
    return Panel(title, description, [query], kind="stat", unit=unit, width=width, height=4, options=options,
                 extra_defaults=extra)  # fmt: skip


def row(title: str) -> Panel:
    return Panel(title, "", [], kind="row", width=24, height=1)


def _targets(queries: list[Query]) -> list[dict[str, Any]]:
    targets = []
    for index, query in enumerate(queries):
        target: dict[str, Any] = {"datasource": DATASOURCE, "refId": chr(ord("A") + index), "expr": query.expr,
                                  "legendFormat": query.legend or "__auto", "range": not query.instant,
                                  "instant": query.instant}  # fmt: skip
        targets.append(target)
    return targets


def _layout(panels: list[Panel]) -> list[dict[str, Any]]:
    """Grafana panel JSON with ids and gridPos: left to right, a new line when 24 columns are full."""
    out, x, y, line_height = [], 0, 0, 0
    for panel_id, panel in enumerate(panels, start=1):
        if x + panel.width > 24 or panel.kind == "row":
            x, y, line_height = 0, y + line_height, 0
        grid = {"h": panel.height, "w": panel.width, "x": x, "y": y}
        if panel.kind == "row":
            out.append({"id": panel_id, "type": "row", "title": panel.title, "collapsed": False, "gridPos": grid,
                        "panels": []})  # fmt: skip
            y += panel.height
            continue
        out.append({
            "id": panel_id,
            "type": panel.kind,
            "title": panel.title,
            "description": panel.description,
            "datasource": DATASOURCE,
            "gridPos": grid,
            "fieldConfig": {"defaults": {"unit": panel.unit, "custom": panel.custom, **panel.extra_defaults},
                            "overrides": []},
            "options": panel.options,
            "targets": _targets(panel.queries),
        })  # fmt: skip
        x += panel.width
        line_height = max(line_height, panel.height)
    return out


def _datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}  # fmt: skip


def _job_variable() -> dict[str, Any]:
    query = "label_values(memfit_train_step, finetunejob)"
    return {"name": "finetunejob", "label": "FineTuneJob", "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2, "sort": 1, "current": {}, "hide": 0, "includeAll": False, "multi": False,
            "options": [], "regex": ""}  # fmt: skip


def dashboard(uid: str, title: str, description: str, panels: list[Panel], variables: list[dict[str, Any]]
              ) -> dict[str, Any]:  # fmt: skip
    """A dashboard model with a data source variable and a link to the other memfit dashboards (tag memfit)."""
    links = [
        {
            "title": "memfit",
            "type": "dashboards",
            "tags": ["memfit"],
            "asDropdown": False,
            "includeVars": False,
            "keepTime": True,
            "targetBlank": False,
            "icon": "external link",
            "tooltip": "",
            "url": "",
        }
    ]
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },  # fmt: skip
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": links,
        "panels": _layout(panels),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["memfit"],
        "templating": {"list": [_datasource_variable(), *variables]},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
    }


def fleet() -> dict[str, Any]:
    """Every job at once: what runs, on how many GPUs, how fast, and what the operator had to redo."""
    panels = [
        stat("Running jobs", "FineTuneJobs in phase Running.", Query('sum(memfit_operator_jobs{phase="Running"})')),
        stat("Pending jobs", "FineTuneJobs waiting for GPUs or a plan (Pending, Unschedulable).",
             Query('sum(memfit_operator_jobs{phase=~"Pending|Unschedulable"})')),
        stat("Failed jobs", "FineTuneJobs memfit gave up on.", Query('sum(memfit_operator_jobs{phase="Failed"})'),
             thresholds={"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                       {"color": "red", "value": 1}]}),
        stat("GPUs in use", "GPUs of the plans of jobs whose pods exist.", Query("sum(memfit_job_gpus)")),
        stat("Tokens/s", "Training tokens per second over every job and rank.",
             Query("sum(memfit_train_tokens_per_second)")),
        stat("OOM re-plans", "Out-of-memory re-plans in the selected time range.",
             Query("sum(increase(memfit_operator_oom_replans_total[$__range]))")),
        row("Jobs"),
        timeseries("Jobs by phase", "FineTuneJobs by status phase.",
                   Query("sum by (phase) (memfit_operator_jobs)", "{{phase}}"), stack=True),
        timeseries("GPUs in use by job", "GPUs of each running job's plan.",
                   Query("sum by (finetunejob) (memfit_job_gpus)", "{{finetunejob}}"), stack=True),
        timeseries("Tokens/s by job", "Training tokens per second of each job (all its ranks).",
                   Query("sum by (finetunejob) (memfit_train_tokens_per_second)", "{{finetunejob}}"), stack=True),
        timeseries("Progress by job", "Share of each job's optimizer steps done.",
                   Query("max by (finetunejob) (memfit_train_progress_ratio)", "{{finetunejob}}"),
                   unit="percentunit", min=0, max=1),
        row("Operator"),
        timeseries("OOM re-plans and gang restarts", "Re-plans after out-of-memory exits and gang restarts per hour.",
                   Query("sum(rate(memfit_operator_oom_replans_total[$__rate_interval])) * 3600", "OOM re-plans"),
                   Query("sum(rate(memfit_operator_restarts_total[$__rate_interval])) * 3600", "restarts"),
                   unit="short", width=8),
        timeseries("Plans by method", "Plans adopted per hour, by method and ZeRO stage.",
                   Query("sum by (method, zero_stage) (rate(memfit_operator_plans_total[$__rate_interval])) * 3600",
                         "{{method}} ZeRO-{{zero_stage}}"), width=8),
        timeseries("Reconcile time and errors", "95th percentile of one reconcile pass; handler errors per hour.",
                   Query("histogram_quantile(0.95, sum by (le) "
                         "(rate(memfit_operator_reconcile_duration_seconds_bucket[$__rate_interval])))", "p95 seconds"),
                   Query("sum by (handler) (rate(memfit_operator_handler_errors_total[$__rate_interval])) * 3600",
                         "errors/h {{handler}}"), width=8),
        timeseries("Repeated re-plans and restarts by job", "OOM re-plans and restarts of each job so far.",
                   Query("max by (finetunejob) (memfit_job_replans)", "{{finetunejob}} re-plans"),
                   Query("max by (finetunejob) (memfit_job_restarts)", "{{finetunejob}} restarts"), width=24),
    ]  # fmt: skip
    return dashboard("memfit-fleet", "memfit / Fleet", "All FineTuneJobs: phases, GPUs, throughput, re-plans.",
                     panels, [])  # fmt: skip


def job() -> dict[str, Any]:
    """One job: memory predicted against measured per rank, speed, loss (training and validation), step time,
    MFU, checkpoints."""
    panels = [
        stat("Phase", "The job's status phase (from the operator).",
             Query(f"max by (phase) (memfit_job_phase{{{JOB}}}) == 1", "{{phase}}"), text_mode="name"),
        stat("Progress", "Share of the run's optimizer steps done.",
             Query(f"max(memfit_train_progress_ratio{{{JOB}}})"), unit="percentunit"),
        stat("ETA", "Estimated time to the last step, checkpoints included.",
             Query(f"max(memfit_train_eta_seconds{{{JOB}}})"), unit="s"),
        stat("GPUs", "GPUs of the current plan.", Query(f"max(memfit_job_gpus{{{JOB}}})")),
        stat("OOM re-plans", "Out-of-memory re-plans so far.", Query(f"max(memfit_job_replans{{{JOB}}})")),
        stat("Restarts", "Gang restarts so far.", Query(f"max(memfit_job_restarts{{{JOB}}})")),
        row("Memory: predicted against measured"),
        timeseries("GPU memory per rank", "Measured peak and reserved GPU memory of each rank beside the plan's "
                   "prediction and the GPU's capacity. A measured peak above the prediction means the plan's "
                   "headroom is smaller than it says.",
                   Query(f"max by (rank) (memfit_gpu_memory_peak_allocated_bytes{{{JOB}}})", "rank {{rank}} peak"),
                   Query(f"max by (rank) (memfit_gpu_memory_reserved_bytes{{{JOB}}})", "rank {{rank}} reserved"),
                   Query(f"max(memfit_predicted_peak_allocated_bytes{{{JOB}}})", "predicted peak"),
                   Query(f"max(memfit_predicted_total_bytes{{{JOB}}})", "predicted total"),
                   Query(f"max(memfit_gpu_capacity_bytes{{{JOB}}})", "GPU capacity"), unit="bytes"),
        timeseries("Measured peak / predicted per rank", "Each rank's measured peak over the plan's predicted peak "
                   "(1 = exact; the alert fires above its abovePredictionRatio).",
                   Query(f"max by (rank) (memfit_gpu_memory_peak_allocated_bytes{{{JOB}}}) / on () group_left "
                         f"max(memfit_predicted_peak_allocated_bytes{{{JOB}}})", "rank {{rank}}"), unit="percentunit"),
        timeseries("Host memory per rank", "Resident set of each trainer process: CPU offload and the data "
                   "pipeline live here, not on the GPU.",
                   Query(f"max by (rank) (memfit_host_memory_bytes{{{JOB}}})", "rank {{rank}}"), unit="bytes",
                   width=24),
        row("Speed"),
        timeseries("Tokens/s", "Training tokens per second of the job (sum over ranks) and the plan's prediction.",
                   Query(f"sum(memfit_train_tokens_per_second{{{JOB}}})", "measured"),
                   Query(f"max(memfit_predicted_tokens_per_second{{{JOB}}})", "predicted")),
        timeseries("Tokens/s per rank", "A rank far below the others is a slow GPU, node or link.",
                   Query(f"max by (rank) (memfit_train_tokens_per_second{{{JOB}}})", "rank {{rank}}")),
        timeseries("Step time", "Wall time of one optimizer step: median and 95th percentile over the ranks.",
                   Query("histogram_quantile(0.5, sum by (le) "
                         f"(rate(memfit_train_step_duration_seconds_bucket{{{JOB}}}[$__rate_interval])))", "p50"),
                   Query("histogram_quantile(0.95, sum by (le) "
                         f"(rate(memfit_train_step_duration_seconds_bucket{{{JOB}}}[$__rate_interval])))", "p95"),
                   unit="s"),
        timeseries("MFU", "Estimated model FLOPs utilisation per rank (needs the GPU's peak FLOP/s in the plan).",
                   Query(f"max by (rank) (memfit_train_estimated_mfu_ratio{{{JOB}}})", "rank {{rank}}"),
                   unit="percentunit", min=0),
        row("Training"),
        timeseries("Loss", "Training loss of the last optimizer step.",
                   Query(f'max(memfit_train_loss{{{JOB}, rank="0"}})', "loss"), width=8),
        timeseries("Validation loss", "Mean loss over the held-out validation tokens (dataset.validation), "
                   "computed every validation.everySteps steps and at the end; no data without a validation set.",
                   Query(f'max(memfit_validation_loss{{{JOB}, rank="0"}})', "validation loss"), width=8),
        timeseries("Learning rate", "Learning rate of the last optimizer step.",
                   Query(f'max(memfit_train_learning_rate{{{JOB}, rank="0"}})', "learning rate"), width=8),
        row("Checkpoints"),
        stat("Last checkpoint step", "Step of the last checkpoint saved.",
             Query(f"max(memfit_checkpoint_last_step{{{JOB}}})"), width=8),
        stat("Since last checkpoint", "Time since the last checkpoint finished: work lost if the job fails now.",
             Query(f"time() - max(memfit_checkpoint_last_timestamp_seconds{{{JOB}}})"), unit="s", width=8),
        stat("Mean checkpoint time", "Mean wall time of one checkpoint save (slowest rank).",
             Query(f"max(memfit_checkpoint_duration_seconds_sum{{{JOB}}} "
                   f"/ memfit_checkpoint_duration_seconds_count{{{JOB}}})"), unit="s", width=8),
    ]  # fmt: skip
    return dashboard("memfit-job", "memfit / Job", "One FineTuneJob: memory predicted against measured per rank, "
                     "throughput, loss, step time, MFU, checkpoints.", panels, [_job_variable()])  # fmt: skip


DASHBOARDS = {"fleet.json": fleet, "job.json": job}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files differ from this generator")
    check = parser.parse_args(argv).check
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUTPUT / name, render(build)
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python charts/tools/dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
