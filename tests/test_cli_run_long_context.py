"""`memfit run --local` of examples/long-context end to end: a 4096-token job whose every sequence is split over
the 2 CPU ranks (sequence parallelism, pinned in the example) trains to its final weights on the recipe the planner
picks for million-token jobs: DeepSpeed ZeRO-3 with weights and optimizer in host memory, offloaded checkpoints,
the chunked loss in the LM head and tiled MLPs.

Its steps are the cost (some 10 s each on 2 CPU cores, against some 30 s for the rest), so the copy trains 4 of the
example's 8 and checkpoints every 2 instead of 4: still a checkpoint of the offloaded states mid-run that the later
steps train on, and a loss that falls by more than the 0.5 asked (5.6 to 4.7)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memfit.contract.progress import read_progress
from tests.trainer.runs import trainer_env

pytestmark = pytest.mark.distributed
EXAMPLE = Path(__file__).parent.parent / "examples" / "long-context"
LOSS = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+)", re.MULTILINE)
STEPS, EVERY = 4, 2
"""The copy's maxSteps and checkpointEverySteps (the example's are 8 and 4)."""


def test_the_long_context_example_trains_split_over_two_ranks(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLE, tmp_path / "example", ignore=shutil.ignore_patterns("output"))
    job_file = tmp_path / "example" / "job.yaml"
    job = yaml.safe_load(job_file.read_text())
    training = job["spec"]["training"]
    assert (training["maxSteps"], training["checkpointEverySteps"]) == (8, 4), training  # what the copy halves
    training.update(maxSteps=STEPS, checkpointEverySteps=EVERY)
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", "run", str(job_file), "--local", "--nproc", "2"],
        env=trainer_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "full zero3 opt->cpu params->cpu ckpt sp2 chunked-ce act->cpu tiled-mlp mb1x1" in output  # as pinned
    assert "sequence parallel: each sequence split over 2 ranks" in output
    assert "loss: chunked cross-entropy (pytorch, in the LM head under ZeRO-3)" in output
    assert "tiled MLP: 4 decoder MLPs run tiles" in output
    losses = [float(loss) for _, loss in LOSS.findall(output)]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (5.6 to 4.7 on this machine)
    run_dir = tmp_path / "example" / "output" / "long-context"
    progress = read_progress(run_dir / ".memfit" / "progress.json")
    assert progress is not None and progress.step == STEPS
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*/*")) == ["step-000002", "step-000004"]
