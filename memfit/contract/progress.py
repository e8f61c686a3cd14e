"""The progress contract between the trainer and the operator.

Rank 0 rewrites ``metrics.progressFile``, where the config names one (``memfit run --local`` does), after every
optimizer step, checkpoint and validation. The file is replaced atomically (a temporary file in the same
directory, then ``os.replace``), so a reader sees either the previous complete document or the new one, never
a partial one. It is not fsynced: after a node crash it may be a step or two stale, which is all a progress
report needs. Local runs read it (``read_progress`` / ``parse_progress``); in the cluster the operator asks
for no file and scrapes the same numbers from rank 0's ``/metrics`` (``memfit_train_step``,
``memfit_train_total_steps``, ``memfit_train_progress_ratio``, ``memfit_train_eta_seconds``,
``memfit_validation_loss``, ``memfit_validation_step``, ``memfit_checkpoint_resumed_from_step``,
``memfit_checkpoints_set_aside``).

One JSON object, camelCase keys, every key always present (``null`` where unknown; documents written before
the validation and resume keys existed read as ``null``, and 0 set aside, for them)::

    {
      "step": 120,                     # optimizer steps completed
      "totalSteps": 1000,              # null when the run's length is unknown (e.g. streaming data)
      "percent": 12.0,                 # 100 * step / totalSteps, null without totalSteps
      "tokensPerSecond": 5321.7,       # whole job, estimated as rank 0's recent rate x world size
      "etaSeconds": 3270.4,            # remaining steps (and checkpoints) at the recent pace; null without totalSteps
      "eta": "2025-01-01T13:00:00Z",   # RFC 3339, UTC: updated + etaSeconds; null without totalSteps
      "lastCheckpointStep": 100,       # last checkpoint this process saved, or resumed from before its first save
      "resumedFromStep": 100,          # the checkpoint this process resumed from (null: it started from the weights)
      "checkpointsSetAside": 0,        # newer checkpoints this process set aside as unusable before resuming
      "loss": 1.83,                    # training loss of the last step, null if it was NaN or infinite
      "validationLoss": 1.91,          # mean loss over the validation target tokens at validationStep; null
                                       # until this process's first evaluation (or if it was NaN or infinite)
      "validationStep": 100,           # the step the validation loss was computed at; null until the first
      "updated": "2025-01-01T12:05:30Z"  # RFC 3339, UTC: when rank 0 wrote this
    }

It imports only pydantic, the standard library and memfit's core, so the operator can use it without torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pydantic import AwareDatetime, Field, NonNegativeFloat, NonNegativeInt

from memfit.api.base import ApiModel

STEP_METRIC = "memfit_train_step"
TOTAL_STEPS_METRIC = "memfit_train_total_steps"
ETA_METRIC = "memfit_train_eta_seconds"
TOKENS_PER_SECOND_METRIC = "memfit_train_tokens_per_second"
CHECKPOINT_STEP_METRIC = "memfit_checkpoint_last_step"
VALIDATION_LOSS_METRIC = "memfit_validation_loss"
VALIDATION_STEP_METRIC = "memfit_validation_step"
RESUMED_FROM_STEP_METRIC = "memfit_checkpoint_resumed_from_step"
SET_ASIDE_METRIC = "memfit_checkpoints_set_aside"
"""The series of rank 0's /metrics the operator reads progress from."""


class Progress(ApiModel):
    """Where a training run is: rank 0's view after its last step."""

    step: NonNegativeInt
    total_steps: NonNegativeInt | None
    percent: float | None = Field(ge=0)
    tokens_per_second: NonNegativeFloat
    eta_seconds: NonNegativeFloat | None
    eta: AwareDatetime | None
    last_checkpoint_step: NonNegativeInt | None
    loss: float | None
    validation_loss: float | None = None
    validation_step: NonNegativeInt | None = None
    resumed_from_step: NonNegativeInt | None = None
    checkpoints_set_aside: NonNegativeInt = 0
    updated: AwareDatetime

    def to_json(self) -> str:
        """The document as written to the progress file (all keys, ``null`` for unknowns)."""
        return self.model_dump_json(by_alias=True, indent=2) + "\n"


def write_progress(path: str | Path, progress: Progress) -> None:
    """Replace ``path`` with ``progress`` in one rename, so readers never see a half-written file."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(progress.to_json())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def parse_progress(text: str) -> Progress:
    """Validate a progress document (e.g. read from the pod with ``cat``)."""
    return Progress.model_validate_json(text)


def read_progress(path: str | Path) -> Progress | None:
    """The last progress rank 0 wrote, or None before its first step (no file yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    return parse_progress(text)
