"""``memfit plan``: load the job and the inventory, plan, print, optionally write the DeepSpeed config."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from memfit.api.base import escaped, shown
from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool, product_read_as
from memfit.api.loading import InputError, load_documents
from memfit.api.runtime import Runtime
from memfit.api.vocabulary import Engine
from memfit.cli.exit_codes import ExitCode
from memfit.cli.model_profiles import ProfileFailed
from memfit.cli.plan_table import print_longest_table, print_plan_table
from memfit.cli.run_command import model_claim_directory, parse_mounts, profiled_model
from memfit.planned_model import PlannedModel
from memfit.planner.longest import longest_sequence
from memfit.planner.search import PlanningError, plan_job
from memfit.render.deepspeed import deepspeed_config

MAX_POOLS = 100
"""GPUPools one `memfit plan` plans over: more than any cluster declares, and the planner's work grows with
each (a pool of 10000 single-GPU nodes, with a global batch of many divisors, takes a few tenths of a second)."""
MAX_ERROR_LENGTH = 2000
"""An error line is cut here (the loader already bounds every value it echoes)."""


def _select_job(jobs: list[FineTuneJob], name: str | None, source: Path) -> FineTuneJob:
    if name is not None:
        matching = [job for job in jobs if job.metadata.name == name]
        if not matching:
            raise InputError(f"{escaped(str(source))}: no FineTuneJob named {shown(name)} (found: {_names(jobs)})")
        return matching[0]
    if len(jobs) != 1:
        raise InputError(
            f"{escaped(str(source))}: expected one FineTuneJob, found {len(jobs)} ({_names(jobs)}); "
            "pick one with --job NAME"
        )
    return jobs[0]


def _names(jobs: list[FineTuneJob], limit: int = 5) -> str:
    names = [shown(job.metadata.name) for job in jobs[:limit]]
    return ", ".join(names + ([f"{len(jobs) - limit} more"] if len(jobs) > limit else [])) or "none"


def _error(message: object) -> int:
    """Bad input, in one line: whatever the message quotes from the input prints literally."""
    text = escaped(str(message))
    if len(text) > MAX_ERROR_LENGTH:
        text = text[: MAX_ERROR_LENGTH - 3] + "..."
    print(f"memfit plan: error: {text}", file=sys.stderr)
    return ExitCode.BAD_INPUT


def run_plan(
    job_path: Path,
    inventory: list[Path],
    output: str,
    ds_config_path: Path | None,
    job_name: str | None,
    max_sequence_length: bool = False,
    mount_args: Sequence[str] = (),
    trainer_packages: str = "",
) -> int:
    if max_sequence_length and ds_config_path is not None:
        return _error("--emit-ds-config writes one plan's config: leave out --max-sequence-length")
    try:
        documents = load_documents(job_path, *inventory)
        job = _select_job(documents.jobs, job_name, job_path)
        if len(documents.pools) > MAX_POOLS:
            files = ", ".join(escaped(str(path)) for path in (job_path, *inventory))
            raise InputError(f"{files}: {len(documents.pools)} GPUPools: memfit plan plans over at most {MAX_POOLS}")
        runtime = Runtime.of(trainer_packages.split(","))
        model = profiled_model(job, model_claim_directory(job, job_path, parse_mounts(job_path, list(mount_args))))
    except ProfileFailed as error:
        print(f"memfit plan: error: {escaped(str(error))}", file=sys.stderr)
        return error.exit_code
    except (InputError, ValueError) as error:
        return _error(error)
    if max_sequence_length:
        return _run_longest(job, documents.pools, job_path, output, model, runtime)
    try:
        result = plan_job(job.spec, documents.pools, model=model, runtime=runtime)
    except PlanningError as error:  # the request names something the inventory lacks
        return _error(f"{job_path}: FineTuneJob {shown(job.metadata.name)}: {error}")

    if output == "table":
        print_plan_table(job, result, gpus_read_as=[r for r in map(product_read_as, documents.pools) if r])
    else:
        data = result.model_dump(by_alias=True, mode="json")
        sys.stdout.write(
            json.dumps(data, indent=2) + "\n" if output == "json" else yaml.safe_dump(data, sort_keys=False)
        )

    if ds_config_path is not None and result.chosen is not None and result.chosen.strategy.engine != Engine.DEEPSPEED:
        print(f"the chosen plan runs on the {result.chosen.strategy.engine} engine, which has no DeepSpeed config: "
              f"nothing written to {escaped(str(ds_config_path))}", file=sys.stderr)  # fmt: skip
    elif ds_config_path is not None and result.chosen is not None:
        config = deepspeed_config(job.spec, result.chosen.strategy, model)
        try:
            ds_config_path.write_text(json.dumps(config, indent=2) + "\n")
        except OSError as error:
            return _error(f"{ds_config_path}: cannot write: {error.strerror or error}")
        print(f"DeepSpeed config written to {escaped(str(ds_config_path))}", file=sys.stderr)
    return ExitCode.OK if result.chosen is not None else ExitCode.NO_FIT


def _run_longest(
    job: FineTuneJob, pools: list[GPUPool], job_path: Path, output: str, model: PlannedModel | None, runtime: Runtime
) -> int:
    """``--max-sequence-length``: one row per pool (exit 1 when the job fits on none at any length)."""
    try:
        rows = longest_sequence(job.spec, pools, _progress if output == "table" else None, model, runtime)
    except PlanningError as error:
        return _error(f"{job_path}: FineTuneJob {shown(job.metadata.name)}: {error}")
    if output == "table":
        print_longest_table(job, rows)
    else:
        data = [
            {
                "pool": row.pool,
                "sequenceLength": row.sequence_length,
                "apiMaximum": row.api_maximum,
                "sequenceParallel": row.sequence_parallel,
                "plan": row.plan.model_dump(by_alias=True, mode="json") if row.plan else None,
            }
            for row in rows
        ]
        sys.stdout.write(
            json.dumps(data, indent=2) + "\n" if output == "json" else yaml.safe_dump(data, sort_keys=False)
        )
    return ExitCode.OK if any(row.plan for row in rows) else ExitCode.NO_FIT


def _progress(pool: str) -> None:
    print(f"searching the longest sequenceLength on pool {escaped(pool)}...", file=sys.stderr)
