"""The memory model against MemTracker traces of real training steps: the error table.

Run: python bench/estimate_vs_trace.py [TRACES.json]   (default: tests/data/memtrace/traces.json,
written by bench/memtrace_grid.py). One row per traced setting, then the error summary per family.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from calibration.compare import measured_beyond_states, predicted_beyond_states

DEFAULT_TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "memtrace" / "traces.json"


def label(record: dict[str, Any]) -> str:
    s = record["settings"]
    knobs = [s["trainable"], s["dtype"], s["attention"], "ckpt" if s["gradient_checkpointing"] else "-"]
    return f"{record['preset']}/L{record['shape']['num_layers']} b{s['micro_batch']} s{s['seq_len']} " + " ".join(knobs)


def main(path: Path = DEFAULT_TRACES) -> None:
    records = json.loads(path.read_text())
    errors: dict[str, list[float]] = defaultdict(list)
    print(f"{'setting':<58} {'traced MiB':>11} {'estimate MiB':>13} {'error':>7}")
    for record in records:
        measured, predicted = measured_beyond_states(record), predicted_beyond_states(record)
        error = predicted / measured - 1
        errors[record["shape"]["family"]].append(error)
        errors["all"].append(error)
        print(f"{label(record):<58} {measured / 2**20:>11.1f} {predicted / 2**20:>13.1f} {error:>+7.1%}")
    print(f"\n{'family':<10} {'traces':>6} {'mean |error|':>13} {'worst under':>12} {'worst over':>11}")
    for family, values in sorted(errors.items()):
        print(f"{family:<10} {len(values):>6} {statistics.mean(map(abs, values)):>13.1%} "
              f"{min(values):>+12.1%} {max(values):>+11.1%}")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TRACES)
