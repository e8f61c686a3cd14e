"""Trainer metrics as Prometheus scrapes them, and the progress file as the operator reads it."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memfit.contract import progress as progress_module
from memfit.contract.progress import (
    CHECKPOINT_STEP_METRIC,
    RESUMED_FROM_STEP_METRIC,
    SET_ASIDE_METRIC,
    Progress,
    read_progress,
    write_progress,
)
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer import metrics as metrics_module
from memfit_trainer.metrics import TrainerMetrics, model_flops_per_token

JOB = "team-a/llama-lora"
LLAMA_8B = {
    "family": "llama", "hiddenSize": 4096, "intermediateSize": 14336, "numLayers": 32, "numAttentionHeads": 32,
    "numKeyValueHeads": 8, "vocabSize": 128256,
}  # fmt: skip
H100_BF16_FLOPS = 989e12
PROMTOOL_INSTALL = "apt-get install -y --no-install-recommends prometheus"


def trainer_config(progress_file: Path | None, *, peak_flops: float | None = None, port: int = 0) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "job": JOB,
        "model": {"nameOrPath": "meta-llama/Llama-3.1-8B", "architecture": LLAMA_8B},
        "data": {"path": "/mnt/data/train.jsonl"},
        "training": {
            "method": "full", "sequenceLength": 4096, "microBatchSize": 1, "gradientAccumulationSteps": 4,
            "globalBatchSize": 8, "maxSteps": 10, "learningRate": 1e-5, "precision": "bf16",
            "checkpointEverySteps": 5,
        },
        "outputDir": "/mnt/output",
        "engine": {"kind": "deepspeed", "config": {}},
        "prediction": {
            "strategy": "ZeRO-2, bf16, 2 GPUs", "peakAllocatedBytes": 61_000_000_000, "totalBytes": 68_500_000_000,
            "gpuMemoryBytes": 85_520_809_984, "tokensPerSecond": 7200.0, "peakFlops": peak_flops,
        },
        "metrics": {"port": port, "progressFile": str(progress_file) if progress_file else None},
    })  # fmt: skip


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(metrics: TrainerMetrics) -> tuple[str, Samples]:
    """GET /metrics over HTTP like Prometheus, and every sample by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels`` (finetunejob and rank 0 by default)."""
    wanted = {"finetunejob": JOB, "rank": "0", **labels}.items()
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= dict(ls).items()]
    assert len(found) == 1, f"{name}{dict(wanted)}: {len(found)} samples"
    return found[0]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def feed(metrics: TrainerMetrics, steps: range, total_steps: int | None = 10) -> None:
    """Steps of 0.5 s with 4 x 4096 tokens on this rank, loss 3/step."""
    for step in steps:
        metrics.step(
            step=step, total_steps=total_steps, loss=3.0 / step, learning_rate=1e-5 * step,
            tokens=4 * 4096, samples=4, step_seconds=0.5,
        )  # fmt: skip


@pytest.fixture
def open_metrics() -> Iterator[list[TrainerMetrics]]:
    """Collects the TrainerMetrics a test starts and closes them, whatever the test's outcome."""
    started: list[TrainerMetrics] = []
    yield started
    for metrics in started:
        metrics.close()


def start(started: list[TrainerMetrics], config: TrainerConfig, rank: int = 0, local_rank: int = 0) -> TrainerMetrics:
    metrics = TrainerMetrics.from_config(config, rank=rank, local_rank=local_rank, world_size=2)
    started.append(metrics)
    return metrics


