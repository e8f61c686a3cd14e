"""`memfit run --local` stops every rank when it is stopped: torchrun starts each rank in a session of its own,
so neither a signal to memfit's process group nor memfit's death would reach them by themselves
(memfit.contract.lifetime). The tiny job on 2 CPU ranks, held after a step by a test hook; no process naming
its trainer config may outlive memfit, and the ranks checkpoint the step they were at on the way out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit_trainer.checkpoint import CheckpointManager
from memfit_trainer.loop import HOLD_ENV
from tests.trainer.runs import trainer_env

pytestmark = pytest.mark.distributed

TINY = Path(__file__).parent.parent / "examples" / "tiny"
HELD_AT = 3
"""No checkpoint step of the tiny job (every 10): the checkpoint found there is the stop's."""
DEADLINE_SECONDS = 600


@pytest.fixture
def tiny_job(tmp_path: Path) -> Path:
    shutil.copytree(TINY / "data", tmp_path / "data")
    shutil.copy(TINY / "job.yaml", tmp_path / "job.yaml")
    return tmp_path / "job.yaml"


def start_memfit(job: Path) -> subprocess.Popen[str]:
    """``memfit run JOB --local`` in a process group of its own, held after step HELD_AT until stopped."""
    never = job.parent / "never-released"
    command = [sys.executable, "-m", "memfit.cli.main", "run", str(job), "--local", "--nproc", "2"]
    return subprocess.Popen(
        command, env=trainer_env(**{HOLD_ENV: f"{HELD_AT}:{never}"}), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def output_dir(job: Path) -> Path:
    return job.parent / "output" / "tiny"


def wait_for_held_step(job: Path, memfit: subprocess.Popen[str]) -> None:
    progress = output_dir(job) / ".memfit" / "progress.json"
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (progress.exists() and json.loads(progress.read_text())["step"] == HELD_AT):
        assert memfit.poll() is None, "memfit ended before the step was reached"
        assert time.monotonic() < deadline, f"step {HELD_AT} not reached in {DEADLINE_SECONDS} s"
        time.sleep(0.1)


def processes_naming(text: str) -> list[int]:
    """The live processes whose command line contains ``text`` (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if text in command_line:
            found.append(int(entry.name))
    return found


def assert_no_rank_outlives_memfit(job: Path) -> None:
    """Every process started for the run (torchrun, its ranks) has ended, within a generous deadline: they
    checkpoint on the way out."""
    config = str(output_dir(job) / ".memfit" / "trainer-config.json")
    deadline = time.monotonic() + DEADLINE_SECONDS
    while processes_naming(config):
        assert time.monotonic() < deadline, f"still running after {DEADLINE_SECONDS} s: {processes_naming(config)}"
        time.sleep(0.2)


def checkpointed_steps(job: Path) -> list[int]:
    (layout,) = (output_dir(job) / "checkpoints").iterdir()
    return [c.step for c in CheckpointManager(layout).complete()]


def test_killing_memfits_process_group_stops_every_rank(tiny_job: Path) -> None:
    memfit = start_memfit(tiny_job)
    try:
        wait_for_held_step(tiny_job, memfit)
        os.killpg(memfit.pid, signal.SIGKILL)
        memfit.wait()
        assert_no_rank_outlives_memfit(tiny_job)
    finally:
        if memfit.poll() is None:
            os.killpg(memfit.pid, signal.SIGKILL)
            memfit.wait()
    assert checkpointed_steps(tiny_job) == [HELD_AT]


def test_sigterm_to_memfit_stops_every_rank_and_says_where(tiny_job: Path) -> None:
    memfit = start_memfit(tiny_job)
    try:
        wait_for_held_step(tiny_job, memfit)
        memfit.send_signal(signal.SIGTERM)
        _, stderr = memfit.communicate(timeout=DEADLINE_SECONDS)
    finally:
        if memfit.poll() is None:
            os.killpg(memfit.pid, signal.SIGKILL)
            memfit.wait()
    assert_no_rank_outlives_memfit(tiny_job)
    assert memfit.returncode == 128 + signal.SIGTERM
    last = stderr.strip().splitlines()[-1]
    assert last == f"memfit run: stopped by SIGTERM at step {HELD_AT}, its checkpoint written; the same command resumes"
    assert "Traceback" not in stderr, stderr[-4000:]  # torchrun's report of the signal it was passed is withheld
    assert checkpointed_steps(tiny_job) == [HELD_AT]
