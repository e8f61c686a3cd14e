"""The run's length, its learning-rate schedule, the DeepSpeed flags a client optimizer needs and the registry
of engines."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from memfit.api.vocabulary import Engine
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.reader import ConfigError
from memfit_trainer.console import ConsoleProgress, format_duration
from memfit_trainer.deepspeed_engine import deepspeed_arch_list, engine_config
from memfit_trainer.engine import ENGINES, PROCESS_GROUPS
from memfit_trainer.optimization import total_optimizer_steps, warmup_cosine
from tests.trainer.runs import make_config


def test_max_steps_wins_over_epochs(tmp_path: Path) -> None:
    training = make_config(tmp_path, max_steps=7).training.model_copy(update={"epochs": 3})
    assert total_optimizer_steps(training, 100) == 7


def test_epochs_count_full_optimizer_steps(tmp_path: Path) -> None:
    training = make_config(tmp_path).training.model_copy(
        update={"max_steps": None, "epochs": 3, "gradient_accumulation_steps": 4}
    )
    assert total_optimizer_steps(training, 10) == 7  # 30 micro-batches make 7 steps of 4
    with pytest.raises(ConfigError, match="maxSteps"):
        total_optimizer_steps(training, None)


def test_schedule_warms_up_linearly_then_decays_to_zero() -> None:
    factor = warmup_cosine(total_steps=100, warmup_ratio=0.1)
    warmup = [factor(s) for s in range(10)]
    assert warmup == sorted(warmup) and 0 < warmup[0] < warmup[-1] < 1
    assert factor(10) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.5)
    assert factor(100) == pytest.approx(0.0)


def test_client_optimizer_flags(tmp_path: Path) -> None:
    config = make_config(tmp_path, optimizer="adafactor", offload=True)  # 8-bit states are never offloaded
    flags = engine_config(config, client=True)
    assert flags["zero_allow_untested_optimizer"] is True
    assert flags["zero_force_ds_cpu_optimizer"] is False
    assert isinstance(config.engine, DeepSpeedEngineSection)
    assert "zero_force_ds_cpu_optimizer" not in config.engine.config  # the config itself is not modified
    assert "zero_force_ds_cpu_optimizer" not in engine_config(make_config(tmp_path, offload=True), client=False)


def test_console_progress_is_plain_throttled_and_rank0_only() -> None:
    out = io.StringIO()
    progress = ConsoleProgress(10, enabled=True, interval=3600, stream=out)
    for step in range(1, 11):
        progress.step(step, loss=2.5, learning_rate=1e-4, tokens=100)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/10", "10/10"]
    assert "\r" not in out.getvalue() and "eta 0:00:00" in lines[-1]
    quiet = io.StringIO()
    ConsoleProgress(10, enabled=False, stream=quiet).step(1, loss=1.0, learning_rate=1.0, tokens=1)
    assert quiet.getvalue() == "" and format_duration(3725) == "1:02:05"


def test_every_engine_of_the_vocabulary_has_a_builder() -> None:
    assert set(ENGINES) == set(Engine)


def test_every_engine_of_the_vocabulary_starts_its_process_group() -> None:
    assert set(PROCESS_GROUPS) == set(Engine)


@pytest.mark.parametrize(
    ("listed", "readable"),
    [("9.0a", "9.0"), ("8.0;9.0a;10.0f+PTX", "8.0;9.0;10.0+PTX"), ("8.6 9.0+PTX", "8.6;9.0+PTX"), ("9.0;9.0a", "9.0")],
)
def test_cuda_arch_suffixes_are_dropped_for_deepspeeds_op_builder(listed: str, readable: str) -> None:
    assert deepspeed_arch_list(listed) == readable
    # what DeepSpeed's compute_capability_args does with each entry (it raised ValueError on "9.0a")
    assert all(int(part.split("+")[0]) >= 0 for cc in readable.split(";") for part in cc.split("."))
