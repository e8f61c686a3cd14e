"""What both training engines share: the run's length in optimizer steps, the learning-rate schedule and the
optimizers memfit builds itself.

A leaf module (it imports neither engine), so that the DeepSpeed and the fsdp2 engine can both use it without
an import circle. The schedule is linear warmup over ``warmup_ratio`` of the steps, then cosine decay to zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Optimizer
from memfit.contract.reader import ConfigError
from memfit.contract.sections import TrainingConfig


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


def client_optimizer(
    training: TrainingConfig, params: Iterable[torch.nn.Parameter], *, sharded: bool = False
) -> torch.optim.Optimizer:
    """The optimizer memfit builds: every one on fsdp2 (``sharded``: over its DTensor shards), those DeepSpeed
    does not build itself on DeepSpeed."""
    lr, weight_decay = training.learning_rate, training.weight_decay
    if training.optimizer in EIGHT_BIT_OPTIMIZERS:
        cls = _eight_bit_class(training.optimizer, sharded)
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


def _eight_bit_class(optimizer: Optimizer, sharded: bool) -> Callable[..., torch.optim.Optimizer]:
    """bitsandbytes' 8-bit AdamW, paged or not, on plain tensors or (``sharded``) on FSDP2's local shards."""
    paged = optimizer == Optimizer.PAGED_ADAMW_8BIT
    if sharded:
        from memfit_trainer.sharded_adamw8bit import ShardedAdamW8bit, ShardedPagedAdamW8bit

        return ShardedPagedAdamW8bit if paged else ShardedAdamW8bit
    from bitsandbytes.optim.adamw import AdamW8bit, PagedAdamW8bit

    return PagedAdamW8bit if paged else AdamW8bit
