"""A full output volume: memfit-train under torchrun (2 CPU ranks) writing its output to a 512 KiB tmpfs (too
small for the tiny llama's first checkpoint) says ``no space left on <mount point>`` in one line, leaves a
NoSpace termination message, and a checkpoint that could not be written is never taken for one. Mounting
needs root: elsewhere the test is skipped."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from memfit.api.vocabulary import TerminationReason
from memfit_trainer.checkpoint import CheckpointManager
from tests.trainer.runs import make_config, run_trainer, write_config

pytestmark = pytest.mark.distributed


@pytest.fixture
def full_volume(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(volume)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield volume
    subprocess.run(["umount", str(volume)], check=True)


def test_a_full_output_volume_is_said_in_one_line(tmp_path: Path, full_volume: Path) -> None:
    config = make_config(tmp_path, method="full", max_steps=4, checkpoint_every=2)
    config = config.model_copy(update={"output_dir": str(full_volume / "output")})
    result = run_trainer(write_config(config, tmp_path / "config.json"))
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("memfit-train: ")]
    assert said, result.stderr[-4000:]
    assert said[0].startswith(f"memfit-train: no space left on {full_volume}, "), said[0]
    assert "the checkpoint of step 2 could not be written" in said[0]
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == TerminationReason.NO_SPACE and message["message"] == said[0].removeprefix(
        "memfit-train: "
    )
    assert CheckpointManager(config.checkpoint_dir).complete() == []
