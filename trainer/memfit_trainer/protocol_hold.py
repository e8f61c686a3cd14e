"""A test hook: hold the process at a named point of the checkpoint or export protocol, so that a test can
kill it exactly there (the kill chain of tests/trainer/test_exact_resume.py), however fast the machine is.

``MEMFIT_TEST_HOLD_AT=POINT:STEP:PATH`` makes the process that reaches ``POINT`` for ``STEP`` create
``PATH.held`` and wait until ``PATH`` exists. The points, in the order a save reaches them:

* ``marker-written``: the ``COMPLETE`` marker is in the temporary directory, not yet renamed into place;
* ``renamed``: the directory has its final name (the checkpoint of ``STEP`` is complete);
* ``pruning``: the checkpoint of ``STEP`` is being pruned: renamed to its ``.deleting`` name, not yet removed;
* ``final-written``: the final export of ``STEP`` is complete under its temporary name, not yet swapped in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

HOLD_AT_ENV = "MEMFIT_TEST_HOLD_AT"
POINTS = ("marker-written", "renamed", "pruning", "final-written")
POLL_SECONDS = 0.05


def hold_at(point: str, step: int) -> None:
    """Hold here where ``MEMFIT_TEST_HOLD_AT`` names this point and step (a no-op otherwise)."""
    assert point in POINTS, point
    wanted, _, rest = os.environ.get(HOLD_AT_ENV, "").partition(":")
    at, _, release = rest.partition(":")
    if wanted != point or at != str(step) or not release:
        return
    Path(release + ".held").touch()
    wait_for(release)


def wait_for(release: str, given_up: Callable[[], bool] = lambda: False) -> None:
    """Poll until the file ``release`` exists (or ``given_up()``): the test's signal to go on."""
    while not os.path.exists(release) and not given_up():
        time.sleep(POLL_SECONDS)
