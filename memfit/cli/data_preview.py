"""``memfit data preview JOB.yaml``: the first sequences the trainer would train on, targets and document
boundaries marked, and the dataset's token statistics, before any GPU is spent.

The core cannot import torch or transformers, so the trainer's own code builds the sequences in a
subprocess (``python -m memfit_trainer.preview``, as ``memfit run --local`` starts the trainer), from the
job's ``dataset`` and ``model`` rendered as the trainer config renders them, with the same local mounts.
Text output marks targets with ``⟦...⟧`` (and colour on a terminal) and each document's start with
``⟪doc N⟫``; ``-o json`` gives every token as ``{"id", "text", "trained", "document"}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from memfit.api.loading import InputError
from memfit.cli.exit_codes import ExitCode
from memfit.cli.run_command import contained, local_mounts, parse_mounts, single_job
from memfit.render.trainer_config import data_config, model_config

TARGET_OPEN, TARGET_CLOSE = "\u27e6", "\u27e7"
PADDING_DOCUMENT = -1
STATISTICS_LABELS = {
    "records": "records",
    "tokensP50": "tokens per record, p50",
    "tokensP99": "tokens per record, p99",
    "tokensMax": "tokens per record, max",
    "documentTokens": "tokens in all records",
    "sequences": "sequences per epoch",
    "tokensPerEpoch": "tokens per epoch (in sequences)",
    "trainedTokensPerEpoch": "target tokens per epoch",
    "truncatedShare": "share of tokens truncated",
    "paddedShare": "share of positions padding",
}


def _request(job_file: Path, mount_args: list[str], count: int) -> dict[str, Any]:
    job = single_job(job_file, None)
    mounts = local_mounts(job, job_file, parse_mounts(job_file, mount_args))
    # Unplanned, the preview packs unless the job says not to (a plan leaves packing off for models whose
    # linear-attention layers would mix packed documents).
    data = data_config(job.spec.dataset, mounts.data, job.spec.dataset.packing is not False)
    contained(Path(data.path), Path(mounts.data), "dataset.source.path: the data")
    return {
        "data": data.model_dump(mode="json", by_alias=True),
        "model": model_config(job.spec.model, mounts.model).model_dump(mode="json", by_alias=True),
        "sequenceLength": job.spec.training.sequence_length,
        "count": count,
    }


def sequence_text(tokens: list[dict[str, Any]]) -> Text:
    """One sequence: targets styled and inside ``⟦ ⟧``, ``⟪doc N⟫`` where a document starts, padding left out."""
    text = Text()
    document, in_target = None, False
    for token in tokens:
        if token["document"] == PADDING_DOCUMENT:
            break
        if token["document"] != document:
            if in_target:
                text.append(TARGET_CLOSE, style="bold green")
            text.append(f"\n\u27eadoc {token['document']}\u27eb\n", style="bold cyan")
            document, in_target = token["document"], False
        if token["trained"] != in_target:
            text.append(TARGET_OPEN if token["trained"] else TARGET_CLOSE, style="bold green")
            in_target = token["trained"]
        text.append(token["text"], style="green" if token["trained"] else "dim")
    if in_target:
        text.append(TARGET_CLOSE, style="bold green")
    return text


def _print_text(result: dict[str, Any], console: Console) -> None:
    for number, tokens in enumerate(result["sequences"]):
        console.rule(f"sequence {number}")
        console.print(sequence_text(tokens), highlight=False, markup=False)
    console.rule("statistics" + ("" if result["packing"] else " (not packed: one record per sequence)"))
    for key, value in result["statistics"].items():
        shown = f"{value:.2%}" if isinstance(value, float) else str(value)
        console.print(f"{STATISTICS_LABELS.get(key, key)}: {shown}", highlight=False, markup=False)


def run_preview(job_file: Path, mount_args: list[str], count: int, output: str) -> int:
    if count < 1:
        print("memfit data preview: error: -n must be at least 1", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        request = _request(job_file, mount_args, count)
    except (InputError, ValueError, OSError) as error:
        print(f"memfit data preview: error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as handle:
        json.dump(request, handle)
        handle.flush()
        done = subprocess.run(
            [sys.executable, "-m", "memfit_trainer.preview", handle.name], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        print(lines[-1] if lines else f"memfit data preview: error: exit {done.returncode}", file=sys.stderr)
        return ExitCode.BAD_INPUT if done.returncode == ExitCode.BAD_INPUT else ExitCode.INTERNAL_ERROR
    result = json.loads(done.stdout)
    if output == "json":
        print(json.dumps(result))
    else:
        _print_text(result, Console(soft_wrap=True))
    return ExitCode.OK
