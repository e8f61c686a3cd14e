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
resumes at the same place in the data (:func:`~memfit_trainer.data.carry_position`).

Test hooks:

* ``MEMFIT_TEST_INJECT_OOM_AT_STEP=N`` raises ``torch.OutOfMemoryError`` inside optimizer step N on every
  rank, to exercise the out-of-memory path without a GPU;
* ``MEMFIT_TEST_HOLD_AFTER_STEP=N:PATH`` makes every rank wait after optimizer step N (its metrics, progress
  and checkpoint written) until PATH exists, so that a test can scrape, inspect or kill a run that is
  certainly still going, however fast the machine trains.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from memfit.api.vocabulary import Method
from memfit.contract.trainer_config import ConfigError, TrainerConfig
from memfit_trainer.activation_offload import ActivationOffload, offload_activations
from memfit_trainer.checkpoint import CheckpointManager, fsync_tree, load_rng_state, save_rng_state
from memfit_trainer.chunked_loss import causal_lm_loss, select_kernel, unwrap_causal_lm
from memfit_trainer.console import ConsoleProgress
from memfit_trainer.data import DataPosition, DataSource, PackedBatches, build_batches, carry_position
from memfit_trainer.engine import build_engine, total_optimizer_steps
from memfit_trainer.export import save_final
from memfit_trainer.metrics import TrainerMetrics
from memfit_trainer.model import build_model
from memfit_trainer.oom import OomGuard

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


def _batches(config: TrainerConfig, tokenizer: Any, ranks: Ranks) -> PackedBatches:
    data = config.data
    source = DataSource(
        path=data.path,
        text_field=data.text_field,
        messages_field=data.messages_field,
        format=data.format,
        streaming=data.streaming,
    )
    return build_batches(
        source,
        tokenizer,
        sequence_length=config.training.sequence_length,
        micro_batch_size=config.training.micro_batch_size,
        rank=ranks.rank,
        world_size=ranks.world_size,
        seed=config.training.seed,
    )


def _latest_step(manager: CheckpointManager, rank: int) -> int | None:
    """Rank 0's view of the newest complete checkpoint, shared so that all ranks load the same one."""
    found: list[int | None] = [None]
    if rank == 0:
        manager.cleanup_stale()
        latest = manager.latest_complete()
        found = [latest.step if latest is not None else None]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def _check_layout(manager: CheckpointManager, step: int, layout: dict[str, Any]) -> None:
    """Refuse, before any model is built, a checkpoint another layout wrote (DeepSpeed would fail deep
    inside its loader with a missing shard file)."""
    checkpoint = next(c for c in manager.complete() if c.step == step)
    written = checkpoint.marker.get("layout")
    if written is not None and written != layout:
        raise ConfigError(
            f"checkpoint {checkpoint.path} was written by another layout ({written}) than this run's ({layout}): "
            "DeepSpeed cannot load its shards as they are; convert it to a universal checkpoint "
            "(deepspeed.checkpoint.ds_to_universal) or start from an empty output directory"
        )


def _resume(
    engine: Any, manager: CheckpointManager, step: int, ranks: Ranks, lora: bool, batches: PackedBatches
) -> tuple[DataPosition, str]:
    """Load the checkpoint of ``step``; the data position to go on from, and what to say about it."""
    checkpoint = next(c for c in manager.complete() if c.step == step)
    path, _ = engine.load_checkpoint(str(checkpoint.path), tag=CHECKPOINT_TAG, load_module_strict=not lora)
    if path is None:
        raise RuntimeError(f"the engine found no state in checkpoint {checkpoint.path}")
    load_rng_state(checkpoint.path, ranks.rank)
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
) -> None:
    """The multi-rank protocol of :mod:`memfit_trainer.checkpoint` (collective)."""
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
        manager.commit(step, {"dataPosition": position.to_dict(), "dataShape": shape, "layout": layout})
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
    The config refuses the chunked loss under ZeRO-3, where the head's weight is partitioned."""
    if not config.training.chunked_loss:
        return lambda batch: cast(torch.Tensor, engine(**batch).loss)
    name, kernel = select_kernel(device)
    progress.message(f"loss: chunked cross-entropy ({name})")
    causal_lm = unwrap_causal_lm(engine)
    return lambda batch: causal_lm_loss(engine, causal_lm, batch, kernel)


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
    lora = training.method in (Method.LORA, Method.QLORA)
    layout = config.layout.to_dict()
    manager = CheckpointManager(config.checkpoint_dir)
    if ranks.rank == 0:
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    resumed_from = _latest_step(manager, ranks.rank)
    if resumed_from is not None:
        _check_layout(manager, resumed_from, layout)

    built = build_model(config, ranks.local_rank)
    batches = _batches(config, built.tokenizer, ranks)
    total = total_optimizer_steps(training, batches.micro_batches_per_epoch)
    engine, scheduler = build_engine(config, built.model, total)
    progress = ConsoleProgress(total, enabled=ranks.rank == 0)
    position, step = DataPosition(), 0
    if resumed_from is not None:
        (position, said), step = _resume(engine, manager, resumed_from, ranks, lora, batches), resumed_from
        progress.message(f"resumed from checkpoint step {step} ({said})")
    else:
        torch.manual_seed(training.seed + ranks.rank)  # dropout differs per rank, reproducibly

    device = engine.device
    loss_of = _loss_function(config, engine, device, progress)
    offload = _activation_offload(config, engine, progress)
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
