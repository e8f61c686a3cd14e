"""The validation loss as reported: Prometheus series on every rank, the progress file on rank 0 (null until
the first evaluation), and progress documents written before the validation keys existed still read."""

from __future__ import annotations

import json
import math
from pathlib import Path

from memfit.contract.progress import VALIDATION_LOSS_METRIC, VALIDATION_STEP_METRIC, parse_progress, read_progress
from memfit_trainer.metrics import TrainerMetrics
from tests.trainer.test_metrics import feed, names, open_metrics, scrape, start, trainer_config, value

__all__ = ["open_metrics"]  # the fixture, used by name


def test_validation_series_appear_with_the_first_evaluation(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    metrics = start(open_metrics, trainer_config(tmp_path / "progress.json"))
    feed(metrics, range(1, 3))
    _, samples = scrape(metrics)
    assert VALIDATION_LOSS_METRIC not in names(samples) and VALIDATION_STEP_METRIC not in names(samples)
    assert value(samples, "memfit_validation_duration_seconds_count") == 0

    metrics.validation(step=2, loss=1.75, seconds=4.0)
    _, samples = scrape(metrics)
    assert value(samples, VALIDATION_LOSS_METRIC) == 1.75 and value(samples, VALIDATION_STEP_METRIC) == 2
    assert value(samples, "memfit_validation_duration_seconds_sum") == 4.0
    # A validation pass is not training: the tokens/s of the steps stay what they were.
    assert value(samples, "memfit_train_tokens_per_second") == 4 * 4096 / 0.5


def test_progress_file_carries_the_last_validation(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    progress_file = tmp_path / "progress.json"
    metrics = start(open_metrics, trainer_config(progress_file))
    feed(metrics, range(1, 3))
    progress = read_progress(progress_file)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (None, None)
    assert '"validationLoss": null' in progress_file.read_text()

    metrics.validation(step=2, loss=1.75, seconds=4.0)  # rewritten at once
    progress = read_progress(progress_file)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (1.75, 2)
    feed(metrics, range(3, 5))  # later steps keep the last validation
    progress = read_progress(progress_file)
    assert progress is not None and (progress.step, progress.validation_loss, progress.validation_step) == (4, 1.75, 2)

    metrics.validation(step=4, loss=math.nan, seconds=4.0)
    progress = read_progress(progress_file)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (None, 4)
    _, samples = scrape(metrics)
    assert math.isnan(value(samples, VALIDATION_LOSS_METRIC))  # Prometheus carries NaN as it is


def test_a_document_without_the_validation_keys_still_reads(tmp_path: Path, open_metrics: list[TrainerMetrics]) -> None:
    progress_file = tmp_path / "progress.json"
    feed(start(open_metrics, trainer_config(progress_file)), range(1, 3))
    document = json.loads(progress_file.read_text())
    older = {key: v for key, v in document.items() if key not in ("validationLoss", "validationStep")}
    progress = parse_progress(json.dumps(older))
    assert progress.step == 2 and (progress.validation_loss, progress.validation_step) == (None, None)
