"""Checkpoint directories that are either complete or invisible, and per-rank RNG state.

A pod can be killed at any instant (preemption, OOM, node drain), including in the middle of a save. A
checkpoint is therefore written under a temporary name ``step-000123.tmp``, every file is fsynced, a
``COMPLETE`` marker (JSON: step, data position, timestamp, extra metadata) is written last, and only then is
the directory renamed to ``step-000123`` in one atomic ``rename``. Resumption only ever considers directories
with the final name *and* a valid marker, so a torn save is never mistaken for a checkpoint; leftover ``.tmp``
directories are removed by :meth:`CheckpointManager.cleanup_stale`. Deletions rename to ``.tmp`` first for
the same reason (a half-deleted directory must not still look complete).

The manager does not know what is inside a checkpoint. With several ranks (each writes its shards) the
training loop places the barriers (:func:`memfit_trainer.resume.save_checkpoint`)::

    manager = CheckpointManager(root)
    if rank == 0:
        tmp = manager.prepare(step)          # fresh, empty step-000123.tmp
    barrier()
    tmp = manager.temp_dir(step)             # same path on every rank (shared volume)
    engine.save_checkpoint(tmp)              # memfit_trainer.training_engine.TrainingEngine
    save_rng_state(tmp, rank)
    fsync_tree(tmp)                          # each rank flushes what it wrote (needed on network filesystems)
    barrier()                                # every shard is on disk before the marker exists
    digest = seal(tmp, rank, world_size)     # each rank hashes its share; rank 0 writes the manifest
    if rank == 0:
        manager.commit(step, {"dataPosition": position.to_dict(), MANIFEST_KEY: digest})
        manager.prune(keep)
    barrier()                                # nobody reads or reuses the directory before it is final

The engine keeps all its files inside the step directory (DeepSpeed's in the :data:`DEEPSPEED_TAG`
subdirectory, with no ``latest`` file or converter script next to it), so the directory can be renamed; load
it with ``engine.load_checkpoint(checkpoint.path)`` once :func:`memfit_trainer.verified.verify` has checked it
against its manifest. Single-process code can call :meth:`save` (unsealed).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from memfit.api.vocabulary import TIMESTAMP_FORMAT
from memfit_trainer.protocol_hold import hold_at

COMPLETE_MARKER = "COMPLETE"
DEEPSPEED_TAG = "deepspeed"
"""The subdirectory of a step directory that holds DeepSpeed's files (its checkpoint ``tag``)."""
TEMP_SUFFIX = ".tmp"
SET_ASIDE_SUFFIX = ".unusable"
"""A checkpoint that failed verification or cannot be read is renamed with this suffix (never deleted: its
files may still be worth a look), out of the way of resumption, pruning and the clean-up of ``.tmp`` names."""
MANIFEST_KEY = "manifestXxh3"
"""The marker's record of the checkpoint's manifest (its content hash): :mod:`memfit_trainer.manifest`."""
_FINAL_NAME = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """``step-000123``: zero-padded so that names sort like steps (up to a million without widening)."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    return f"step-{step:06d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """Flush every file and directory under ``path`` to stable storage (files first, then their dirs)."""
    root = Path(path)
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(directory) / name)
        _fsync_path(Path(directory))


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk and the contents of its marker."""

    step: int
    path: Path
    marker: Mapping[str, Any]

    @property
    def data_position(self) -> Mapping[str, Any]:
        return cast(Mapping[str, Any], self.marker["dataPosition"])

    @property
    def sealed(self) -> bool:
        """Whether it has a manifest to verify it against (checkpoints written before memfit sealed them have none)."""
        return isinstance(self.marker.get(MANIFEST_KEY), str)


