"""One run per output directory, and a graceful stop: memfit-train under torchrun (2 CPU ranks, the tiny
llama), held mid-run by a test hook so that what happens does not depend on how fast the machine trains.

* a second run of the same output directory is refused in one line naming the holder (exit 2, a ConfigError
  termination message) and touches nothing;
* SIGTERM to torchrun (what Kubernetes sends the pod's first process) leaves a complete checkpoint of the step
  the run was at and a Stopped termination message, without an export; a rerun resumes from that step.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from memfit.api.vocabulary import TerminationReason
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.checkpoint import COMPLETE_MARKER, CheckpointManager
from memfit_trainer.loop import HOLD_ENV
from memfit_trainer.output_lock import WAIT_ENV
from tests.trainer.runs import make_config, run_trainer, torchrun_command, trainer_env, write_config

pytestmark = pytest.mark.distributed

STEPS, EVERY, STOP_AT = 12, 8, 5
"""STOP_AT is no checkpoint step: the checkpoint found there is the stop's."""
DEADLINE_SECONDS = 600


def wait_for_step(config: TrainerConfig, process: subprocess.Popen[bytes], step: int) -> None:
    """Until rank 0's progress file says ``step`` (the run then holds there)."""
    assert config.metrics.progress_file is not None
    progress = Path(config.metrics.progress_file)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (progress.exists() and json.loads(progress.read_text())["step"] == step):
        assert process.poll() is None, "the run ended before it reached the step"
        assert time.monotonic() < deadline, f"step {step} not reached in {DEADLINE_SECONDS} s"
        time.sleep(0.1)


def first_traceback(stderr: str) -> str:
    """Where a rank's traceback begins (torchrun's report of the failed ranks follows it)."""
    return stderr[stderr.find("Traceback") :][:4000]


def test_a_second_run_is_refused_and_sigterm_checkpoints_the_step_reached(tmp_path: Path) -> None:
    config = make_config(tmp_path, method="lora", learning_rate=1e-2, max_steps=STEPS, checkpoint_every=EVERY)
    config_path = write_config(config, tmp_path / "config.json")
    never = tmp_path / "never-released"
    first = subprocess.Popen(
        torchrun_command(config_path), env=trainer_env(**{HOLD_ENV: f"{STOP_AT}:{never}"}),
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_step(config, first, STOP_AT)
        second = run_trainer(config_path, **{WAIT_ENV: "0"})  # a live holder: refused at once
        assert second.returncode != 0, first_traceback(second.stderr)
        refusals = [line for line in second.stderr.splitlines() if line.startswith("memfit-train: ")]
        assert refusals and set(refusals) == {refusals[0]}, second.stderr[-4000:]
        assert re.search(
            rf"is in use by another run \(pid \d+ on host {re.escape(socket.gethostname())}\)", refusals[0]
        )
        message = json.loads(Path(config.termination_log).read_text())
        assert message["reason"] == TerminationReason.CONFIG_ERROR and "in use by another run" in message["message"]

        first.send_signal(signal.SIGTERM)
        stdout, _ = first.communicate(timeout=DEADLINE_SECONDS)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert f"stopped by SIGTERM at step {STOP_AT}/{STEPS}" in stdout.decode(), stdout.decode()[-2000:]
    checkpoints = CheckpointManager(config.checkpoint_dir).complete()
    assert [c.step for c in checkpoints] == [STOP_AT], checkpoints
    assert (checkpoints[0].path / COMPLETE_MARKER).is_file()
    assert not config.final_dir.exists()
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == TerminationReason.STOPPED and message["step"] == STOP_AT

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, first_traceback(resumed.stderr)
    assert f"resumed from checkpoint step {STOP_AT}" in resumed.stdout
    assert (config.final_dir / "adapter_model.safetensors").is_file()
