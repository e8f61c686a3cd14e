"""The training engine as the loop sees it: one protocol that DeepSpeed's adapter and the fsdp2 engine implement.

The loop, the resume, the techniques and the export speak to an engine only through :class:`TrainingEngine`,
in memfit's terms (a checkpoint is a directory, a converted checkpoint is loaded by :meth:`load_converted`), so
that no DeepSpeed keyword and no branch on the engine kind is left outside the engine modules. The registry
of engines is :data:`memfit_trainer.engine.ENGINES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch


class TrainingEngine(Protocol):
    """A model wrapped for training: forward, backward, optimizer step, checkpoints and the final weights."""

    module: torch.nn.Module
    """The wrapped model (a peft model for LoRA and QLoRA): what the techniques hook and the export saves."""
    device: torch.device
    """Where the batches go."""

    def __call__(self, **inputs: torch.Tensor) -> Any:
        """The model's forward pass (a ``transformers`` model output)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss (scaled for the accumulation)."""

    def step(self) -> None:
        """After each micro-batch's backward: at the accumulation boundary the optimizer and the LR schedule step."""

    @property
    def learning_rate(self) -> float:
        """The learning rate of the last optimizer step."""

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step, where the engine computed one (to clip it)."""

    def save_checkpoint(self, directory: Path) -> None:
        """Collective: write the training state (model, optimizer, LR schedule) into ``directory``."""

    def load_checkpoint(self, directory: Path) -> bool:
        """Collective: load the state :meth:`save_checkpoint` wrote into ``directory``; whether any was there."""

    def load_converted(self, universal: Path) -> bool:
        """Collective: load the universal checkpoint of another layout's (:mod:`memfit_trainer.convert`) written
        into ``universal``; whether any was there."""

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full state dict the export saves on rank 0, or ``None`` where the module's own is it."""
