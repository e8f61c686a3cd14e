"""Checkpoint directories: a save is visible only when complete, whatever instant the process dies at."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit_trainer import checkpoint as ckpt
from memfit_trainer.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_KEY,
    CheckpointManager,
    capture_rng_state,
    load_rng_state,
    restore_rng_state,
    save_rng_state,
)

POSITION = {"dataPosition": {"epoch": 1, "microBatch": 42}}


def write_weights(payload: str):
    def write(directory: Path) -> None:
        (directory / "weights.bin").write_text(payload)
        (directory / "shards").mkdir()
        (directory / "shards" / "rank0.pt").write_text(payload + "-shard")

    return write


def test_save_produces_a_sealed_directory(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    saved = manager.save(123, write_weights("w123"), {**POSITION, "loss": 1.5})
    assert saved.path == tmp_path / "ckpt" / "step-000123"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000123"]  # no temp dir left
    assert (saved.path / "shards" / "rank0.pt").read_text() == "w123-shard"
    marker = json.loads((saved.path / COMPLETE_MARKER).read_text())
    assert marker["step"] == 123 and marker["loss"] == 1.5
    assert marker["dataPosition"] == {"epoch": 1, "microBatch": 42}
    assert marker["timestamp"].endswith("Z")
    latest = manager.latest_complete()
    assert latest is not None and latest.step == 123 and latest.data_position == POSITION["dataPosition"]


def test_crash_while_writing_leaves_no_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(10, write_weights("ten"), POSITION)

    def crash(directory: Path) -> None:
        write_weights("twenty")(directory)
        raise KeyboardInterrupt  # the pod is killed mid-save

    with pytest.raises(KeyboardInterrupt):
        manager.save(20, crash, POSITION)
    assert (tmp_path / "step-000020.tmp" / "weights.bin").exists()
    assert manager.latest_complete().step == 10
    assert manager.cleanup_stale() == [tmp_path / "step-000020.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010"]


def test_crash_between_marker_and_rename_leaves_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(10, write_weights("ten"), POSITION)
    real_replace = os.replace

    def dies_on_directory_rename(src, dst):
        if Path(src).name == "step-000020.tmp":
            raise SystemExit("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", dies_on_directory_rename)
    with pytest.raises(SystemExit):
        manager.save(20, write_weights("twenty"), POSITION)
    assert (tmp_path / "step-000020.tmp" / COMPLETE_MARKER).exists()  # the marker alone does not count
    assert manager.latest_complete().step == 10


def test_files_are_flushed_before_the_marker_and_the_marker_before_the_rename(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync_path, real_replace = ckpt._fsync_path, os.replace

    def record_fsync(path: Path) -> None:
        events.append(("fsync", Path(path).name))
        real_fsync_path(path)

    def record_replace(src, dst) -> None:
        events.append(("rename", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt, "_fsync_path", record_fsync)
    monkeypatch.setattr(ckpt.os, "replace", record_replace)
    CheckpointManager(tmp_path).save(5, write_weights("five"), POSITION)
    order = [e for e in events if e in {("fsync", "weights.bin"), ("fsync", "rank0.pt")} or e[0] == "rename"]
    assert order[-2:] == [("rename", COMPLETE_MARKER), ("rename", "step-000005")]
    assert set(order[:-2]) == {("fsync", "weights.bin"), ("fsync", "rank0.pt")}
    assert events[-1] == ("fsync", tmp_path.name)  # the parent directory entry is flushed last


def test_invalid_or_foreign_directories_are_ignored(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(3, write_weights("3"), POSITION)
    (tmp_path / "step-000050").mkdir()  # no marker
    (tmp_path / "step-000060").mkdir()
    (tmp_path / "step-000060" / COMPLETE_MARKER).write_text("{truncated")
    (tmp_path / "step-000070").mkdir()
    (tmp_path / "step-000070" / COMPLETE_MARKER).write_text(json.dumps({"step": 71, **POSITION}))  # wrong step
    (tmp_path / "step-000080").mkdir()
    (tmp_path / "step-000080" / COMPLETE_MARKER).write_text(json.dumps({"step": 80}))  # no data position
    (tmp_path / "notes-000090").mkdir()
    assert [c.step for c in manager.complete()] == [3]


def test_latest_is_numeric_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (999_999, 5, 1_000_000, 40):
        manager.save(step, write_weights(str(step)), POSITION)
    (tmp_path / "step-000001.tmp").mkdir()  # an interrupted save is not pruned as a checkpoint
    assert manager.latest_complete().step == 1_000_000
    removed = manager.prune(keep=2)
    assert removed == [tmp_path / "step-000005", tmp_path / "step-000040"]
    assert [c.step for c in manager.complete()] == [999_999, 1_000_000]
    assert (tmp_path / "step-000001.tmp").exists()
    with pytest.raises(ValueError, match="at least 1"):
        manager.prune(keep=0)


def test_prune_never_removes_the_last_sealed_checkpoint(tmp_path: Path) -> None:
    """Newer checkpoints without a manifest (an older memfit's) cannot be verified: the newest sealed one
    stays beyond ``keep``, and goes once a newer sealed one is kept."""
    manager = CheckpointManager(tmp_path)
    manager.save(10, write_weights("sealed"), {**POSITION, MANIFEST_KEY: "0" * 32})
    for step in (20, 30):
        manager.save(step, write_weights(str(step)), POSITION)
    assert manager.prune(keep=1) == [tmp_path / "step-000020"]
    assert [c.step for c in manager.complete()] == [10, 30]
    manager.save(40, write_weights("sealed too"), {**POSITION, MANIFEST_KEY: "1" * 32})
    assert manager.prune(keep=1) == [tmp_path / "step-000010", tmp_path / "step-000030"]


def test_commit_needs_a_data_position_and_a_prepared_directory(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="dataPosition"):
        manager.save(1, write_weights("x"), {"loss": 1.0})
    with pytest.raises(FileNotFoundError, match="prepare"):
        manager.commit(2, POSITION)
    assert manager.latest_complete() is None


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(7, write_weights("old"), POSITION)
    manager.save(7, write_weights("new"), {"dataPosition": {"epoch": 2, "microBatch": 0}})
    latest = manager.latest_complete()
    assert (latest.path / "weights.bin").read_text() == "new"
    assert latest.data_position == {"epoch": 2, "microBatch": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007"]


def test_multi_rank_protocol(tmp_path: Path) -> None:
    """Rank 0 prepares; every rank writes into the same temp dir; rank 0 seals after the barrier."""
    managers = [CheckpointManager(tmp_path) for _ in range(2)]  # one per rank, as in separate processes
    managers[0].prepare(100)
    for rank, manager in enumerate(managers):  # between the two barriers
        directory = manager.temp_dir(100)
        (directory / f"zero_pp_rank_{rank}_optim_states.pt").write_text(f"shard {rank}")
        save_rng_state(directory, rank)
        ckpt.fsync_tree(directory)
        assert managers[1].latest_complete() is None
    managers[0].commit(100, POSITION)
    final = managers[1].latest_complete()
    assert final.step == 100
    assert {p.name for p in final.path.iterdir()} == {
        "zero_pp_rank_0_optim_states.pt",
        "zero_pp_rank_1_optim_states.pt",
        "rng_state_rank00000.pt",
        "rng_state_rank00001.pt",
        COMPLETE_MARKER,
    }


def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.standard_normal()), torch.rand(4)


def test_rng_state_round_trips_through_a_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leave a cached Gaussian in NumPy's state
    save_rng_state(tmp_path, rank=3)
    expected = draws()
    draws()  # move every generator on
    assert load_rng_state(tmp_path, rank=3) is True
    got = draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert load_rng_state(tmp_path, rank=4) is False  # world size grew: no state for this rank


def test_rng_state_in_memory() -> None:
    state = capture_rng_state()
    expected = draws()
    restore_rng_state(state)
    got = draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
