"""The training loop: resume, step, checkpoint, export.

One optimizer step is ``gradient_accumulation_steps`` micro-batches through ``engine.backward`` and
``engine.step`` (DeepSpeed applies the update, the clipping and the LR schedule at the boundary). Every
``checkpointEverySteps`` optimizer steps, and at the end, the full training state is saved with the
:class:`~memfit_trainer.checkpoint.CheckpointManager` protocol: DeepSpeed's shards (model, optimizer, LR
scheduler), the data position in the marker and each rank's RNG state. On start the newest complete
checkpoint is loaded, so a restarted pod continues with exactly the batches and random numbers the
uninterrupted run would have used.

The engine is DeepSpeed's or, with ``engine: fsdp2``, :class:`~memfit_trainer.fsdp2_engine.Fsdp2Engine` (chosen
in :func:`~memfit_trainer.engine.build_engine`), which offers the loop the same calls and writes
``torch.distributed.checkpoint`` shards that load at any world size. The marker also records the world size
and micro-batch size the data position counts in (``dataShape``): a checkpoint written at another world size
resumes at the same place in the data (:func:`~memfit_trainer.data.carry_position`). Where this layout's
directory holds no checkpoint, the newest checkpoint another layout wrote is converted where a conversion
exists (:mod:`memfit_trainer.convert`) and saved as this layout's at the same step before training goes on.

Test hooks:

* ``MEMFIT_TEST_INJECT_OOM_AT_STEP=N`` raises ``torch.OutOfMemoryError`` inside optimizer step N on every
  rank, to exercise the out-of-memory path without a GPU;
* ``MEMFIT_TEST_HOLD_AFTER_STEP=N:PATH`` makes every rank wait after optimizer step N (its metrics, progress
  and checkpoint written) until PATH exists, so that a test can scrape, inspect or kill a run that is
  certainly still going, however fast the machine trains.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from memfit.api.vocabulary import Attention, Engine
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.activation_offload import ActivationOffload, offload_activations
from memfit_trainer.checkpoint import Checkpoint, CheckpointManager, fsync_tree, load_rng_state, save_rng_state
from memfit_trainer.chunked_loss import causal_lm_loss, select_kernel, unwrap_causal_lm
from memfit_trainer.console import ConsoleProgress
from memfit_trainer.convert import (
    Conversion,
    ConversionError,
    find_conversion,
    load_universal_into_fsdp2,
    universal_dir,
    universal_loading,
    write_universal,
)
from memfit_trainer.data import DataPosition, DataSource, PackedBatches, carry_position, flash_varlen_kwargs
from memfit_trainer.engine import build_engine, total_optimizer_steps
from memfit_trainer.export import save_final
from memfit_trainer.metrics import TrainerMetrics
from memfit_trainer.model import build_model, trains_adapters
from memfit_trainer.oom import OomGuard
from memfit_trainer.validation import BatchShape, HeldOut, Validation, report_validation, training_and_validation

CHECKPOINT_TAG = "deepspeed"
INJECT_OOM_ENV = "MEMFIT_TEST_INJECT_OOM_AT_STEP"
HOLD_ENV = "MEMFIT_TEST_HOLD_AFTER_STEP"
HOLD_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    world_size: int


def _inject_oom(step: int) -> None:
    if os.environ.get(INJECT_OOM_ENV) == str(step):
        raise torch.OutOfMemoryError(f"injected by {INJECT_OOM_ENV}={step} (test hook)")


def _hold(step: int) -> None:
    """The ``MEMFIT_TEST_HOLD_AFTER_STEP`` test hook (see the module docstring)."""
    at, _, release = os.environ.get(HOLD_ENV, "").partition(":")
    if at != str(step) or not release:
        return
    while not os.path.exists(release):
        time.sleep(HOLD_POLL_SECONDS)


def _batches(config: TrainerConfig, tokenizer: Any, ranks: Ranks) -> tuple[PackedBatches, HeldOut | None]:
    """The training batches and, with ``data.validation``, the held-out ones (:mod:`memfit_trainer.validation`)."""
    data = config.data
    source = DataSource.from_config(data)
    shape = BatchShape(
        sequence_length=config.training.sequence_length,
        micro_batch_size=config.training.micro_batch_size,
        rank=ranks.rank,
        world_size=ranks.world_size,
        seed=config.training.seed,
    )
    return training_and_validation(source, tokenizer, data.validation, shape)


@dataclass(frozen=True)
class _Start:
    """Where the run starts: its own layout's checkpoint of ``step``, else a conversion of another layout's
    (its universal checkpoint written), else the weights; ``refusal`` says why a newer checkpoint is not used."""

    step: int | None = None
    conversion: Conversion | None = None
    refusal: str | None = None


def _find_start(manager: CheckpointManager, config: TrainerConfig, rank: int) -> _Start:
    """Rank 0 decides (and writes the universal checkpoint of a conversion), shared so that all ranks load the
    same one. A conversion that fails is said in one line and the run starts from the weights."""
    found: list[_Start | None] = [None]
    if rank == 0:
        manager.cleanup_stale()
        latest = manager.latest_complete()
        start = _Start(step=latest.step) if latest is not None else _Start()
        if latest is None:
            search = find_conversion(manager.root, config.layout)
            start = _Start(conversion=search.conversion, refusal=search.refusal)
        if start.conversion is not None:
            source = start.conversion.source
            try:
                partitioned = config.engine.kind == Engine.DEEPSPEED and config.layout.zero_stage == 3
                write_universal(source, CHECKPOINT_TAG, universal_dir(manager, source.step), partitioned)
            except ConversionError as error:
                start = _Start(refusal=f"{str(error).splitlines()[0]}; starting from the weights")
        if start.refusal is not None:
            print(start.refusal, file=sys.stderr, flush=True)
        found = [start]
    dist.broadcast_object_list(found, src=0)
    assert found[0] is not None
    return found[0]


def _check_layout(manager: CheckpointManager, step: int, layout: dict[str, Any]) -> None:
    """Refuse, before any model is built, a checkpoint another layout wrote found in this layout's directory
    (copied by hand: DeepSpeed would fail deep inside its loader with a missing shard file). Conversions are
    made only from the directory of the layout that wrote the checkpoint (memfit_trainer.convert)."""
    checkpoint = next(c for c in manager.complete() if c.step == step)
    written = checkpoint.marker.get("layout")
    if written is not None and written != layout:
        raise ConfigError(
            f"checkpoint {checkpoint.path} was written by another layout ({written}) than this run's ({layout}): "
            "the engine cannot load its shards as they are; move it to its own layout's directory next to this "
            "one (it is then converted where a conversion exists) or start from an empty output directory"
        )


def _load(engine: Any, directory: Path, lora: bool) -> None:
    path, _ = engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_module_strict=not lora)
    if path is None:
        raise RuntimeError(f"the engine found no state in checkpoint {directory}")


def _resume(
    engine: Any, manager: CheckpointManager, step: int, ranks: Ranks, lora: bool, batches: PackedBatches
) -> tuple[DataPosition, str]:
    """Load the checkpoint of ``step``; the data position to go on from, and what to say about it."""
    checkpoint = next(c for c in manager.complete() if c.step == step)
    _load(engine, checkpoint.path, lora)
    load_rng_state(checkpoint.path, ranks.rank)
    return _carried_position(checkpoint, batches)


def _resume_converted(
    engine: Any, kind: Engine, conversion: Conversion, manager: CheckpointManager, ranks: Ranks, lora: bool,
    batches: PackedBatches,
) -> tuple[DataPosition, str]:  # fmt: skip
    """Load the universal checkpoint rank 0 wrote of ``conversion`` into the engine of ``kind`` (collective);
    the RNG state of the source where it has this rank's, the data position carried from the source's."""
    scratch = universal_dir(manager, conversion.source.step)
    if kind == Engine.FSDP2:
        load_universal_into_fsdp2(engine, scratch, CHECKPOINT_TAG, lora)
    else:
        _load(engine, scratch, lora)
    load_rng_state(conversion.source.path, ranks.rank)
    position, said = _carried_position(conversion.source, batches)
    return position, f"{conversion.describe()}: {said}"


def _carried_position(checkpoint: Checkpoint, batches: PackedBatches) -> tuple[DataPosition, str]:
    """The checkpoint's data position, carried to this run's world size and micro-batch size."""
    position = DataPosition.from_dict(checkpoint.data_position)
    said = f"data position {position.to_dict()}"
    shape = checkpoint.marker.get("dataShape")
    if shape is None:
        return position, said
    # Written at another world size (the fsdp2 engine's checkpoints load at any): the same blocks consumed.
    then = int(shape["worldSize"]) * int(shape["microBatchSize"])
    position, skipped = carry_position(position, then, batches.blocks_per_step)
    per_epoch = batches.micro_batches_per_epoch
    if per_epoch is not None and position.micro_batch > per_epoch:
        position = DataPosition(position.epoch + 1, 0)
    if then != batches.blocks_per_step:
        said += f" written at {shape['worldSize']} rank(s) x micro-batch {shape['microBatchSize']}, here "
        said += f"{position.to_dict()} ({skipped} block(s) skipped)"
    return position, said


def _save_checkpoint(
    engine: Any,
    manager: CheckpointManager,
    step: int,
    position: DataPosition,
    ranks: Ranks,
    keep: int,
    lora: bool,
    layout: dict[str, Any],
    micro_batch_size: int,
    converted_from: dict[str, Any] | None = None,
) -> None:
    """The multi-rank protocol of :mod:`memfit_trainer.checkpoint` (collective); ``converted_from`` recorded
    in the marker of a checkpoint converted from another layout's."""
    if ranks.rank == 0:
        manager.prepare(step)
    dist.barrier()
    tmp = manager.temp_dir(step)
    engine.save_checkpoint(str(tmp), tag=CHECKPOINT_TAG, save_latest=False, exclude_frozen_parameters=lora)
    save_rng_state(tmp, ranks.rank)
    fsync_tree(tmp)
    dist.barrier()
    if ranks.rank == 0:
        shape = {"worldSize": ranks.world_size, "microBatchSize": micro_batch_size}
        origin = {} if converted_from is None else {"convertedFrom": converted_from}
        manager.commit(step, {"dataPosition": position.to_dict(), "dataShape": shape, "layout": layout, **origin})
        manager.prune(keep)
    dist.barrier()


