"""The registry of training engines: the one place the config's ``engine`` picks one.

Each engine lives in its own module behind :class:`~memfit_trainer.training_engine.TrainingEngine`: DeepSpeed's
(:mod:`memfit_trainer.deepspeed_engine`) and PyTorch's FSDP2 (:mod:`memfit_trainer.fsdp2_engine`); what both
share is in :mod:`memfit_trainer.optimization`. A new engine is a module with a builder and a process-group
starter, and a line in each registry here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from memfit.api.vocabulary import Engine
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.deepspeed_engine import build_deepspeed_engine, init_deepspeed_process_group
from memfit_trainer.fsdp2_engine import build_fsdp2_engine, init_fsdp2_process_group
from memfit_trainer.training_engine import TrainingEngine


class EngineBuilder(Protocol):
    def __call__(
        self, config: TrainerConfig, model: torch.nn.Module, total_steps: int, *, converted: bool = False
    ) -> TrainingEngine:
        """The engine over ``model`` for a run of ``total_steps`` optimizer steps; ``converted``: it will load
        a universal checkpoint converted from another layout's (:meth:`TrainingEngine.load_converted`)."""


ENGINES: dict[Engine, EngineBuilder] = {
    Engine.DEEPSPEED: build_deepspeed_engine,
    Engine.FSDP2: build_fsdp2_engine,
}


PROCESS_GROUPS: dict[Engine, Callable[[], None]] = {
    Engine.DEEPSPEED: init_deepspeed_process_group,
    Engine.FSDP2: init_fsdp2_process_group,
}
"""How each engine starts the default process group (before the model is built)."""


def init_process_group(config: TrainerConfig) -> None:
    PROCESS_GROUPS[config.engine.kind]()


def build_engine(
    config: TrainerConfig, model: torch.nn.Module, total_steps: int, *, converted: bool = False
) -> TrainingEngine:
    """The config's engine over ``model`` (see :class:`EngineBuilder`)."""
    return ENGINES[config.engine.kind](config, model, total_steps, converted=converted)
