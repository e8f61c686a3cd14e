"""A checkpoint written under another sharding layout (ZeRO stage, world size, precision, method) is
refused at start with one clear line, instead of failing deep inside DeepSpeed's loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.runs import make_config, run_trainer, write_config

pytestmark = pytest.mark.distributed


def test_resuming_under_another_zero_stage_is_refused(tmp_path: Path) -> None:
    first = make_config(tmp_path, stage=2, max_steps=4, checkpoint_every=2, name="layout")
    done = run_trainer(write_config(first, tmp_path / "zero2.json"))
    assert done.returncode == 0, done.stderr[-3000:]

    longer = first.training.model_copy(update={"max_steps": 8})
    other = first.model_copy(update={"training": longer, "deepspeed": {**first.deepspeed,
                             "zero_optimization": {"stage": 3}}})  # fmt: skip
    refused = run_trainer(write_config(other, tmp_path / "zero3.json"))
    assert refused.returncode != 0
    assert "was written by another layout" in refused.stderr
    assert "'zeroStage': 2" in refused.stderr and "'zeroStage': 3" in refused.stderr
    assert "Traceback" not in refused.stderr.split("was written by another layout")[0][-500:]
