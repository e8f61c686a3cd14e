"""Where a run starts, and the training state saved and loaded with the checkpoint protocol.

Every ``checkpointEverySteps`` optimizer steps, and at the end, the loop saves the full training state with
the :class:`~memfit_trainer.checkpoint.CheckpointManager` protocol (:func:`save_checkpoint`): the engine's
state (model, optimizer, LR schedule), the data position in the marker and each rank's RNG state. On start
the newest complete checkpoint is loaded, so a restarted pod continues with exactly the batches and random
numbers the uninterrupted run would have used.

The marker also records the world size, micro-batch size and sequence-parallel degree the data position counts in
(``dataShape``): a checkpoint written at another world size (the fsdp2 engine's load at any) or degree resumes at
the same place in the data (:func:`~memfit_trainer.data.carry_position`). Where another layout (a re-plan, and
perhaps back) wrote a newer checkpoint than this layout's newest, that one is converted where a conversion exists
(:mod:`memfit_trainer.convert`), loaded by the engine
(:meth:`~memfit_trainer.training_engine.TrainingEngine.load_converted`) and saved as this layout's at the same
step before training goes on; where the final export is newer than any checkpoint the run can load (another
layout finished the training), a run whose last step it is has nothing to do.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from memfit.contract.layout import CheckpointLayout
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.checkpoint import (
    DEEPSPEED_TAG,
    MANIFEST_KEY,
    Checkpoint,
    CheckpointManager,
    fsync_tree,
    load_rng_state,
    read_final_marker,
    save_rng_state,
)
from memfit_trainer.convert import Conversion, ConversionError, Search, find_conversion, universal_dir, write_universal
from memfit_trainer.data import DATA_FINGERPRINT, DataPosition, PackedBatches, carry_position
from memfit_trainer.run import Ranks, Run
from memfit_trainer.verified import newest_verified, seal, set_aside_unmarked


@dataclass(frozen=True)
class Start:
    """Where the run starts: a ``conversion`` of another layout's checkpoint newer than this layout's newest
    (its universal checkpoint written), else this layout's newest, of ``step``, else the weights; ``refusal``
    says why a newer checkpoint is not used; ``finished``: the step of a final export newer than all of them;
    ``set_aside``: how many newer checkpoints failed verification (or had no valid marker) and were set aside."""

    step: int | None = None
    conversion: Conversion | None = None
    refusal: str | None = None
    finished: int | None = None
    set_aside: int = 0

    @property
    def newest(self) -> int | None:
        """The step of the checkpoint the run loads, if any."""
        return self.conversion.source.step if self.conversion is not None else self.step

    def done(self, total_steps: int) -> bool:
        """The final export is of this run's last step: the training is done (in another layout)."""
        return self.finished == total_steps


class Resumed(NamedTuple):
    """The step the run goes on from, its data position, and what to say about it."""

    step: int
    position: DataPosition
    said: str


def find_start(manager: CheckpointManager, config: TrainerConfig, ranks: Ranks) -> Start:
    """Collective. Rank 0 decides (and writes the universal checkpoint of a conversion), shared so that all
    ranks load the same one; the checkpoint it names has been verified by all of them
    (:mod:`memfit_trainer.verified`), each newer one that failed set aside. A conversion that fails is said in
    one line and the run starts from what else it has."""
    rank, world_size = ranks.rank, ranks.world_size
    unmarked = 0
    if rank == 0:
        manager.cleanup_stale()
        unmarked = set_aside_unmarked(manager)
    own, own_set_aside = newest_verified(manager.latest_complete, rank, world_size)
    own_step = None if own is None else own.step
    finished = _finished_step(config) if rank == 0 else None
    searched: list[Search] = []

    def newer_conversion() -> Checkpoint | None:
        """Rank 0: the checkpoint of the newest other layout's that is newer than this layout's and converts,
        where the training is not done already (nothing to convert then)."""
        search = find_conversion(manager.root, config.layout, newer_than=-1 if own_step is None else own_step)
        if search.conversion is not None and finished is not None and finished > search.conversion.source.step:
            search = Search(None, search.refusal)
        searched[:] = [search]
        return None if search.conversion is None else search.conversion.source

    _, other_set_aside = newest_verified(newer_conversion, rank, world_size)
    found: list[Start | None] = [None]
    if rank == 0:
        [search] = searched
        start = Start(own_step, search.conversion, set_aside=unmarked + own_set_aside + other_set_aside)
        if search.conversion is None and search.refusal is not None:
            start = replace(start, refusal=f"{search.refusal}; {_fallback(own_step)}")
        if finished is not None and finished > (start.newest or 0):
            start = replace(start, finished=finished, refusal=None)  # done: no newer checkpoint matters
        if start.conversion is not None:
            start = _converted(manager, config, start)
        if start.refusal is not None:
            print(start.refusal, file=sys.stderr, flush=True)
        found = [start]
    dist.broadcast_object_list(found, src=0)
    assert found[0] is not None
    return found[0]


