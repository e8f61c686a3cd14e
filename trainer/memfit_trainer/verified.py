"""Sealing a checkpoint with its manifest, and finding the newest one that verifies (collectives).

:mod:`memfit_trainer.manifest` says what a manifest is and how the reading is shared over the ranks; this
module runs it over the process group. A checkpoint that fails verification is set aside (renamed, never
deleted: :meth:`~memfit_trainer.checkpoint.CheckpointManager.set_aside`) with one line naming the file, and
the next newest is tried, so a garbled, truncated or missing file costs one checkpoint interval, not the run.
A checkpoint written before memfit sealed them is loaded unverified, and said so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from memfit_trainer.checkpoint import MANIFEST_KEY, Checkpoint, CheckpointManager
from memfit_trainer.manifest import (
    FileEntry,
    ManifestError,
    checkpoint_files,
    digest_share,
    read_manifest,
    verify_share,
    write_manifest,
)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def seal(directory: Path, rank: int, world_size: int) -> str | None:
    """Collective, once every rank's files in ``directory`` are flushed: each rank hashes its share of the
    files rank 0 lists, and rank 0 writes the manifest. The manifest's hash on rank 0 (for the marker)."""
    listed: list[list[str] | None] = [checkpoint_files(directory) if rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)
    files = listed[0]
    assert files is not None
    mine = digest_share(directory, files, rank, world_size)
    gathered: list[dict[str, FileEntry] | None] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    return write_manifest(directory, {name: entry for part in gathered if part for name, entry in part.items()})


def verify(checkpoint: Checkpoint, rank: int, world_size: int) -> str | None:
    """Collective: the first problem any rank found in its share of ``checkpoint``'s files (naming the file),
    or None; every rank gets the same answer. An unsealed checkpoint has nothing to verify against: None."""
    digest = checkpoint.marker.get(MANIFEST_KEY)
    problem = None
    if isinstance(digest, str):
        try:
            problem = verify_share(checkpoint.path, read_manifest(checkpoint.path, digest), rank, world_size)
        except ManifestError as error:
            problem = str(error)
    problems: list[str | None] = [None] * world_size
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def newest_verified(find: Callable[[], Checkpoint | None], rank: int, world_size: int) -> tuple[Checkpoint | None, int]:
    """Collective: what rank 0's ``find`` answers once it verifies, each one that does not set
    aside first (and said); with the number set aside. ``find`` runs on rank 0 only and is asked again after
    each one set aside (which no longer looks like a checkpoint)."""
    set_aside = 0
    while True:
        shared: list[Checkpoint | None] = [find() if rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        checkpoint = shared[0]
        if checkpoint is None:
            return None, set_aside
        problem = verify(checkpoint, rank, world_size)
        if problem is None:
            if rank == 0 and not checkpoint.sealed:
                say(f"checkpoint {checkpoint.path} has no manifest (written before memfit sealed checkpoints): "
                    "loaded unverified")  # fmt: skip
            return checkpoint, set_aside
        if rank == 0:
            moved = CheckpointManager(checkpoint.path.parent).set_aside(checkpoint.path)
            say(f"checkpoint {checkpoint.path} set aside as {moved.name}: {problem}; trying the previous one")
        set_aside += 1


def set_aside_unmarked(manager: CheckpointManager) -> int:
    """Rank 0: set aside the directories named like checkpoints that have no valid marker, each said (they
    were skipped in silence before); how many."""
    unmarked = manager.unmarked()
    for directory in unmarked:
        moved = manager.set_aside(directory)
        say(f"{directory} has no valid COMPLETE marker (not a checkpoint the protocol wrote): set aside as "
            f"{moved.name}")  # fmt: skip
    return len(unmarked)
