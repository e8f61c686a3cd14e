"""The trainer refuses a model that is not the one the plan was made for: at preflight for a model directory
(config.json as JSON), and before loading weights from the config ``transformers`` resolves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.api.vocabulary import TerminationReason
from memfit.catalog.models import MODEL_PRESETS, model_preset
from memfit.contract.reader import ConfigError
from memfit.contract.sections import ModelConfig
from memfit.model_shape import ModelShape
from memfit_trainer.hf_config import transformers_config
from memfit_trainer.model import check_planned_shape
from memfit_trainer.preflight import check
from tests.planning_fixtures import DECLARED_LLAMA
from tests.trainer.runs import TINY_LLAMA, make_config, run_single_process, write_config

PLANNED = DECLARED_LLAMA


def saved_config(directory: Path, shape: ModelShape) -> Path:
    transformers_config(shape).save_pretrained(directory)
    return directory


def loading(directory: Path, shape: ModelShape):  # type: ignore[no-untyped-def]
    return ModelConfig(name_or_path=str(directory), architecture=shape)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_a_preset_matches_the_config_transformers_resolves_for_it(tmp_path: Path, name: str) -> None:
    shape = model_preset(name)
    check_planned_shape(loading(saved_config(tmp_path / name, shape), shape))


def test_another_shape_is_refused_before_any_weights_load(tmp_path: Path) -> None:
    directory = saved_config(tmp_path / "tiny", TINY_LLAMA)  # config.json only: no weights to load
    check_planned_shape(loading(directory, TINY_LLAMA))
    with pytest.raises(ConfigError) as refused:
        check_planned_shape(loading(directory, PLANNED))
    held, planned = str(refused.value).split(" but ")
    assert str(directory) in held and "hidden_size 64" in held and "2 layers" in held
    assert "hidden_size 512" in planned and "24 layers" in planned


def with_model(config, directory: Path, shape: ModelShape):  # type: ignore[no-untyped-def]
    return config.model_copy(update={"model": loading(directory, shape)})


def test_preflight_refuses_a_model_directory_of_another_shape_or_without_config(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    directory = saved_config(tmp_path / "tiny", TINY_LLAMA)
    check(with_model(config, directory, TINY_LLAMA), {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="24 layers"):
        check(with_model(config, directory, PLANNED), {"WORLD_SIZE": "2"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        check(with_model(config, tmp_path / "empty", TINY_LLAMA), {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="does not exist"):
        check(with_model(config, tmp_path / "absent", TINY_LLAMA), {"WORLD_SIZE": "2"})


@pytest.mark.slow
def test_the_trainer_started_on_another_model_exits_2_with_the_termination_message(tmp_path: Path) -> None:
    directory = saved_config(tmp_path / "tiny", TINY_LLAMA)
    config = with_model(make_config(tmp_path, world_size=1), directory, PLANNED)
    result = run_single_process(write_config(config, tmp_path / "config.json"), timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "hidden_size 64" in line and "hidden_size 512" in line
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == TerminationReason.CONFIG_ERROR and "24 layers" in message["message"]
    assert not Path(config.output_dir, "checkpoints").exists()
