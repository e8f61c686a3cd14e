"""Where a run starts, and the training state saved and loaded with the checkpoint protocol.

Every ``checkpointEverySteps`` optimizer steps, and at the end, the loop saves the full training state with
the :class:`~memfit_trainer.checkpoint.CheckpointManager` protocol (:func:`save_checkpoint`): the engine's
state (model, optimizer, LR schedule), the data position in the marker and each rank's RNG state. On start
the newest complete checkpoint is loaded, so a restarted pod continues with exactly the batches and random
numbers the uninterrupted run would have used.

The marker also records the world size and micro-batch size the data position counts in (``dataShape``): a
checkpoint written at another world size (the fsdp2 engine's load at any) resumes at the same place in the
data (:func:`~memfit_trainer.data.carry_position`). Where this layout's directory holds no checkpoint, the
newest checkpoint another layout wrote is converted where a conversion exists (:mod:`memfit_trainer.convert`),
loaded by the engine (:meth:`~memfit_trainer.training_engine.TrainingEngine.load_converted`) and saved as this
layout's at the same step before training goes on.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.checkpoint import (
    DEEPSPEED_TAG,
    Checkpoint,
    CheckpointManager,
    fsync_tree,
    load_rng_state,
    save_rng_state,
)
from memfit_trainer.convert import Conversion, ConversionError, find_conversion, universal_dir, write_universal
from memfit_trainer.data import DataPosition, PackedBatches, carry_position
from memfit_trainer.run import Run


@dataclass(frozen=True)
class Start:
    """Where the run starts: its own layout's checkpoint of ``step``, else a conversion of another layout's
    (its universal checkpoint written), else the weights; ``refusal`` says why a newer checkpoint is not used."""

    step: int | None = None
    conversion: Conversion | None = None
    refusal: str | None = None


class Resumed(NamedTuple):
    """The step the run goes on from, its data position, and what to say about it."""

    step: int
    position: DataPosition
    said: str


def find_start(manager: CheckpointManager, config: TrainerConfig, rank: int) -> Start:
    """Rank 0 decides (and writes the universal checkpoint of a conversion), shared so that all ranks load the
    same one. A conversion that fails is said in one line and the run starts from the weights."""
    found: list[Start | None] = [None]
    if rank == 0:
        manager.cleanup_stale()
        latest = manager.latest_complete()
        start = Start(step=latest.step) if latest is not None else Start()
        if latest is None:
            search = find_conversion(manager.root, config.layout)
            start = Start(conversion=search.conversion, refusal=search.refusal)
        if start.conversion is not None:
            source = start.conversion.source
            try:
                partitioned = config.layout.zero_stage == 3  # DeepSpeed ZeRO-3 (an fsdp2 layout records stage 0)
                write_universal(source, DEEPSPEED_TAG, universal_dir(manager, source.step), partitioned)
            except ConversionError as error:
                start = Start(refusal=f"{str(error).splitlines()[0]}; starting from the weights")
        if start.refusal is not None:
            print(start.refusal, file=sys.stderr, flush=True)
        found = [start]
    dist.broadcast_object_list(found, src=0)
    assert found[0] is not None
    return found[0]


def check_layout(manager: CheckpointManager, step: int, layout: dict[str, Any]) -> None:
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


def resume(run: Run, start: Start) -> Resumed | None:
    """Collective: load the state ``start`` names into the run's engine (a conversion also saved as this
    layout's checkpoint); ``None`` where the run starts from the weights."""
    if start.step is not None:
        return _resume(run, start.step)
    if start.conversion is not None:
        return _resume_converted(run, start.conversion)
    return None


def _loaded(found: bool, directory: Path) -> None:
    if not found:
        raise RuntimeError(f"the engine found no state in checkpoint {directory}")


def _resume(run: Run, step: int) -> Resumed:
    """Load the checkpoint of ``step``."""
    checkpoint = next(c for c in run.manager.complete() if c.step == step)
    _loaded(run.engine.load_checkpoint(checkpoint.path), checkpoint.path)
    load_rng_state(checkpoint.path, run.ranks.rank)
    return Resumed(step, *_carried_position(checkpoint, run.batches))


def _resume_converted(run: Run, conversion: Conversion) -> Resumed:
    """Load the universal checkpoint rank 0 wrote of ``conversion``, the RNG state of the source where it has
    this rank's, the data position carried from the source's; saved as this layout's checkpoint."""
    step = conversion.source.step
    scratch = universal_dir(run.manager, step)
    _loaded(run.engine.load_converted(scratch), scratch)
    load_rng_state(conversion.source.path, run.ranks.rank)
    position, said = _carried_position(conversion.source, run.batches)
    save_checkpoint(run, step, position, converted_from=conversion.marker())
    if run.ranks.rank == 0:
        shutil.rmtree(scratch)
    return Resumed(step, position, f"{conversion.describe()}: {said}")


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


def save_checkpoint(run: Run, step: int, position: DataPosition, converted_from: dict[str, Any] | None = None) -> None:
    """The multi-rank protocol of :mod:`memfit_trainer.checkpoint` (collective); ``converted_from`` recorded
    in the marker of a checkpoint converted from another layout's."""
    manager, ranks, training = run.manager, run.ranks, run.config.training
    if ranks.rank == 0:
        manager.prepare(step)
    dist.barrier()
    tmp = manager.temp_dir(step)
    run.engine.save_checkpoint(tmp)
    save_rng_state(tmp, ranks.rank)
    fsync_tree(tmp)
    dist.barrier()
    if ranks.rank == 0:
        shape = {"worldSize": ranks.world_size, "microBatchSize": training.micro_batch_size}
        origin = {} if converted_from is None else {"convertedFrom": converted_from}
        marker = {"dataPosition": position.to_dict(), "dataShape": shape, "layout": run.config.layout.to_dict()}
        manager.commit(step, {**marker, **origin})
        manager.prune(training.keep_checkpoints)
    dist.barrier()
