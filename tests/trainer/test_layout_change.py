"""Checkpoints are kept per sharding layout (method, precision, ZeRO stage, world size, engine). After a re-plan
to another layout (the operator's answer to an out-of-memory failure) the run converts the newest checkpoint
of another layout through DeepSpeed's universal checkpoint where a conversion exists, resumes at its step and
data position, and leaves the source as it was; where none exists (a method change) it starts from the
weights and says why. A checkpoint copied by hand under the wrong layout is refused with one clear line."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.checkpoint import DEEPSPEED_TAG as TAG
from tests.trainer.runs import (
    config_over_a_copy,
    logged_losses,
    make_config,
    run_single_process,
    run_trainer,
    write_config,
)

pytestmark = pytest.mark.distributed


def _tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` by its content."""
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _marker(step_dir: Path) -> dict[str, Any]:
    return dict(json.loads((step_dir / "COMPLETE").read_text()))


FAILED: dict[str, Any] = dict(stage=2, max_steps=8, checkpoint_every=4, name="replan")
FINISHED: dict[str, Any] = dict(stage=2, max_steps=4, checkpoint_every=2, name="layout")


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """DeepSpeed ZeRO-2 at 2 ranks, 8 steps planned, a checkpoint at step 4, out of memory at step 6: the
    directory it ran in and what it printed. Run once; each test converts a copy of it."""
    directory = tmp_path_factory.mktemp("failed")
    source = make_config(directory, **FAILED)
    failed = run_trainer(write_config(source, directory / "source.json"), MEMFIT_TEST_INJECT_OOM_AT_STEP="6")
    assert failed.returncode != 0
    assert sorted(p.name for p in source.checkpoint_dir.iterdir()) == ["step-000004"]
    return directory, failed.stdout


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed ZeRO-2 at 2 ranks, finished after 4 steps with checkpoints at 2 and 4: the directory it ran in.
    Run once; each test starts from a copy of it."""
    directory = tmp_path_factory.mktemp("finished")
    first = make_config(directory, **FINISHED)
    done = run_trainer(write_config(first, directory / "zero2.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def _failed_source(tmp_path: Path, failed_run: tuple[Path, str]) -> tuple[TrainerConfig, str]:
    """A copy of the failed run: its config and what it printed."""
    directory, stdout = failed_run
    return config_over_a_copy(directory, tmp_path, **FAILED), stdout


def _loss_continues(source_stdout: str, resumed_stdout: str) -> None:
    """The resumed run logs from step 5 on, with a loss far below the untrained model's at step 1."""
    resumed = logged_losses(resumed_stdout)
    assert min(resumed) == 5
    assert resumed[5] < logged_losses(source_stdout)[1] - 0.3


def _universal(source_step: Path, out: Path) -> Path:
    """DeepSpeed's own universal conversion of a source checkpoint: the expected full fp32 states."""
    from deepspeed.checkpoint.ds_to_universal import main

    folders = {"input_folder": str(source_step / TAG), "output_folder": str(out / TAG)}
    workers = {"num_extract_workers": 1, "num_merge_workers": 1}
    main(argparse.Namespace(**folders, **workers, keep_temp_folder=False, strict=True, inject_missing_state=True))
    return out / TAG / "zero"


