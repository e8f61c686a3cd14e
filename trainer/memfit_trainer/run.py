"""The record of one run that the loop, the resume and the techniques share, in place of long parameter lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.checkpoint import CheckpointManager
from memfit_trainer.data import PackedBatches
from memfit_trainer.model import trains_adapters
from memfit_trainer.training_engine import TrainingEngine


class Ranks(NamedTuple):
    """Where this process stands in the job (torchrun's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``)."""

    rank: int
    local_rank: int
    world_size: int


@dataclass(frozen=True)
class Run:
    """A run once its engine is built: what it trains, on which ranks, from which batches, saved where."""

    config: TrainerConfig
    ranks: Ranks
    engine: TrainingEngine
    manager: CheckpointManager
    batches: PackedBatches

    @property
    def lora(self) -> bool:
        """Whether only adapters train (LoRA, QLoRA): the frozen base is neither saved nor loaded strictly."""
        return trains_adapters(self.config.training.method)
