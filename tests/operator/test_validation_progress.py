"""The validation loss in ``status.progress``: read from rank 0's /metrics, kept across a trainer restart
that has not evaluated yet."""

from __future__ import annotations

import math

from memfit.api.finetunejob import Progress
from memfit.contract.progress import STEP_METRIC, VALIDATION_LOSS_METRIC, VALIDATION_STEP_METRIC
from tests.operator.test_progress_and_metrics import FULL, NOW, exposition, parsed
from tests.operator.test_reconcile import FakeCluster, cluster

__all__ = ["cluster"]  # the fixture, used by name


def test_rank_0s_validation_loss_and_step() -> None:
    text = exposition({"0": FULL | {VALIDATION_LOSS_METRIC: 1.875, VALIDATION_STEP_METRIC: 100},
                       "1": {STEP_METRIC: 120, VALIDATION_LOSS_METRIC: 9.0, VALIDATION_STEP_METRIC: 50}})  # fmt: skip
    progress = parsed(text, world_size=2, now=NOW)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (1.875, 100)


def test_no_validation_yet_is_null() -> None:
    progress = parsed(exposition({"0": FULL}), world_size=2, now=NOW)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (None, None)


def test_a_nan_validation_loss_is_null_with_its_step() -> None:
    text = exposition({"0": FULL | {VALIDATION_LOSS_METRIC: math.nan, VALIDATION_STEP_METRIC: 100}})
    progress = parsed(text, world_size=2, now=NOW)
    assert progress is not None and (progress.validation_loss, progress.validation_step) == (None, 100)


def test_status_keeps_the_last_validation_until_the_next(cluster: FakeCluster) -> None:
    cluster.launch_running()
    status = cluster.step(
        Progress(step=120, total_steps=1000, percent=12, validation_loss=1.5, validation_step=100)
    ).status
    assert status.progress is not None and (status.progress.validation_loss, status.progress.validation_step) == (
        1.5,
        100,
    )
    assert cluster.raw_status["progress"]["validationLoss"] == 1.5
    assert cluster.raw_status["progress"]["validationStep"] == 100
    # A restarted trainer that has not evaluated yet: the last validation known stays.
    status = cluster.step(Progress(step=130, total_steps=1000, percent=13)).status
    assert status.progress is not None and status.progress.step == 130
    assert (status.progress.validation_loss, status.progress.validation_step) == (1.5, 100)
    # The next evaluation replaces it.
    status = cluster.step(
        Progress(step=200, total_steps=1000, percent=20, validation_loss=1.25, validation_step=200)
    ).status
    assert status.progress is not None and (status.progress.validation_loss, status.progress.validation_step) == (
        1.25,
        200,
    )