def test_zero2_at_2_ranks_converts_to_zero3_at_1_rank(tmp_path: Path, failed_run: tuple[Path, str]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    source, source_stdout = _failed_source(tmp_path, failed_run)
    before = _tree_digest(source.checkpoint_dir)

    target = make_config(tmp_path, **{**FAILED, "stage": 3}, world_size=1)
    resumed = run_single_process(write_config(target, tmp_path / "target.json"))  # 1 rank: no torchrun needed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 4 (converted from full-bf16-zero2-2ranks/step-000004" in resumed.stdout
    _loss_continues(source_stdout, resumed.stdout)

    assert _tree_digest(source.checkpoint_dir) == before
    assert sorted(p.name for p in target.checkpoint_dir.iterdir()) == ["step-000004", "step-000008"]
    converted, original = target.checkpoint_dir / "step-000004", source.checkpoint_dir / "step-000004"
    marker, source_marker = _marker(converted), _marker(original)
    assert marker["convertedFrom"] == {"layout": source.layout.to_dict(), "step": 4,
                                       "directory": "full-bf16-zero2-2ranks"}  # fmt: skip
    assert marker["layout"] == target.layout.to_dict()
    # The same blocks consumed: 2 ranks' micro-batch counter counts twice as many at 1 rank.
    assert marker["dataPosition"]["microBatch"] == 2 * source_marker["dataPosition"]["microBatch"]
    weights = get_fp32_state_dict_from_zero_checkpoint(str(converted), tag=TAG)
    expected = get_fp32_state_dict_from_zero_checkpoint(str(original), tag=TAG)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


def test_deepspeed_converts_to_fsdp2_with_its_weights_optimizer_states_and_lr(
    tmp_path: Path, failed_run: tuple[Path, str]
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, source_stdout = _failed_source(tmp_path, failed_run)
    before = _tree_digest(source.checkpoint_dir)

    target = make_config(tmp_path, **{**FAILED, "stage": 3}, engine="fsdp2")
    resumed = run_trainer(write_config(target, tmp_path / "target.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 4 (converted from full-bf16-zero2-2ranks/step-000004" in resumed.stdout
    _loss_continues(source_stdout, resumed.stdout)
    assert _tree_digest(source.checkpoint_dir) == before
    converted = target.checkpoint_dir / "step-000004"
    assert _marker(converted)["convertedFrom"]["step"] == 4
    assert _marker(converted)["dataPosition"] == _marker(source.checkpoint_dir / "step-000004")["dataPosition"]

    dcp_to_torch_save(converted / "dcp", tmp_path / "converted.pt")
    state = torch.load(tmp_path / "converted.pt", weights_only=False)
    zero = _universal(source.checkpoint_dir / "step-000004", tmp_path / "universal")
    names = sorted(p.name for p in zero.iterdir() if p.is_dir())
    assert sorted(state["model"]) == names
    for name in names:
        expected = {key: torch.load(zero / name / f"{key}.pt", weights_only=False)["param"]
                    for key in ("fp32", "exp_avg", "exp_avg_sq")}  # fmt: skip
        assert torch.equal(state["model"][name], expected["fp32"])
        optimizer = state["optimizer"]["state"][name]
        assert torch.equal(optimizer["exp_avg"], expected["exp_avg"])
        assert torch.equal(optimizer["exp_avg_sq"], expected["exp_avg_sq"])
        assert float(optimizer["step"]) == 4
    schedule = torch.load(zero.parent / "mp_rank_00_model_states.pt", weights_only=False)["lr_scheduler"]
    assert state["scheduler"]["last_epoch"] == schedule["last_epoch"] == 4
    assert state["scheduler"]["_last_lr"] == schedule["_last_lr"]
    assert [group["lr"] for group in state["optimizer"]["param_groups"]] == schedule["_last_lr"]


def test_a_method_change_starts_from_the_weights_and_says_why(tmp_path: Path, finished_run: Path) -> None:
    source = config_over_a_copy(finished_run, tmp_path, **FINISHED)
    before = _tree_digest(source.checkpoint_dir)

    lora = make_config(tmp_path, **FINISHED, method="lora")
    fresh = run_trainer(write_config(lora, tmp_path / "lora.json"))
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (
        "a conversion from full-bf16-zero2-2ranks to lora-bf16-zero2-2ranks does not exist "
        "(the method changed (full to lora)" in fresh.stderr
    )
    assert "starting from the weights" in fresh.stderr
    assert "resumed" not in fresh.stdout
    assert min(logged_losses(fresh.stdout)) == 1
    assert sorted(p.name for p in lora.checkpoint_dir.iterdir()) == ["step-000002", "step-000004"]
    assert _tree_digest(source.checkpoint_dir) == before


def test_a_misplaced_checkpoint_is_refused_and_in_its_own_directory_converted(
    tmp_path: Path, finished_run: Path
) -> None:
    first = config_over_a_copy(finished_run, tmp_path, **FINISHED)
    zero3 = make_config(tmp_path, **{**FINISHED, "stage": 3})
    assert first.checkpoint_dir.parent == zero3.checkpoint_dir.parent != zero3.checkpoint_dir
    shutil.copytree(first.checkpoint_dir, zero3.checkpoint_dir)  # a ZeRO-2 checkpoint where ZeRO-3 looks
    refused = run_trainer(write_config(zero3, tmp_path / "zero3.json"))
    assert refused.returncode != 0
    assert "was written by another layout" in refused.stderr
    assert "'zeroStage': 2" in refused.stderr and "'zeroStage': 3" in refused.stderr
    assert "Traceback" not in refused.stderr.split("was written by another layout")[0][-500:]

    shutil.rmtree(zero3.checkpoint_dir)
    converted = run_trainer(write_config(zero3, tmp_path / "zero3.json"))
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "resumed from checkpoint step 4 (converted from full-bf16-zero2-2ranks/step-000004" in converted.stdout
    assert sorted(p.name for p in zero3.checkpoint_dir.iterdir()) == ["step-000004"]
    assert sorted(p.name for p in first.checkpoint_dir.iterdir()) == ["step-000002", "step-000004"]