class CheckpointManager:
    """Atomic save, discovery, pruning and cleanup of ``step-NNNNNN`` directories under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def final_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def temp_dir(self, step: int) -> Path:
        return self.root / (step_name(step) + TEMP_SUFFIX)

    def prepare(self, step: int) -> Path:
        """Create an empty temporary directory for ``step`` (rank 0 only; a leftover one is discarded)."""
        tmp = self.temp_dir(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, step: int, metadata: Mapping[str, Any]) -> Checkpoint:
        """Seal the temporary directory of ``step``: fsync, write the marker last, rename (rank 0 only).

        ``metadata`` must hold ``"dataPosition"`` (resuming without it would replay or skip data) and be
        JSON-serialisable; it is stored in the marker together with the step and a UTC timestamp.
        """
        if "dataPosition" not in metadata:
            raise ValueError("checkpoint metadata must include 'dataPosition'")
        tmp = self.temp_dir(step)
        if not tmp.is_dir():
            raise FileNotFoundError(f"no temporary checkpoint directory {tmp}; call prepare() first")
        marker = {
            "step": step,
            "timestamp": time.strftime(TIMESTAMP_FORMAT, time.gmtime()),
            **metadata,
        }
        payload = json.dumps(marker, sort_keys=True)
        fsync_tree(tmp)
        marker_tmp = tmp / (COMPLETE_MARKER + TEMP_SUFFIX)
        with open(marker_tmp, "w", encoding="utf-8") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_tmp, tmp / COMPLETE_MARKER)
        _fsync_path(tmp)
        hold_at("marker-written", step)
        final = self.final_dir(step)
        replaced = None
        if final.exists():  # saving the same step twice (e.g. right after a resume): keep the newer one
            replaced = self.root / (step_name(step) + ".replaced" + TEMP_SUFFIX)
            if replaced.exists():
                shutil.rmtree(replaced)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync_path(self.root)
        hold_at("renamed", step)
        if replaced is not None:
            shutil.rmtree(replaced)
        return Checkpoint(step, final, json.loads(payload))

    def save(self, step: int, write_fn: Callable[[Path], None], metadata: Mapping[str, Any]) -> Checkpoint:
        """Single-process save: ``write_fn(directory)`` writes the checkpoint's files, then it is committed."""
        tmp = self.prepare(step)
        write_fn(tmp)
        return self.commit(step, metadata)

    def _read_marker(self, directory: Path, step: int) -> Mapping[str, Any] | None:
        try:
            marker = json.loads((directory / COMPLETE_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(marker, dict) or marker.get("step") != step or "dataPosition" not in marker:
            return None
        return marker

    def complete(self) -> list[Checkpoint]:
        """All complete checkpoints, oldest step first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _FINAL_NAME.match(entry.name)
            if match and entry.is_dir():
                step = int(match.group(1))
                marker = self._read_marker(entry, step)
                if marker is not None:
                    found.append(Checkpoint(step, entry, marker))
        return sorted(found, key=lambda c: c.step)

    def unmarked(self) -> list[Path]:
        """Directories with a checkpoint's final name but no valid marker: the protocol never leaves one (the
        marker is written before the rename), so it was damaged or copied in by hand."""
        if not self.root.is_dir():
            return []
        complete = {c.path for c in self.complete()}
        return sorted(
            entry
            for entry in self.root.iterdir()
            if _FINAL_NAME.match(entry.name) and entry.is_dir() and entry not in complete
        )

    def set_aside(self, directory: Path) -> Path:
        """Rename ``directory`` out of the way (``step-000123.unusable``, ``.unusable-2``...); its new path."""
        target = directory.with_name(directory.name + SET_ASIDE_SUFFIX)
        copies = 1
        while target.exists():
            copies += 1
            target = directory.with_name(f"{directory.name}{SET_ASIDE_SUFFIX}-{copies}")
        os.replace(directory, target)
        _fsync_path(self.root)
        return target

    def latest_complete(self) -> Checkpoint | None:
        """The checkpoint to resume from, or ``None`` for a fresh start."""
        checkpoints = self.complete()
        return checkpoints[-1] if checkpoints else None

    def _remove(self, checkpoint: Checkpoint) -> None:
        doomed = checkpoint.path.with_name(checkpoint.path.name + ".deleting" + TEMP_SUFFIX)
        os.replace(checkpoint.path, doomed)  # atomically stops looking like a checkpoint
        hold_at("pruning", checkpoint.step)
        shutil.rmtree(doomed)

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the ``keep`` newest complete checkpoints (rank 0 only); returns what was removed.
        The newest sealed one (:attr:`Checkpoint.sealed`) stays even beyond ``keep``: unsealed newer ones
        (written by an older memfit) cannot be verified, and it is the one a resume can trust."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        checkpoints = self.complete()
        doomed = checkpoints[:-keep]
        if not any(c.sealed for c in checkpoints[-keep:]):
            trusted = [c for c in doomed if c.sealed]
            doomed = [c for c in doomed if not trusted or c is not trusted[-1]]
        for checkpoint in doomed:
            self._remove(checkpoint)
        return [c.path for c in doomed]

    def cleanup_stale(self) -> list[Path]:
        """Remove leftover temporary directories of interrupted saves and deletions.

        Rank 0 only, and only while no save is in progress (at start-up, before the first save).
        """
        if not self.root.is_dir():
            return []
        stale = sorted(p for p in self.root.iterdir() if p.name.startswith("step-") and p.name.endswith(TEMP_SUFFIX))
        for path in stale:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return stale


# --- The final export's marker ------------------------------------------------------------------------


FINAL_MARKER = "memfit-final.json"
"""Written into the final export (beside the model's files) before it is renamed into place: what it is the
model of (the step and layout, :func:`memfit_trainer.resume.final_marker`), so that a rerun after a re-plan to a
layout that cannot load that step's checkpoint knows the training is done."""


def write_final_marker(directory: Path, marker: Mapping[str, Any]) -> None:
    """Mark the export being written to ``directory`` (JSON-serialisable ``marker``)."""
    (directory / FINAL_MARKER).write_text(json.dumps(marker, sort_keys=True), encoding="utf-8")


def read_final_marker(final_dir: Path) -> Mapping[str, Any] | None:
    """The marker of the final export in ``final_dir``; ``None`` without one (or an export written before
    exports were marked)."""
    try:
        marker = json.loads((final_dir / FINAL_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


# --- RNG state ----------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch CPU (and CUDA, if present) generator states.

    Stored as tensors and plain Python values so it loads with ``torch.load(weights_only=True)``.
    """
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` took (CUDA only if both the state and a GPU are present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rng_state_rank{rank:05d}.pt"


def save_rng_state(directory: str | Path, rank: int) -> Path:
    """Write this rank's RNG state into a checkpoint directory (each rank its own file)."""
    path = rng_state_file(directory, rank)
    torch.save(capture_rng_state(), path)
    return path


def load_rng_state(directory: str | Path, rank: int) -> bool:
    """Restore this rank's RNG state from a checkpoint; ``False`` if it has none for this rank (the world size
    changed), in which case the generators keep their seeded state."""
    path = rng_state_file(directory, rank)
    if not path.exists():
        return False
    restore_rng_state(torch.load(path, weights_only=True))
    return True
