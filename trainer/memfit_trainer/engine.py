"""The DeepSpeed engine: optimizer, learning-rate schedule and the run's length in optimizer steps.

AdamW and Lion are built by DeepSpeed from its section's ``config`` (fused kernels on GPU, DeepSpeedCPUAdam under
optimizer offload). The others are built here and handed over as client optimizers, which DeepSpeed only
accepts with ``zero_allow_untested_optimizer`` and, under optimizer offload, ``zero_force_ds_cpu_optimizer:
false`` (otherwise it refuses anything but its own CPU Adam). The schedule is linear warmup over
``warmup_ratio`` of the steps, then cosine decay to zero; DeepSpeed steps it at each optimizer step and
saves it in its checkpoints.

With ``training.masterWeights: bf16`` (pure bf16) the precision section decides what the optimizer updates
(``memfit.contract.trainer_config.precision_section``): DeepSpeed's bf16 master partitions under ZeRO 1-3; at
ZeRO-0 no section, so that DeepSpeed hands every optimizer, its own or a client one, the model's bf16
parameters themselves (and clips their gradients itself).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Engine, Offload, Optimizer
from memfit.contract.engines import DeepSpeedEngineSection, precision_section
from memfit.contract.reader import ConfigError
from memfit.contract.sections import TrainingConfig
from memfit.contract.trainer_config import TrainerConfig


def total_optimizer_steps(training: TrainingConfig, micro_batches_per_epoch: int | None) -> int:
    """``max_steps``, or the optimizer steps that ``epochs`` passes over this rank's micro-batches make."""
    if training.max_steps is not None:
        return training.max_steps
    if micro_batches_per_epoch is None:
        raise ConfigError("streaming data has no known epoch length: set training.maxSteps")
    assert training.epochs is not None  # TrainingConfig requires epochs or maxSteps
    steps = training.epochs * micro_batches_per_epoch // training.gradient_accumulation_steps
    if steps < 1:
        raise ConfigError(
            f"{training.epochs} epoch(s) of {micro_batches_per_epoch} micro-batch(es) per rank make no full "
            f"optimizer step of {training.gradient_accumulation_steps} accumulated micro-batches"
        )
    return steps


def warmup_cosine(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """LR multiplier after ``step`` optimizer steps: linear warmup to 1, then cosine decay to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def client_optimizer(training: TrainingConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizers DeepSpeed does not build itself."""
    lr, weight_decay = training.learning_rate, training.weight_decay
    if training.optimizer in EIGHT_BIT_OPTIMIZERS:
        from bitsandbytes.optim.adamw import AdamW8bit, PagedAdamW8bit

        cls = AdamW8bit if training.optimizer == Optimizer.ADAMW_8BIT else PagedAdamW8bit
        return cls(params, lr=lr, weight_decay=weight_decay)
    if training.optimizer == Optimizer.ADAFACTOR:
        from transformers.optimization import Adafactor

        # A fixed external schedule (ours), not Adafactor's own relative step sizes.
        return Adafactor(  # type: ignore[no-untyped-call]  # transformers' Adafactor.__init__ is unannotated
            params, lr=lr, weight_decay=weight_decay, scale_parameter=False, relative_step=False, warmup_init=False
        )
    if training.optimizer == Optimizer.LION:
        from bitsandbytes.optim.lion import Lion

        # bitsandbytes' optimizers have unannotated constructors.
        return Lion(params, lr=lr, weight_decay=weight_decay)  # type: ignore[no-untyped-call]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def engine_config(config: TrainerConfig, client: bool) -> dict[str, Any]:
    """The DeepSpeed section's config plus what this run needs: the flags a client optimizer requires, and what the
    training section decides where the DeepSpeed section leaves it out (batch sizes, clipping, precision and
    master weights, as ``memfit.render.deepspeed`` renders them; where it gives them, the config's validation
    made sure they agree)."""
    training = config.training
    deepspeed = config.engine
    assert isinstance(deepspeed, DeepSpeedEngineSection)
    ds = copy.deepcopy(deepspeed.config)
    ds.setdefault("train_micro_batch_size_per_gpu", training.micro_batch_size)
    ds.setdefault("gradient_accumulation_steps", training.gradient_accumulation_steps)
    ds.setdefault("train_batch_size", training.global_batch_size)
    ds.setdefault("gradient_clipping", training.max_grad_norm)
    if not deepspeed.names_precision:
        # With bf16 masters at ZeRO-0 there is none on purpose: the optimizer updates the bf16 weights themselves.
        section = precision_section(training.precision, training.master_weights, deepspeed.zero_stage)
        if section is not None:
            ds[str(training.precision)] = section
    if client:
        ds["zero_allow_untested_optimizer"] = True
        if deepspeed.offload_optimizer != Offload.NONE:
            ds["zero_force_ds_cpu_optimizer"] = False
    return ds


def build_engine(config: TrainerConfig, model: torch.nn.Module, total_steps: int) -> tuple[Any, Any]:
    """``(engine, lr_scheduler)`` for ``model``; the scheduler is stepped and checkpointed by the engine.

    The one place the engine is chosen: DeepSpeed, or with ``engine: fsdp2``
    :class:`memfit_trainer.fsdp2_engine.Fsdp2Engine`, which offers the same surface to the loop."""
    if config.engine.kind == Engine.FSDP2:
        from memfit_trainer.fsdp2_engine import build_fsdp2_engine

        return build_fsdp2_engine(config, model, total_steps)
    import deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if config.engine.builds_optimizer else client_optimizer(config.training, params)
    schedule = warmup_cosine(total_steps, config.training.warmup_ratio)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=lambda opt: LambdaLR(opt, schedule),
        config=engine_config(config, client=optimizer is not None),
    )
    return engine, scheduler