def test_steps_and_checkpoints_as_scraped(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    metrics = start(open_metrics, trainer_config(tmp_path / "progress.json"))
    assert metrics.port > 0
    feed(metrics, range(1, 3))
    _, before = scrape(metrics)
    feed(metrics, range(3, 6))
    metrics.checkpoint(step=5, seconds=12.0)
    _, after = scrape(metrics)

    assert value(after, "memfit_train_step") == 5
    assert value(after, "memfit_train_loss") == pytest.approx(0.6)
    assert value(after, "memfit_train_learning_rate") == pytest.approx(5e-5)
    assert value(after, "memfit_train_tokens_per_second") == pytest.approx(4 * 4096 / 0.5)
    assert value(before, "memfit_train_samples_total") == 8 and value(after, "memfit_train_samples_total") == 20
    assert value(before, "memfit_train_tokens_total") == 2 * 16384
    assert value(after, "memfit_train_tokens_total") == 5 * 16384
    assert value(after, "memfit_train_step_duration_seconds_count") == 5
    assert value(after, "memfit_train_step_duration_seconds_sum") == pytest.approx(2.5)
    assert value(after, "memfit_train_step_duration_seconds_bucket", le="0.25") == 0
    assert value(after, "memfit_train_step_duration_seconds_bucket", le="0.5") == 5

    assert value(after, "memfit_checkpoint_duration_seconds_count") == 1
    assert value(after, "memfit_checkpoint_duration_seconds_bucket", le="10.0") == 0
    assert value(after, "memfit_checkpoint_duration_seconds_bucket", le="30.0") == 1
    assert value(after, "memfit_checkpoint_last_step") == 5
    assert time.time() - value(after, "memfit_checkpoint_last_timestamp_seconds") < 60
    assert "memfit_checkpoint_last_step" not in names(before)  # absent until a checkpoint, not zero

    # On the CPU: the process RSS, clearly labelled, and no GPU figures at all.
    assert value(after, "memfit_host_memory_bytes", device="cpu", kind="rss") > 10 * 2**20
    assert not {n for n in names(after) if n.startswith("memfit_gpu_memory_")}

    assert value(after, "memfit_predicted_peak_allocated_bytes") == 61_000_000_000
    assert value(after, "memfit_predicted_total_bytes") == 68_500_000_000
    assert value(after, "memfit_gpu_capacity_bytes") == 85_520_809_984
    assert value(after, "memfit_predicted_tokens_per_second") == 7200
    assert "memfit_train_estimated_mfu_ratio" not in names(after)  # no peak FLOP/s in the plan

    # Rank 0's progress: 5 of 10 steps; 5 more at 0.5 s and one more checkpoint (step 10) at 12 s.
    assert value(after, "memfit_train_total_steps") == 10
    assert value(after, "memfit_train_progress_ratio") == 0.5
    assert value(after, "memfit_train_eta_seconds") == pytest.approx(5 * 0.5 + 12.0)


def test_mfu_only_with_the_gpus_peak_flops(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    metrics = start(open_metrics, trainer_config(None, peak_flops=H100_BF16_FLOPS))
    _, samples = scrape(metrics)
    assert "memfit_train_estimated_mfu_ratio" not in names(samples)  # no step yet: no rate to divide
    for step in range(1, 4):  # 8192 tokens/s on this rank: a good, not a heroic, rate for 8B on an H100
        metrics.step(step=step, total_steps=10, loss=2.0, learning_rate=1e-5, tokens=4096, samples=1, step_seconds=0.5)
    _, samples = scrape(metrics)
    shape = ModelShape(ModelFamily.LLAMA, 4096, 14336, 32, 32, 8, 128256)
    expected = (6 * shape.active_parameters_per_token + 6 * 32 * 4096 * 4096) * 8192 / H100_BF16_FLOPS
    mfu = value(samples, "memfit_train_estimated_mfu_ratio")
    assert mfu == pytest.approx(expected)
    assert 0.3 < mfu < 0.5


def test_frozen_base_counts_no_weight_gradients() -> None:
    shape = ModelShape(ModelFamily.LLAMA, 4096, 14336, 32, 32, 8, 128256)
    full, lora = model_flops_per_token(shape, 2048, "full"), model_flops_per_token(shape, 2048, "lora")
    assert full == pytest.approx(1.5 * lora)
    assert full == pytest.approx(6 * shape.active_parameters_per_token, rel=0.1)  # attention: a few % at 2k


def test_other_ranks_report_no_progress(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    progress_file = tmp_path / "progress.json"
    metrics = start(open_metrics, trainer_config(progress_file), rank=1, local_rank=1)
    feed(metrics, range(1, 3))
    _, samples = scrape(metrics)
    assert value(samples, "memfit_train_step", rank="1") == 2
    assert not {"memfit_train_total_steps", "memfit_train_progress_ratio", "memfit_train_eta_seconds"} & names(samples)
    assert not progress_file.exists()


def test_each_local_rank_serves_on_port_plus_its_rank(open_metrics: list[TrainerMetrics]) -> None:
    with socket.socket() as probe:  # a port free right now; the base port is one below it
        probe.bind(("", 0))
        free = probe.getsockname()[1]
    metrics = start(open_metrics, trainer_config(None, port=free - 1), rank=3, local_rank=1)
    assert metrics.port == free
    metrics.close()
    metrics.close()  # idempotent: the training loop's finally may close again
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{free}/metrics", timeout=2)


def test_scrape_passes_promtool(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(f"promtool is not on PATH; it comes with Debian's prometheus package: {PROMTOOL_INSTALL}")
    rank0 = start(open_metrics, trainer_config(tmp_path / "progress.json", peak_flops=H100_BF16_FLOPS))
    rank1 = start(open_metrics, trainer_config(None), rank=1, local_rank=1)
    for metrics in (rank0, rank1):
        feed(metrics, range(1, 6))
        metrics.checkpoint(step=5, seconds=3.0)
        metrics.validation(step=5, loss=1.25, seconds=2.0)
        text, _ = scrape(metrics)
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, ""), f"promtool check metrics:\n{lint.stdout}"


def test_progress_file_contents(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    progress_file = tmp_path / "status" / "progress.json"  # the directory is created
    metrics = start(open_metrics, trainer_config(progress_file))
    assert read_progress(progress_file) is None  # before the first step
    feed(metrics, range(1, 4))
    document = progress_file.read_text()
    progress = read_progress(progress_file)
    assert progress is not None and progress.to_json() == document
    assert list(Progress.model_validate_json(document).model_dump(by_alias=True)) == [
        "step", "totalSteps", "percent", "tokensPerSecond", "etaSeconds", "eta", "lastCheckpointStep", "loss",
        "validationLoss", "validationStep", "resumedFromStep", "checkpointsSetAside", "updated",
    ]  # fmt: skip
    assert (progress.step, progress.total_steps, progress.percent) == (3, 10, 30.0)
    assert progress.tokens_per_second == pytest.approx(2 * 4 * 4096 / 0.5)  # rank 0's rate x 2 ranks
    assert progress.eta_seconds == pytest.approx(7 * 0.5)  # the checkpoint time is unknown until the first
    assert progress.last_checkpoint_step is None and progress.loss == pytest.approx(1.0)
    assert abs((datetime.now().astimezone() - progress.updated).total_seconds()) < 60
    assert progress.eta is not None and progress.eta >= progress.updated
    assert '"updated": "' in document and document.count('Z"') == 2  # RFC 3339 in UTC

    metrics.checkpoint(step=3, seconds=20.0)  # rewritten at once: the operator sees the checkpoint
    progress = read_progress(progress_file)
    assert progress is not None and progress.last_checkpoint_step == 3
    assert progress.eta_seconds == pytest.approx(7 * 0.5 + 2 * 20.0)  # checkpoints at 5 and 10 remain
    assert sorted(p.name for p in progress_file.parent.iterdir()) == ["progress.json"]  # no temp files left


def test_a_resumed_process_reports_its_checkpoint_and_what_it_set_aside(
    tmp_path: Path, open_metrics: list[TrainerMetrics]
) -> None:
    """Where it resumed from is its last checkpoint until its first save (it was null after a restart), on
    /metrics and in the progress file, with the checkpoints it set aside."""
    progress_file = tmp_path / "progress.json"
    metrics = start(open_metrics, trainer_config(progress_file))
    metrics.started(resumed_from_step=40, set_aside=2)
    feed(metrics, range(41, 43))
    progress = read_progress(progress_file)
    assert progress is not None
    assert (progress.last_checkpoint_step, progress.resumed_from_step, progress.checkpoints_set_aside) == (40, 40, 2)
    _, samples = scrape(metrics)
    assert value(samples, RESUMED_FROM_STEP_METRIC) == 40 and value(samples, SET_ASIDE_METRIC) == 2
    assert value(samples, CHECKPOINT_STEP_METRIC) == 40
    metrics.checkpoint(step=45, seconds=1.0)
    progress = read_progress(progress_file)
    assert progress is not None and (progress.last_checkpoint_step, progress.resumed_from_step) == (45, 40)


def test_eta_counts_the_checkpoints_still_to_come(open_metrics: list[TrainerMetrics]) -> None:
    metrics = start(open_metrics, trainer_config(None))  # a checkpoint every 5 steps and one at the last
    feed(metrics, range(1, 3), total_steps=7)
    metrics.checkpoint(step=2, seconds=10.0)
    _, samples = scrape(metrics)
    assert value(samples, "memfit_train_eta_seconds") == pytest.approx(5 * 0.5 + 2 * 10.0)  # at 5 and 7
    feed(metrics, range(3, 7), total_steps=7)
    _, samples = scrape(metrics)
    assert value(samples, "memfit_train_eta_seconds") == pytest.approx(0.5 + 10.0)  # at 7
    feed(metrics, range(7, 8), total_steps=7)
    _, samples = scrape(metrics)
    assert value(samples, "memfit_train_eta_seconds") == 0


def test_unknown_length_and_nan_loss_are_null(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    progress_file = tmp_path / "progress.json"
    metrics = start(open_metrics, trainer_config(progress_file))
    metrics.step(step=1, total_steps=None, loss=math.nan, learning_rate=1e-5, tokens=10, samples=1, step_seconds=1)
    progress = read_progress(progress_file)
    assert progress is not None
    assert (progress.total_steps, progress.percent, progress.eta_seconds, progress.eta, progress.loss) == (None,) * 5
    assert '"loss": null' in progress_file.read_text()  # valid JSON, not NaN
    _, samples = scrape(metrics)
    assert math.isnan(value(samples, "memfit_train_loss"))  # Prometheus carries NaN as it is
    assert "memfit_train_eta_seconds" not in names(samples)


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    documents = [
        Progress(step=step, total_steps=1000, percent=step / 10, tokens_per_second=1e4, eta_seconds=1000.0 - step,
                 eta=None, last_checkpoint_step=None, loss=1.0, updated=datetime.now().astimezone())
        for step in range(1, 301)
    ]  # fmt: skip
    write_progress(path, documents[0])
    done = threading.Event()
    seen: list[int] = []

    def write_all() -> None:
        for document in documents[1:]:
            write_progress(path, document)
        done.set()

    writer = threading.Thread(target=write_all)
    writer.start()
    while not done.is_set():
        progress = read_progress(path)  # raises on a truncated or half-written document
        assert progress is not None
        seen.append(progress.step)
    writer.join()
    assert seen == sorted(seen) and read_progress(path) == documents[-1]


def test_failed_write_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "progress.json"
    first = Progress(step=1, total_steps=None, percent=None, tokens_per_second=1.0, eta_seconds=None, eta=None,
                     last_checkpoint_step=None, loss=2.0, updated=datetime.now().astimezone())  # fmt: skip
    write_progress(path, first)

    def disk_full(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(progress_module.os, "replace", disk_full)
    with pytest.raises(OSError):
        write_progress(path, first.model_copy(update={"step": 2}))
    assert read_progress(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]


def test_a_failed_progress_write_does_not_stop_training(
    tmp_path: Path,
    open_metrics: list[TrainerMetrics],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = start(open_metrics, trainer_config(tmp_path / "progress.json"))

    def disk_full(path: Path, progress: Progress) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics_module, "write_progress", disk_full)
    feed(metrics, range(1, 3))
    _, samples = scrape(metrics)
    assert value(samples, "memfit_train_step") == 2
    assert "cannot write progress file" in caplog.text
