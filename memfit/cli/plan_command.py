"""``memfit plan``: load the job and the inventory, plan, print, optionally write the DeepSpeed config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from memfit.api.finetunejob import FineTuneJob
from memfit.api.loading import InputError, load_documents
from memfit.cli.exit_codes import ExitCode
from memfit.cli.plan_table import print_plan_table
from memfit.planner.search import PlanningError, plan_job
from memfit.render.deepspeed import deepspeed_config


def _select_job(jobs: list[FineTuneJob], name: str | None, source: Path) -> FineTuneJob:
    if name is not None:
        matching = [job for job in jobs if job.metadata.name == name]
        if not matching:
            raise InputError(
                f"{source}: no FineTuneJob named {name!r} (found: {', '.join(j.metadata.name for j in jobs)})"
            )
        return matching[0]
    if len(jobs) != 1:
        found = ", ".join(job.metadata.name for job in jobs) or "none"
        raise InputError(f"{source}: expected one FineTuneJob, found {len(jobs)} ({found}); pick one with --job NAME")
    return jobs[0]


def run_plan(
    job_path: Path, inventory: list[Path], output: str, ds_config_path: Path | None, job_name: str | None
) -> int:
    try:
        documents = load_documents(job_path, *inventory)
        job = _select_job(documents.jobs, job_name, job_path)
        result = plan_job(job.spec, documents.pools)
    except (InputError, PlanningError) as error:
        print(f"memfit plan: error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT

    if output == "table":
        print_plan_table(job, result)
    else:
        data = result.model_dump(by_alias=True, mode="json")
        sys.stdout.write(
            json.dumps(data, indent=2) + "\n" if output == "json" else yaml.safe_dump(data, sort_keys=False)
        )

    if ds_config_path is not None and result.chosen is not None:
        config = deepspeed_config(job.spec, result.chosen.strategy)
        ds_config_path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"DeepSpeed config written to {ds_config_path}", file=sys.stderr)
    return ExitCode.OK if result.chosen is not None else ExitCode.NO_FIT
