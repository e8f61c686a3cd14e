"""Rank 0 waits for a held output lock before refusing: a restarted gang finds its dead predecessor's lock held
on NFS until the lease expires, and must go on once it is released."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.contract.output_lock import lock_path
from memfit_trainer.output_lock import WAIT_ENV, _try_lock
from tests.trainer.runs import make_config

HOLD = """
import sys, time
from pathlib import Path
from memfit.contract.output_lock import acquire
acquire(sys.argv[1])
Path(sys.argv[2]).touch()
time.sleep(float(sys.argv[3]))
"""


def _holder(output: Path, ready: Path, seconds: float) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(output), str(ready), str(seconds)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.05)
    return process


@pytest.mark.slow
def test_the_lock_is_taken_once_its_holder_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path)
    holder = _holder(Path(config.output_dir), tmp_path / "ready", seconds=1.0)
    monkeypatch.setenv(WAIT_ENV, "600")
    try:
        assert _try_lock(config) is None  # waited for the holder to exit, then took it
    finally:
        holder.wait()
    assert lock_path(config.output_dir).read_text().split()[0] != str(holder.pid)


def test_a_holder_past_the_wait_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path)
    holder = _holder(Path(config.output_dir), tmp_path / "ready", seconds=600)
    monkeypatch.setenv(WAIT_ENV, "0")
    try:
        refusal = _try_lock(config)
    finally:
        holder.kill()
        holder.wait()
    assert refusal is not None and f"pid {holder.pid} on host" in refusal
