"""memfit-train's contract with the operator: exit codes, the one-line config error, the OOM message."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.api.vocabulary import Attention, TerminationReason
from memfit.contract.trainer_config import ConfigError
from memfit_trainer.oom import EXIT_CODE_OOM
from memfit_trainer.preflight import check
from tests.trainer.runs import make_config, run_single_process, run_trainer, trainer_env, write_config

PLANNED_PEAK = 123_456_789


def with_prediction(config):
    from memfit.contract.trainer_config import PredictionConfig

    prediction = PredictionConfig(
        strategy="test", peak_allocated_bytes=PLANNED_PEAK, total_bytes=2 * PLANNED_PEAK,
        gpu_memory_bytes=4 * PLANNED_PEAK, tokens_per_second=1000.0,
    )  # fmt: skip
    return config.model_copy(update={"prediction": prediction})


def test_unreadable_config_fails_fast_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"version": 1, "job": "x/y"}))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "memfit_trainer.main", "--config", str(bad)],
        env=trainer_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit-train: ") and "model" in lines[0], result.stderr
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_config_this_machine_cannot_run_fails_before_any_work(tmp_path: Path) -> None:
    config = make_config(tmp_path)  # planned for 2 ranks, started as 1
    deepspeed = {**config.deepspeed}
    deepspeed["zero_optimization"] = {
        **deepspeed["zero_optimization"], "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "absent")}
    }  # fmt: skip
    training = config.training.model_copy(update={"attention": Attention.FLASH})
    config = config.model_copy(update={"deepspeed": deepspeed, "training": training})
    result = run_single_process(write_config(config, tmp_path / "config.json"), timeout=120)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "1 rank(s) started but the plan is for 2" in line
    assert "flash-attn" in line
    assert "nvme_path" in line
    assert not Path(config.output_dir, "checkpoints").exists()
    message = json.loads(Path(config.termination_log).read_text())  # what the operator reads from the pod
    assert message == {"reason": TerminationReason.CONFIG_ERROR, "message": line.removeprefix("memfit-train: ")}


def test_preflight_accepts_a_runnable_config(tmp_path: Path) -> None:
    check(make_config(tmp_path), {"WORLD_SIZE": "2"})


def test_preflight_rejects_streaming_without_max_steps(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    data = config.data.model_copy(update={"streaming": True})
    training = config.training.model_copy(update={"max_steps": None, "epochs": 1})
    with pytest.raises(ConfigError, match="maxSteps"):
        check(config.model_copy(update={"data": data, "training": training}), {"WORLD_SIZE": "2"})


@pytest.mark.distributed
def test_oom_in_a_single_process_exits_86_with_the_termination_message(tmp_path: Path) -> None:
    config = with_prediction(make_config(tmp_path, world_size=1, max_steps=6))
    result = run_single_process(write_config(config, tmp_path / "config.json"), MEMFIT_TEST_INJECT_OOM_AT_STEP="3")
    assert result.returncode == EXIT_CODE_OOM, result.stderr[-3000:]
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == TerminationReason.OUT_OF_MEMORY
    assert message["step"] == 3
    assert message["plannedPeakBytes"] == PLANNED_PEAK
    assert "MEMFIT_TEST_INJECT_OOM_AT_STEP" in message["message"]


@pytest.mark.distributed
def test_oom_under_torchrun_keeps_the_reason_in_the_termination_message(tmp_path: Path) -> None:
    config = with_prediction(make_config(tmp_path, max_steps=6))
    result = run_trainer(write_config(config, tmp_path / "config.json"), MEMFIT_TEST_INJECT_OOM_AT_STEP="2")
    assert result.returncode == 1  # torchrun reports any failed worker as 1
    assert f"exitcode  : {EXIT_CODE_OOM}" in result.stderr
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == TerminationReason.OUT_OF_MEMORY and message["step"] == 2