def _mean_across_ranks(value: torch.Tensor) -> float:
    """Reduced where the loss is: NCCL reduces only device tensors (gloo reduces host and device ones)."""
    value = value.detach().float()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _loss_function(
    config: TrainerConfig, engine: Any, device: torch.device, progress: ConsoleProgress
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The micro-batch's loss: the model's own (``outputs.loss``), or with ``training.chunked_loss`` the
    chunked cross-entropy with the LM head inside it (its implementation chosen here, once, and logged).
    The config refuses the chunked loss under ZeRO-3, where the head's weight is partitioned. With flash
    attention a packed batch also carries its documents' boundaries (:func:`~memfit_trainer.data.flash_varlen_kwargs`).
    """
    if not config.training.chunked_loss:
        loss_of: Callable[[dict[str, Any]], torch.Tensor] = lambda batch: cast(torch.Tensor, engine(**batch).loss)  # noqa: E731
    else:
        name, kernel = select_kernel(device)
        progress.message(f"loss: chunked cross-entropy ({name})")
        causal_lm = unwrap_causal_lm(engine)
        loss_of = lambda batch: causal_lm_loss(engine, causal_lm, batch, kernel)  # noqa: E731
    if config.training.attention != Attention.FLASH:
        return loss_of
    return lambda batch: loss_of(
        {**batch, **flash_varlen_kwargs(batch["position_ids"])} if "position_ids" in batch else batch
    )


def _activation_offload(config: TrainerConfig, engine: Any, progress: ConsoleProgress) -> ActivationOffload | None:
    """With ``training.activation_offloading``, the checkpointed layers' saved inputs wait in pinned host
    memory between forward and backward (installed once on the model, said in the log, with what moved at
    the end). The config refuses it without gradient checkpointing."""
    if not config.training.activation_offloading:
        return None
    offload = offload_activations(engine.module)
    progress.message(offload.describe())
    return offload


def train(config: TrainerConfig, ranks: Ranks, metrics: TrainerMetrics, guard: OomGuard) -> None:
    """Run (or finish) the training the config describes; collective over all ranks.

    The caller runs this inside ``with guard:`` (one guard for the whole run: nesting guards would report
    the inner guard's exit as a second OOM); the loop keeps ``guard.step`` at the step in progress.
    """
    training = config.training
    lora = trains_adapters(training.method)
    layout = config.layout.to_dict()
    manager = CheckpointManager(config.checkpoint_dir)
    if ranks.rank == 0:
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    start = _find_start(manager, config, ranks.rank)
    if start.step is not None:
        _check_layout(manager, start.step, layout)

    built = build_model(config, ranks.local_rank)
    batches, held_out = _batches(config, built.tokenizer, ranks)
    total = total_optimizer_steps(training, batches.micro_batches_per_epoch)
    converted_into = config.engine.kind == Engine.DEEPSPEED and start.conversion is not None
    engine, scheduler = build_engine(universal_loading(config) if converted_into else config, built.model, total)
    progress = ConsoleProgress(total, enabled=ranks.rank == 0)
    progress.message(f"metrics: rank 0 serves /metrics on port {metrics.port}")  # ephemeral under `memfit run --local`
    if batches.statistics is not None:  # what truncation and padding cost, said once (not known when streaming)
        progress.message(batches.statistics.describe())
    position, step = DataPosition(), 0
    if start.step is not None:
        (position, said), step = _resume(engine, manager, start.step, ranks, lora, batches), start.step
        progress.message(f"resumed from checkpoint step {step} ({said})")
    elif start.conversion is not None:
        step = start.conversion.source.step
        position, said = _resume_converted(engine, config.engine.kind, start.conversion, manager, ranks, lora, batches)
        _save_checkpoint(engine, manager, step, position, ranks, training.keep_checkpoints, lora, layout,
                         training.micro_batch_size, start.conversion.marker())  # fmt: skip
        if ranks.rank == 0:
            shutil.rmtree(universal_dir(manager, step))
        progress.message(f"resumed from checkpoint step {step} ({said})")
    else:
        torch.manual_seed(training.seed + ranks.rank)  # dropout differs per rank, reproducibly

    device = engine.device
    loss_of = _loss_function(config, engine, device, progress)
    offload = _activation_offload(config, engine, progress)
    validation = Validation(held_out, engine.module, loss_of, device) if held_out is not None else None
    accumulation = training.gradient_accumulation_steps
    samples_per_rank = training.micro_batch_size * accumulation  # per optimizer step
    tokens_per_rank = samples_per_rank * training.sequence_length
    stream = batches.iterate(position)
    while step < total:
        started = time.monotonic()
        guard.at(step + 1)  # an OOM from here on is reported as this step's
        loss_sum = torch.zeros((), device=device)
        for _ in range(accumulation):
            position, batch = next(stream)
            loss = loss_of({k: v.to(device) for k, v in batch.items()})
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        _inject_oom(step + 1)
        step += 1
        loss_value = _mean_across_ranks(loss_sum / accumulation)
        seconds = time.monotonic() - started
        learning_rate = float(scheduler.get_last_lr()[0])
        metrics.step(
            step=step,
            total_steps=total,
            loss=loss_value,
            learning_rate=learning_rate,
            tokens=tokens_per_rank,
            samples=samples_per_rank,
            step_seconds=seconds,
        )
        progress.step(step, loss_value, learning_rate, tokens_per_rank * ranks.world_size)
        if validation is not None and validation.due(step, total):
            report_validation(validation.evaluate(step), metrics, progress)
        if step % training.checkpoint_every_steps == 0 or step == total:
            started = time.monotonic()
            _save_checkpoint(engine, manager, step, position, ranks, training.keep_checkpoints, lora, layout,
                             training.micro_batch_size)  # fmt: skip
            metrics.checkpoint(step=step, seconds=time.monotonic() - started)
        _hold(step)
    if offload is not None:
        progress.message(offload.summary())
    save_final(engine, built.tokenizer, config.final_dir, rank=ranks.rank, lora=lora)
    progress.message(f"done: step {step}/{total}, final output in {config.final_dir}")
