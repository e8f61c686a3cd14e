"""Verified checkpoints: each is sealed with a manifest (size and content hash of every file the ranks wrote)
before its COMPLETE marker; before a load each rank verifies its share, and one that fails is set aside with
one line naming the file while the previous good one is used (issue 22).

The manifest and the fallback are tested in this process (a gloo group of one rank); the whole path on two
ranks of each engine, where damaged newest checkpoints must cost nothing but the steps since the good one:
the rerun ends with the uninterrupted run's very weights.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from memfit.contract.progress import read_progress
from memfit_trainer.checkpoint import COMPLETE_MARKER, MANIFEST_KEY, SET_ASIDE_SUFFIX, Checkpoint, CheckpointManager
from memfit_trainer.manifest import MANIFEST, checkpoint_files, share
from memfit_trainer.verified import newest_verified, seal, set_aside_unmarked, verify
from tests.trainer.runs import assert_same_final_weights, make_config, run_trainer, write_config

POSITION = {"dataPosition": {"epoch": 0, "microBatch": 0}}
FILES = {"model.pt": os.urandom(300_000), "deepspeed/optim_rank0.pt": os.urandom(70_000), "rng_rank0.pt": b"rng"}


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo group of one rank: sealing and verifying are collectives."""
    store = tmp_path_factory.mktemp("group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sealed(manager: CheckpointManager, step: int, files: dict[str, bytes] = FILES) -> Checkpoint:
    """A checkpoint of ``files`` written and committed as the trainer's protocol does."""
    directory = manager.prepare(step)
    for name, payload in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(payload)
    return manager.commit(step, {**POSITION, MANIFEST_KEY: seal(directory, 0, 1)})


def garble(path: Path) -> None:
    """4 KiB of other bytes in the middle of the file, its size unchanged."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        handle.write(os.urandom(4096))


def flip_one_bit(path: Path) -> None:
    payload = bytearray(path.read_bytes())
    payload[len(payload) // 3] ^= 0x10
    path.write_bytes(bytes(payload))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "garbled": ("model.pt", garble, "model.pt has other content than was written (its content hash differs: garbled)"),
    "one bit": ("deepspeed/optim_rank0.pt", flip_one_bit, "deepspeed/optim_rank0.pt has other content"),
    "truncated": ("model.pt", truncate, "model.pt has 150000 bytes, 300000 were written"),
    "missing": ("rng_rank0.pt", Path.unlink, "rng_rank0.pt is missing"),
    "manifest": (MANIFEST, garble, f"{MANIFEST} is not the one its COMPLETE marker sealed"),
}


def test_a_sealed_checkpoint_lists_every_file_the_ranks_wrote_and_verifies(tmp_path: Path) -> None:
    checkpoint = sealed(CheckpointManager(tmp_path), 8)
    manifest = json.loads((checkpoint.path / MANIFEST).read_text())["files"]
    assert {name: entry["size"] for name, entry in manifest.items()} == {n: len(p) for n, p in FILES.items()}
    assert checkpoint.sealed and verify(checkpoint, 0, 1) is None


@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damage_fails_verification_naming_the_file(tmp_path: Path, damage: str) -> None:
    checkpoint = sealed(CheckpointManager(tmp_path), 8)
    name, harm, said = DAMAGES[damage]
    harm(checkpoint.path / name)
    problem = verify(checkpoint, 0, 1)
    assert problem is not None and problem.startswith(said), problem


def test_the_ranks_shares_cover_every_file_once() -> None:
    files = [f"shard-{i:02d}" for i in range(11)]
    for world_size in (1, 2, 3, 8, 16):
        shares = [share(files, rank, world_size) for rank in range(world_size)]
        assert sorted(name for part in shares for name in part) == files
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # the reading is spread evenly


def test_damaged_newest_checkpoints_are_set_aside_each_said_and_the_previous_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (8, 16, 24):
        sealed(manager, step)
    truncate(manager.final_dir(24) / "model.pt")
    (manager.final_dir(16) / "rng_rank0.pt").unlink()
    found, set_aside = newest_verified(manager.latest_complete, 0, 1)
    assert found is not None and found.step == 8 and set_aside == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "step-000024 set aside as step-000024.unusable: model.pt has 150000 bytes" in lines[0]
    assert "step-000016 set aside as step-000016.unusable: rng_rank0.pt is missing" in lines[1]
    # Renamed, never deleted: the files are still there to look at, and no longer look like checkpoints.
    assert (tmp_path / "step-000024.unusable" / "model.pt").exists()
    assert [c.step for c in manager.complete()] == [8]


def test_a_second_set_aside_of_the_same_step_keeps_the_first(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for _ in range(2):
        garble(sealed(manager, 8).path / "model.pt")
        assert newest_verified(manager.latest_complete, 0, 1) == (None, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-000008{SET_ASIDE_SUFFIX}", "step-000008.unusable-2"]


def test_a_checkpoint_written_before_manifests_loads_unverified_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = CheckpointManager(tmp_path)
    old = manager.save(8, lambda directory: (directory / "model.pt").write_bytes(b"weights"), POSITION)
    assert not old.sealed
    assert newest_verified(manager.latest_complete, 0, 1) == (old, 0)
    assert "has no manifest (written before memfit sealed checkpoints): loaded unverified" in capsys.readouterr().err


def test_a_directory_named_like_a_checkpoint_without_a_marker_is_set_aside_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = CheckpointManager(tmp_path)
    sealed(manager, 8)
    (sealed(manager, 16).path / COMPLETE_MARKER).write_text("{not json")
    assert set_aside_unmarked(manager) == 1
    assert "step-000016 has no valid COMPLETE marker" in capsys.readouterr().err
    assert [c.step for c in manager.complete()] == [8] and (tmp_path / "step-000016.unusable").is_dir()


def test_the_manifest_lists_files_in_subdirectories_and_not_itself(tmp_path: Path) -> None:
    checkpoint = sealed(CheckpointManager(tmp_path), 8)
    assert checkpoint_files(checkpoint.path, exclude=(MANIFEST, COMPLETE_MARKER)) == sorted(FILES)


# --- Two ranks of each engine -------------------------------------------------------------------------

STEPS, EVERY = 12, 4
ENGINE_DAMAGES = {
    # engine: (the damage to the newest checkpoint, to the one before)
    "deepspeed": (garble, lambda step: next(step.glob("rng_state_rank00001.pt"))),
    "fsdp2": (truncate, lambda step: next(step.rglob(".metadata"))),
}


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ENGINE_DAMAGES)
def test_a_rerun_over_damaged_newest_checkpoints_resumes_from_the_last_good_one_to_the_same_weights(
    tmp_path: Path, engine: str
) -> None:
    """The uninterrupted run leaves checkpoints 4, 8 and 12 and its final weights; a copy of its output with
    the final export removed, the largest file of checkpoint 12 damaged and one file of checkpoint 8 gone
    (an RNG file on DeepSpeed, the DCP metadata on fsdp2) resumes from 4 with two lines naming the files,
    and trains steps 5-12 to the very same weights."""

    def config(name: str):  # type: ignore[no-untyped-def]
        stage = 3 if engine == "fsdp2" else 2  # fsdp2 offloads the parameters it reshards
        made = make_config(tmp_path, engine=engine, stage=stage, name=name, max_steps=STEPS, checkpoint_every=EVERY)
        return made.model_copy(update={"training": made.training.model_copy(update={"keep_checkpoints": 3})})

    reference = config("reference")
    done = run_trainer(write_config(reference, tmp_path / "reference.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rerun = config("rerun")
    shutil.copytree(reference.output_dir, rerun.output_dir)
    shutil.rmtree(rerun.final_dir)
    checkpoints = CheckpointManager(rerun.checkpoint_dir)
    assert [c.step for c in checkpoints.complete()] == [4, 8, 12] and all(c.sealed for c in checkpoints.complete())
    damage_newest, missing = ENGINE_DAMAGES[engine]
    damaged = largest_file(checkpoints.final_dir(12))
    damage_newest(damaged)
    gone = missing(checkpoints.final_dir(8))
    gone.unlink()

    result = run_trainer(write_config(rerun, tmp_path / "rerun.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if " set aside as " in line]
    assert len(said) == 2, result.stderr[-3000:]
    assert f"{damaged.relative_to(checkpoints.final_dir(12)).as_posix()} has " in said[0]
    assert f"{gone.relative_to(checkpoints.final_dir(8)).as_posix()} is missing" in said[1]
    assert "resumed from checkpoint step 4 " in result.stdout
    assert_same_final_weights(rerun.output_dir, reference.output_dir)
    progress = read_progress(rerun.metrics.progress_file)
    assert progress is not None and (progress.resumed_from_step, progress.checkpoints_set_aside) == (4, 2)
    assert {p.name for p in Path(rerun.checkpoint_dir).iterdir() if p.name.endswith(SET_ASIDE_SUFFIX)} == {
        "step-000008.unusable",
        "step-000012.unusable",
    }