def final_marker(config: TrainerConfig, step: int) -> dict[str, Any]:
    """What the final export records of itself (:data:`~memfit_trainer.checkpoint.FINAL_MARKER`)."""
    return {"step": step, "layout": config.layout.to_dict()}


def _finished_step(config: TrainerConfig) -> int | None:
    """The step of the final export of this training: of this run's method, precision and master weights (a
    re-plan of the same training changes only the engine, stage and world size; another starts afresh)."""
    marker = read_final_marker(config.final_dir)
    if marker is None or not isinstance(marker.get("step"), int) or not isinstance(marker.get("layout"), dict):
        return None
    try:
        layout = CheckpointLayout.from_dict(marker["layout"])
    except ValueError:
        return None
    own = config.layout
    same = (layout.method, layout.precision, layout.master_weights) == (own.method, own.precision, own.master_weights)
    return int(marker["step"]) if same else None


def _fallback(own_step: int | None) -> str:
    return "starting from the weights" if own_step is None else f"resuming from this layout's step {own_step}"


def _converted(manager: CheckpointManager, config: TrainerConfig, start: Start) -> Start:
    """``start`` with its conversion's universal checkpoint written; where that fails, this layout's own
    newest checkpoint (or the weights), and one line on why."""
    assert start.conversion is not None
    source = start.conversion.source
    try:
        partitioned = config.layout.zero_stage == 3  # DeepSpeed ZeRO-3 (an fsdp2 layout records stage 0)
        write_universal(source, DEEPSPEED_TAG, universal_dir(manager, source.step), partitioned)
    except ConversionError as error:
        return replace(start, conversion=None, refusal=f"{str(error).splitlines()[0]}; {_fallback(start.step)}")
    return start


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
    if start.conversion is not None:
        return _resume_converted(run, start.conversion)
    if start.step is not None:
        return _resume(run, start.step)
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
    then = batches.blocks_per_step if shape is None else blocks_per_step(shape)
    batches.check_resume(position, then, checkpoint.marker.get(DATA_FINGERPRINT))  # other data: refused
    if shape is None:
        return position, said
    # Written at another world size (the fsdp2 engine's checkpoints load at any): the same blocks consumed.
    position, skipped = carry_position(position, then, batches.blocks_per_step)
    per_epoch = batches.micro_batches_per_epoch
    if per_epoch is not None and position.micro_batch > per_epoch:
        position = DataPosition(position.epoch + 1, 0)
    if then != batches.blocks_per_step:
        sp = int(shape.get("sequenceParallel", 1))
        over = f" (sequence parallel {sp})" if sp > 1 else ""
        said += f" written at {shape['worldSize']} rank(s){over} x micro-batch {shape['microBatchSize']}, here "
        said += f"{position.to_dict()} ({skipped} block(s) skipped)"
    return position, said


def blocks_per_step(shape: dict[str, Any]) -> int:
    """The blocks one global micro-step took in a marker's ``dataShape``: a micro-batch per data-parallel rank,
    the ``sequenceParallel`` ranks of a group sharing theirs (1 in markers from before it was recorded)."""
    return int(shape["worldSize"]) // int(shape.get("sequenceParallel", 1)) * int(shape["microBatchSize"])


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
    digest = seal(tmp, ranks.rank, ranks.world_size)
    if ranks.rank == 0:
        shape = {"worldSize": ranks.world_size, "microBatchSize": training.micro_batch_size,
                 "sequenceParallel": training.sequence_parallel}  # fmt: skip
        origin = {} if converted_from is None else {"convertedFrom": converted_from}
        marker = {"dataPosition": position.to_dict(), "dataShape": shape, "layout": run.config.layout.to_dict(),
                  DATA_FINGERPRINT: run.batches.fingerprint, MANIFEST_KEY: digest}  # fmt: skip
        manager.commit(step, {**marker, **origin})
        manager.prune(training.keep_checkpoints)
    dist.barrier()
