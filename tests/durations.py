"""The seconds each test file took in a run, the order ``tests/conftest.py`` hands files to pytest-xdist.

``make test`` runs each file on one worker (``--dist loadfile``) in the order collected; a long file started
last would leave the other core idle for its length. ``python -m tests.durations build/test-report.xml`` writes
``tests/file_durations.json`` from a run's JUnit report (``make test`` writes one); the times only order the
files, longest first, so a stale or missing entry makes the run slower, never wrong.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = Path(__file__).with_name("file_durations.json")


def file_of(classname: str) -> str | None:
    """The test file a JUnit ``classname`` (``tests.trainer.test_fsdp2`` or ``tests.test_x.TestClass``) names."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (ROOT / path).is_file():
            return path.as_posix()
    return None


def file_durations(junit: Path) -> dict[str, int]:
    """Each file's seconds (setup, call and teardown of its tests), whole seconds, longest first."""
    seconds: dict[str, float] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    return {path: round(total) for path, total in sorted(seconds.items(), key=lambda item: -item[1])}


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        sys.exit("usage: python -m tests.durations JUNIT_XML")
    DURATIONS.write_text(json.dumps(file_durations(Path(sys.argv[1])), indent=1) + "\n")


if __name__ == "__main__":
    main()
