"""The validation loss: held-out records, packed like the training data, evaluated on every rank's shard.

The held-out records are either a ``fraction`` of the training records, chosen by the seed alone (so every
rank, every restart and every world size holds out the same ones, and none of them is ever trained on), or
files of their own (``path``, same format and fields). They go through the training data's own tokenising,
masking and packing (:class:`~memfit_trainer.data.PackedBatches`), unshuffled and sharded across ranks as
training is; incomplete global micro-steps are dropped there too.

An evaluation runs every ``everySteps`` optimizer steps and after the last, collectively: each rank sums its
micro-batches' losses weighted by their target tokens, the sums are reduced across ranks, and the mean over
all target tokens is reported. It runs under ``torch.no_grad()`` in eval mode (each module's own mode is put
back afterwards) inside a forked RNG, so the weights and the training's random numbers are exactly what they
would have been without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from memfit.contract.sections import ValidationConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.blocks import IGNORE_INDEX
from memfit_trainer.chunked_loss import shift_labels
from memfit_trainer.console import ConsoleProgress
from memfit_trainer.data import (
    BatchShape,
    DataError,
    DatasetTooSmallError,
    DataSource,
    PackedBatches,
    build_batches,
    load_records,
)
from memfit_trainer.metrics import TrainerMetrics

SPLIT_SALT = 0x76616C
"""Mixed into the split's seed so that the held-out choice is not the block shuffle's stream (``[seed, epoch]``)."""

LossFunction = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def split_records(records: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """``(training, held out)`` of a map-style ``datasets`` Dataset: ``round(fraction x records)`` records
    drawn by ``seed``, each part in the records' own order."""
    total = len(records)
    held = round(fraction * total)
    if not 1 <= held < total:
        raise DataError(
            f"validation.fraction {fraction} of {total} record(s) holds out {held}: it must leave at least one "
            "record for validation and one for training"
        )
    order = np.random.default_rng([SPLIT_SALT, seed]).permutation(total)
    return records.select(np.sort(order[held:])), records.select(np.sort(order[:held]))


def _packed(records: Any, tokenizer: Any, source: DataSource, shape: BatchShape, *, shuffle: bool) -> PackedBatches:
    return PackedBatches(records, tokenizer, source, shape, shuffle=shuffle)


@dataclass(frozen=True)
class HeldOut:
    """The validation batches and how often to evaluate them."""

    batches: PackedBatches
    every_steps: int


def _held_out(
    records: Any, tokenizer: Any, source: DataSource, shape: BatchShape, validation: ValidationConfig, what: str
) -> HeldOut:
    try:
        return HeldOut(_packed(records, tokenizer, source, shape, shuffle=False), validation.every_steps)
    except DatasetTooSmallError as error:
        raise DatasetTooSmallError(f"the validation data ({what}): {error}") from error


def training_and_validation(
    source: DataSource, tokenizer: Any, validation: ValidationConfig | None, shape: BatchShape
) -> tuple[PackedBatches, HeldOut | None]:
    """The training batches and, when the config asks for a validation loss, the held-out ones."""
    if validation is None:
        return build_batches(source, tokenizer, shape), None
    if validation.path is not None:
        own = replace(source, path=validation.path)
        training = build_batches(source, tokenizer, shape)
        try:
            records = load_records(own)
        except FileNotFoundError as error:
            raise DataError(f"data.validation.path: {error}") from error
        return training, _held_out(records, tokenizer, own, shape, validation, validation.path)
    assert validation.fraction is not None  # the config holds exactly one of the two
    if source.streaming:
        raise DataError("validation.fraction needs a dataset loaded whole; a streamed one needs validation.path")
    kept, held = split_records(load_records(source), validation.fraction, shape.seed)
    what = f"validation.fraction {validation.fraction} of {source.path!r}"
    training = _packed(kept, tokenizer, source, shape, shuffle=True)
    return training, _held_out(held, tokenizer, source, shape, validation, what)


def config_data(
    config: TrainerConfig, tokenizer: Any, rank: int, world_size: int
) -> tuple[PackedBatches, HeldOut | None]:
    """The training batches and, with ``data.validation``, the held-out ones, as rank ``rank`` of
    ``world_size`` builds them from the trainer config (the loop's, and memfit_trainer.launch_check's): the ranks
    of a sequence-parallel group build the same ones (each trains on its chunk of them)."""
    training = config.training
    sp = training.sequence_parallel
    shape = BatchShape(training.sequence_length, training.micro_batch_size, rank // sp, world_size // sp, training.seed)
    try:
        return training_and_validation(DataSource.from_config(config.data), tokenizer, config.data.validation, shape)
    except FileNotFoundError as error:  # a data directory without data files
        raise DataError(f"data.path: {error}") from error


def one_pass(batches: PackedBatches) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's validation micro-batches, once through (the position rolls to epoch 1 after the last)."""
    for position, batch in batches.iterate():
        yield batch
        if position.epoch > 0:
            return


@dataclass(frozen=True)
class ValidationResult:
    step: int
    loss: float
    """Mean loss over all ranks' validation target tokens."""
    tokens: int
    """Target tokens it is the mean over."""
    seconds: float


class Validation:
    """Evaluates the validation loss of the model behind ``loss_of`` (the loop's loss: the model's own or
    the chunked one) on this rank's share of ``batches``; collective over all ranks."""

    def __init__(self, held_out: HeldOut, module: torch.nn.Module, loss_of: LossFunction, device: torch.device) -> None:
        self.batches = held_out.batches
        self.every_steps = held_out.every_steps
        self.module = module
        self.loss_of = loss_of
        self.device = device

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every_steps == 0 or step == total_steps

    def evaluate(self, step: int) -> ValidationResult:
        started = time.monotonic()
        modes = {module: module.training for module in self.module.modules()}
        devices = [self.device] if self.device.type == "cuda" else []
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x targets, targets
        try:
            self.module.eval()
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for batch in one_pass(self.batches):
                    on_device = {k: v.to(self.device) for k, v in batch.items()}
                    targets = (shift_labels(on_device["labels"]) != IGNORE_INDEX).sum()
                    # Every rank runs every forward (ZeRO-3 and FSDP2 gather weights collectively); a micro-batch
                    # without targets has no mean loss and adds nothing.
                    mean = self.loss_of(on_device).double()
                    totals[0] += torch.where(targets > 0, mean * targets, 0.0)
                    totals[1] += targets
        finally:
            for module, training in modes.items():
                module.train(training)
        dist.all_reduce(totals)
        loss_sum, tokens = totals.tolist()
        loss = loss_sum / tokens if tokens else float("nan")
        return ValidationResult(step=step, loss=loss, tokens=int(tokens), seconds=time.monotonic() - started)


def report_validation(result: ValidationResult, metrics: TrainerMetrics, progress: ConsoleProgress) -> None:
    """One console line (rank 0), the metrics and the progress file; the pass's time is left out of tokens/s."""
    metrics.validation(step=result.step, loss=result.loss, seconds=result.seconds)
    progress.exclude(result.seconds)
    progress.message(
        f"validation step {result.step}/{progress.total_steps} loss {result.loss:.4f} tokens {result.tokens} "
        f"({result.seconds:.1f} s)"
    )
