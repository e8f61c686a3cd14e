"""The README's `memfit plan` and `memfit profile` examples and its benchmark tables, as they print now.

`python -m tests.readme_outputs` rewrites each block after its `$ memfit plan ...` (or `$ python bench/...`)
line; tests/test_readme.py fails when one drifts (the planning time aside), so the README shows output,
never a hand-edited copy of it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

from memfit.cli.main import main

README = Path(__file__).resolve().parent.parent / "README.md"
COMMAND = re.compile(
    r"^\$ (memfit (?:plan|profile|presets) .*|python bench/(?:peer_figures|long_context|gpu_truth_report)\.py)$",
    re.MULTILINE,
)
BENCHES = {
    "python bench/peer_figures.py": "bench.peer_figures",
    "python bench/long_context.py": "bench.long_context",
    "python bench/gpu_truth_report.py": "bench.gpu_truth_report",
}
"""The scripts whose output the README shows: their module's ``main()`` prints it (run as the command line
names it: ``sys.argv`` is the script's)."""
TIMING = re.compile(r"planned in [0-9.]+ ms")
"""The one part of the output that differs from run to run."""


def run(command: str) -> str:
    """What `command` prints at the README's width (run in-process, from the repository's root)."""
    out = io.StringIO()
    previous = os.environ.get("COLUMNS"), Path.cwd()
    os.environ["COLUMNS"] = "120"
    os.chdir(README.parent)
    arguments = sys.argv
    try:
        with contextlib.redirect_stdout(out):
            if command in BENCHES:
                sys.argv = shlex.split(command)[1:]
                importlib.import_module(BENCHES[command]).main()
            else:
                main(shlex.split(command)[1:])
    finally:
        sys.argv = arguments
        os.chdir(previous[1])
        if previous[0] is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous[0]
    return out.getvalue()


def blocks(text: str) -> list[tuple[str, int, int]]:
    """(command, start, end) of each example's output in ``text``: from after the command's line to the fence."""
    found = []
    for match in COMMAND.finditer(text):
        start = match.end() + 1
        found.append((match.group(1), start, text.index("```", start)))
    return found


def regenerated(text: str) -> str:
    for command, start, end in reversed(blocks(text)):
        text = text[:start] + run(command) + text[end:]
    return text


def comparable(output: str) -> str:
    return TIMING.sub("planned in - ms", "\n".join(line.rstrip() for line in output.splitlines()))


if __name__ == "__main__":
    README.write_text(regenerated(README.read_text()))
