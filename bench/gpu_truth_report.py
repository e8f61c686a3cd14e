"""The README's "Measured on a GPU" table: a results file of ``bench/gpu_truth.py`` (the newest in
``bench/results/`` unless one is named), printed as the README shows it.

    .venv/bin/python bench/gpu_truth_report.py [FILE]

tests/readme_outputs.py runs it to write the README's block, and tests/test_readme.py fails when the README
differs from it: the measured figures there are a results file's, never typed by hand. Only the cases that ran
are rows (measured, or out of memory with the peak they reached); the others are counted by status.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the kit is bench.gpu_truth

from bench.gpu_truth import RESULTS_DIR, gib_text, rate_text, ratio_text  # noqa: E402

RAN = ("measured", "out of memory")
COLUMNS = (
    "case",
    "plan",
    "attention",
    "planned GiB",
    "measured GiB",
    "ratio",
    "planned tok/s",
    "measured tok/s",
    "ratio",
)
WIDTH = 118
"""The README's code blocks' width, for the lines above the table."""
DATED = re.compile(r"gpu-truth-(\d{4}-\d{2}-\d{2})(?:-(\d+))?\.json")


def newest(directory: Path | None = None) -> Path | None:
    """The latest run's file in ``directory`` (default :data:`RESULTS_DIR`): by its date, then its number that day."""
    found = (directory or RESULTS_DIR).glob("gpu-truth-*.json")
    dated = [(match.group(1), int(match.group(2) or 1), path) for path in found
             if (match := DATED.fullmatch(path.name))]  # fmt: skip
    return max(dated)[2] if dated else None


def header(document: dict[str, Any]) -> list[str]:
    """Where and with what the run measured, and how."""
    info, settings = document["header"], document["settings"]
    packages = ", ".join(
        f"{key} {value}" for key, value in info.items() if key not in ("date", "gpu", "driver", "cuda")
    )
    lines = [
        f"{info['date'][:10]}: {info.get('gpu', 'unknown GPU')}, driver {info.get('driver', 'unknown')}, "
        f"CUDA {info.get('cuda', 'unknown')}; {packages}",
        f"{settings['steps']} optimizer steps, tokens/s over those after step {settings['warmup']}, "
        f"{settings['gpus']} GPU(s) a case; memory: torch.cuda.max_memory_allocated(), largest rank",
    ]
    if document.get("source"):
        lines.append(str(document["source"]))
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, WIDTH, subsequent_indent="  ")]


def _row(result: dict[str, Any]) -> list[str]:
    planned, measured, ratios = result["planned"], result["measured"] or {}, result["ratios"]
    peak = gib_text(measured.get("peakBytes"))
    if result["status"] == "out of memory":
        peak += " @OOM"
    return [
        result["name"],
        planned.get("strategy") or "-",
        planned.get("attention") or "-",
        gib_text(planned["peakAllocatedBytes"]),
        peak,
        ratio_text(ratios["peakMemory"]),
        rate_text(planned["tokensPerSecond"]),
        rate_text(measured.get("tokensPerSecond")),
        ratio_text(ratios["tokensPerSecond"]),
    ]


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain-text columns, the case left-aligned and the figures right-aligned."""
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(cell.ljust(width) if i < 3 else cell.rjust(width) for i, (cell, width) in pairs).rstrip()

    return [line(COLUMNS), line(["-" * width for width in widths]), *(line(row) for row in rows)]


def report(document: dict[str, Any]) -> str:
    results = document["results"]
    ran = [result for result in results if result["status"] in RAN]
    others = Counter(result["status"] for result in results if result["status"] not in RAN)
    lines = [*header(document), "", *table([_row(result) for result in ran])]
    if others:
        counted = ", ".join(f"{count} {status}" for status, count in sorted(others.items()))
        lines.append(f"not measured in this run: {counted} (of {len(results)} cases)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", type=Path, help="a results file (default: the newest in bench/results)")
    path = parser.parse_args(argv).file or newest()
    if path is None:
        print("gpu_truth_report: no results file in bench/results (bench/gpu_truth.py writes one)", file=sys.stderr)
        return 2
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"gpu_truth_report: {path}: {error}", file=sys.stderr)
        return 2
    print(report(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
