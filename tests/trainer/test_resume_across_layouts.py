"""After re-plans to other layouts and back, a run resumes from the newest complete checkpoint of any layout it
can load or convert, and a training another layout finished is done: a 2-rank DeepSpeed run killed at step 14,
finished by a 1-rank fsdp2 run (converted from 14), then run again with 2 ranks, trains nothing again."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.contract.trainer_config import TrainerConfig
from tests.trainer.runs import (
    KilledRuns,
    logged_losses,
    make_config,
    resumed_from,
    run_held_and_killed,
    run_trainer,
    write_config,
)
from tests.trainer.test_layout_change import _tree_digest

pytestmark = pytest.mark.distributed

STEPS = 28
EVERY = 7
KILLED_AT = 14


def _steps(config: TrainerConfig) -> list[str]:
    return sorted(p.name for p in config.checkpoint_dir.iterdir())


def _killed_deepspeed_run(tmp_path: Path, killed_runs: KilledRuns) -> tuple[TrainerConfig, Path]:
    """DeepSpeed ZeRO-2 at 2 ranks, killed after its checkpoint of step 14 (one kill, copied for both tests): its
    config and the config's file."""
    config = killed_runs.copy(tmp_path, KILLED_AT, stage=2, max_steps=STEPS, checkpoint_every=EVERY, name="trip")
    assert _steps(config) == ["step-000007", "step-000014"]
    return config, write_config(config, tmp_path / "deepspeed-2ranks.json")


def test_a_round_trip_through_fsdp2_that_finished_trains_nothing_again(tmp_path: Path, killed_runs: KilledRuns) -> None:
    deepspeed, deepspeed_path = _killed_deepspeed_run(tmp_path, killed_runs)
    fsdp2 = make_config(tmp_path, engine="fsdp2", stage=3, offload=False, world_size=1, accumulation=2,
                        max_steps=STEPS, checkpoint_every=EVERY, name="trip")  # fmt: skip
    finished = run_trainer(write_config(fsdp2, tmp_path / "fsdp2-1rank.json"), nproc=1)
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert f"resumed from checkpoint step {KILLED_AT} (converted from full-bf16-zero2-2ranks/" in finished.stdout
    final = _tree_digest(Path(deepspeed.final_dir))

    again = run_trainer(deepspeed_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"done already: final output of step {STEPS}" in again.stdout, again.stdout
    assert logged_losses(again.stdout) == {}
    assert _tree_digest(Path(deepspeed.final_dir)) == final
    assert _steps(deepspeed) == ["step-000007", "step-000014"]


@pytest.mark.slow
def test_a_newer_checkpoint_of_another_layout_is_converted_over_the_own_older_one(
    tmp_path: Path, killed_runs: KilledRuns
) -> None:
    """Killed at 14 at 2 ranks, continued at 1 rank (converted) and killed at 21: at 2 ranks again the run
    converts the 1-rank checkpoint of step 21 rather than resume its own of step 14."""
    deepspeed, deepspeed_path = _killed_deepspeed_run(tmp_path, killed_runs)
    one = make_config(tmp_path, stage=2, world_size=1, max_steps=STEPS, checkpoint_every=EVERY, name="trip")
    continued = run_held_and_killed(one, write_config(one, tmp_path / "deepspeed-1rank.json"), 21, nproc=1)
    assert resumed_from(continued) == KILLED_AT

    again = run_trainer(deepspeed_path)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from checkpoint step 21 (converted from full-bf16-zero2-1ranks/step-000021" in again.stdout
    assert min(logged_losses(again.stdout)) == 22
    assert _steps(deepspeed) == ["step-000021", "step-000028"]
