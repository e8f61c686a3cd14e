"""memfit-train's contract with the operator: exit codes, the one-line config error, the OOM message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit.api.vocabulary import Attention, Devices, TerminationReason
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.reader import ConfigError
from memfit.contract.sections import VolumesConfig
from memfit_trainer.deepspeed_engine import engine_config
from memfit_trainer.oom import EXIT_CODE_OOM
from memfit_trainer.preflight import check
from tests.trainer.runs import make_config, run_single_process, run_trainer, trainer_env, write_config

PLANNED_PEAK = 123_456_789


def with_prediction(config):
    from memfit.contract.sections import PredictionConfig

    prediction = PredictionConfig(
        strategy="test", peak_allocated_bytes=PLANNED_PEAK, total_bytes=2 * PLANNED_PEAK,
        gpu_memory_bytes=4 * PLANNED_PEAK, tokens_per_second=1000.0,
    )  # fmt: skip
    return config.model_copy(update={"prediction": prediction})


FAILS_BEFORE_ANY_WORK = """import sys
from memfit_trainer.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed", "transformers"))
print(" ".join(heavy))
sys.exit(code)
"""
"""``memfit-train`` that reports the heavy libraries it imported before exiting."""


def test_unreadable_config_fails_fast_with_one_line(tmp_path: Path) -> None:
    """Fast by construction, whatever the machine: the config is refused before torch is even imported."""
    bad = tmp_path / "config.json"
    log = tmp_path / "termination-log"
    bad.write_text(json.dumps({"version": 1, "job": "x/y", "terminationLog": str(log)}))
    result = subprocess.run(
        [sys.executable, "-c", FAILS_BEFORE_ANY_WORK, "--config", str(bad)],
        env=trainer_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit-train: ") and "model" in lines[0], result.stderr
    assert result.stdout.strip() == "", f"imported before refusing the config: {result.stdout}"
    message = json.loads(log.read_text())  # the config's own terminationLog, although the config is invalid
    assert message == {"reason": TerminationReason.CONFIG_ERROR, "message": lines[0].removeprefix("memfit-train: ")}


@pytest.mark.slow
def test_config_this_machine_cannot_run_fails_before_any_work(tmp_path: Path) -> None:
    config = make_config(tmp_path, stage=3)  # planned for 2 ranks, started as 1; NVMe parameters need ZeRO-3
    assert isinstance(config.engine, DeepSpeedEngineSection)
    deepspeed = {**config.engine.config}
    deepspeed["zero_optimization"] = {
        **deepspeed["zero_optimization"], "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "absent")}
    }  # fmt: skip
    training = config.training.model_copy(update={"attention": Attention.FLASH})
    config = config.model_copy(update={"engine": DeepSpeedEngineSection(config=deepspeed), "training": training})
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


def test_a_gpu_plan_where_no_cuda_device_is_seen_is_refused_at_start(tmp_path: Path) -> None:
    assert not torch.cuda.is_available()  # this machine: what a pod on a node without a working device plugin sees
    config = make_config(tmp_path)
    check(config.model_copy(update={"devices": Devices.CPU}), {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="the plan is for NVIDIA GPUs but this container sees no CUDA device"):
        check(config.model_copy(update={"devices": Devices.CUDA}), {"WORLD_SIZE": "2"})


def test_preflight_leaves_room_for_every_local_ranks_metrics_port(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config = config.model_copy(update={"metrics": config.metrics.model_copy(update={"port": 65534})})
    check(config, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="metrics.port 65534"):
        check(config, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "8"})


def test_preflight_creates_nothing_outside_the_output_volume(tmp_path: Path) -> None:
    volume, elsewhere = tmp_path / "volume", tmp_path / "elsewhere"
    volume.mkdir()
    elsewhere.mkdir()
    (volume / "job").symlink_to(elsewhere)
    config = make_config(tmp_path)
    volumes = VolumesConfig(data=str(tmp_path), output=str(volume))
    config = config.model_copy(update={"output_dir": str(volume / "job" / "output"), "volumes": volumes})
    with pytest.raises(ConfigError, match="outside its volume"):
        check(config, {"WORLD_SIZE": "2"})
    assert list(elsewhere.iterdir()) == []
    check(config.model_copy(update={"output_dir": str(volume / "output")}), {"WORLD_SIZE": "2"})


def test_engine_config_fills_what_the_deepspeed_section_leaves_out(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    bare = config.model_copy(update={"engine": DeepSpeedEngineSection(config={"zero_optimization": {"stage": 2}})})
    filled = engine_config(bare, client=False)
    assert filled["train_micro_batch_size_per_gpu"] == config.training.micro_batch_size
    assert filled["gradient_accumulation_steps"] == config.training.gradient_accumulation_steps
    assert filled["train_batch_size"] == config.training.global_batch_size
    assert filled["bf16"] == {"enabled": True} and "fp16" not in filled
    assert isinstance(config.engine, DeepSpeedEngineSection)
    assert engine_config(config, client=False)["bf16"] == config.engine.config["bf16"]  # what is given is kept


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
