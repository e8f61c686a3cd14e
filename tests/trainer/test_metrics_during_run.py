"""A real training run exports its metrics while it runs: both ranks are scraped mid-run, promtool finds
nothing to fix, and the progress file follows the steps.

"Mid-run" by construction: the run holds after step HOLD_AT (memfit_trainer.loop's test hook) until the test
has scraped it, however fast the machine trains, then finishes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memfit.contract.progress import read_progress
from memfit.contract.sections import MetricsConfig
from memfit_trainer.loop import HOLD_ENV
from tests.trainer.runs import make_config, torchrun_command, trainer_env, write_config

pytestmark = pytest.mark.distributed
STEPS = 10
HOLD_AT = 5


def free_port_pair() -> int:
    """A port P with P+1 free as well (rank r serves on P + local rank)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise RuntimeError("no two consecutive free ports")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_are_scraped_during_a_run(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not on PATH (Debian's prometheus package; `make tools` installs it)")
    port = free_port_pair()
    config = make_config(tmp_path, max_steps=STEPS, checkpoint_every=40, offload=False, name="metrics")
    config = config.model_copy(update={"metrics": MetricsConfig(port=port, progress_file=config.metrics.progress_file)})
    progress_file = Path(config.metrics.progress_file or "")
    release = tmp_path / "release"
    launcher = subprocess.Popen(
        torchrun_command(write_config(config, tmp_path / "config.json")),
        env=trainer_env(**{HOLD_ENV: f"{HOLD_AT}:{release}"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while (progress := read_progress(progress_file)) is None or progress.step < HOLD_AT:
            assert launcher.poll() is None, launcher.stdout.read() if launcher.stdout else ""
            assert time.monotonic() < deadline, "no progress within 10 minutes"
            time.sleep(0.5)
        scraped: dict[int, str] = {}
        for rank in (0, 1):  # each rank holds once it has exported step HOLD_AT
            while samples(text := scrape(port + rank)).get("memfit_train_step") != HOLD_AT:
                assert time.monotonic() < deadline, f"rank {rank} did not reach step {HOLD_AT} within 10 minutes"
                time.sleep(0.1)
            scraped[rank] = text
        assert launcher.poll() is None, "the held run ended"
    finally:
        release.touch()
        output, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, output

    for rank, text in scraped.items():
        values = samples(text)
        assert values["memfit_train_step"] == HOLD_AT
        assert values["memfit_train_loss"] > 0
        assert values["memfit_train_tokens_total"] > 0 and values["memfit_train_samples_total"] > 0
        assert values["memfit_host_memory_bytes"] > 100 * 2**20  # a torch process's RSS, labelled cpu
        assert not any(name.startswith("memfit_gpu_memory") for name in values)  # nothing invented on a CPU
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, ""), f"rank {rank}: {lint.stdout}"
    assert "memfit_train_eta_seconds" in samples(scraped[0]) and "memfit_train_eta_seconds" not in samples(scraped[1])
    final = read_progress(progress_file)
    assert final is not None and final.step == STEPS and final.percent == 100
