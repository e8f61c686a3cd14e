"""Checkpoints are kept per sharding layout (method, precision, ZeRO stage, world size). After a re-plan to
another layout (the operator's answer to an out-of-memory failure) the run starts from the weights instead
of failing on shards it cannot load, and the first layout's checkpoints stay for a return to it. A
checkpoint copied by hand under the wrong layout is refused with one clear line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.runs import make_config, run_trainer, write_config

pytestmark = pytest.mark.distributed


def test_another_zero_stage_starts_fresh_and_a_misplaced_checkpoint_is_refused(tmp_path: Path) -> None:
    first = make_config(tmp_path, stage=2, max_steps=4, checkpoint_every=2, name="layout")
    done = run_trainer(write_config(first, tmp_path / "zero2.json"))
    assert done.returncode == 0, done.stderr[-3000:]

    zero3 = first.model_copy(update={"deepspeed": {**first.deepspeed, "zero_optimization": {"stage": 3}}})
    assert zero3.checkpoint_dir != first.checkpoint_dir
    assert first.checkpoint_dir.parent == zero3.checkpoint_dir.parent
    shutil.copytree(first.checkpoint_dir, zero3.checkpoint_dir)  # a ZeRO-2 checkpoint where ZeRO-3 looks
    refused = run_trainer(write_config(zero3, tmp_path / "zero3.json"))
    assert refused.returncode != 0
    assert "was written by another layout" in refused.stderr
    assert "'zeroStage': 2" in refused.stderr and "'zeroStage': 3" in refused.stderr
    assert "Traceback" not in refused.stderr.split("was written by another layout")[0][-500:]

    shutil.rmtree(zero3.checkpoint_dir)
    fresh = run_trainer(write_config(zero3, tmp_path / "zero3.json"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resum" not in fresh.stdout.lower() + fresh.stderr.lower()
    assert sorted(p.name for p in zero3.checkpoint_dir.iterdir()) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in first.checkpoint_dir.iterdir()) == ["step-000002", "step-000004"]
