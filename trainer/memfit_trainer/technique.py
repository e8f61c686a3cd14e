"""Training techniques that install themselves on a run (sequence parallelism, the chunked loss, activation
offloading).

A technique is a function ``install(run)`` in its own module: it reads its switch in the config and returns
``None`` where it is off, else what it changes (:class:`Installed`). The loop calls every technique of its
``TECHNIQUES`` list once, before the first step, so a new technique is its module and one line in that list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from memfit_trainer.run import Run

Batch = dict[str, torch.Tensor]
"""A micro-batch: the model's inputs and labels (:func:`memfit_trainer.data.model_inputs`)."""
BatchLoss = Callable[[Batch], torch.Tensor]
"""A micro-batch's loss (the batch already on the engine's device)."""


@dataclass(frozen=True)
class Installed:
    """What an installed technique changes of the run, and what it says about itself."""

    said: str
    """One line for the log, when installed."""
    loss: BatchLoss | None = None
    """The micro-batch's loss in place of the model's own."""
    around: Callable[[BatchLoss], BatchLoss] | None = None
    """Wraps whichever loss the techniques chose: what happens to the batch before it (sequence parallelism
    shards it) and to its value after."""
    summary: Callable[[], str] | None = None
    """One line for the log at the end of the run."""


class Technique(Protocol):
    def __call__(self, run: Run) -> Installed | None:
        """Install on ``run`` where the config asks for it (once, before the first step)."""
