"""`memfit run --local` of examples/chat-validation end to end: a chat fine-tune with 10% of its conversations
held out reports its validation loss on the console, in rank 0's /metrics and in the progress file.

The run holds after its last step (memfit_trainer.loop's test hook), its metrics and progress written, until
the test has scraped it, however fast the machine trains; then it finishes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from memfit.contract.progress import VALIDATION_LOSS_METRIC, VALIDATION_STEP_METRIC, read_progress
from memfit_trainer.loop import HOLD_ENV
from tests.trainer.runs import trainer_env

pytestmark = pytest.mark.distributed
EXAMPLE = Path(__file__).parent.parent / "examples" / "chat-validation"
PORT_LINE = re.compile(r"^metrics: rank 0 serves /metrics on port (\d+)$", re.MULTILINE)
VALIDATION_LINE = re.compile(r"^validation step (\d+)/\d+ loss ([0-9.]+) tokens (\d+)", re.MULTILINE)


def rank0_samples(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("rank") == "0"
    }


def test_the_chat_example_reports_its_validation_loss(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLE, tmp_path / "example", ignore=shutil.ignore_patterns("output"))
    job_file = tmp_path / "example" / "job.yaml"
    spec = yaml.safe_load(job_file.read_text())["spec"]
    steps, every = spec["training"]["maxSteps"], spec["dataset"]["validation"]["everySteps"]
    progress_file = tmp_path / "example" / "output" / "chat-validation" / ".memfit" / "progress.json"
    release = tmp_path / "release"
    run = subprocess.Popen(
        [sys.executable, "-m", "memfit.cli.main", "run", str(job_file), "--local"],
        env=trainer_env(**{HOLD_ENV: f"{steps}:{release}"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(run.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while (progress := read_progress(progress_file)) is None or progress.validation_step != steps:
            assert run.poll() is None, "".join(output)[-5000:]
            assert time.monotonic() < deadline, "the run did not reach its last validation within 10 minutes"
            time.sleep(0.5)
        port = PORT_LINE.search("".join(output))
        assert port is not None, "".join(output)[-5000:]
        samples = rank0_samples(int(port.group(1)))
        release.touch()
        assert run.wait(timeout=300) == 0, "".join(output)[-5000:]
    finally:
        release.touch()
        if run.poll() is None:
            run.kill()
            run.wait()
    reader.join(timeout=60)

    console = {int(m.group(1)): (float(m.group(2)), int(m.group(3))) for m in VALIDATION_LINE.finditer("".join(output))}
    assert sorted(console) == list(range(every, steps + 1, every))
    assert console[steps][0] < console[every][0] and console[steps][1] > 0
    assert progress.validation_loss is not None
    assert progress.validation_loss == pytest.approx(console[steps][0], abs=5e-5)
    assert (samples[VALIDATION_STEP_METRIC], samples[VALIDATION_LOSS_METRIC]) == (steps, progress.validation_loss)
