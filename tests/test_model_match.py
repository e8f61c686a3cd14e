"""The planned shape against a model directory's config.json (memfit.contract.model_match): one
comparison, used by `memfit run --local` before torchrun and by the trainer before loading weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from memfit.catalog.models import MODEL_PRESETS, model_preset
from memfit.contract.model_match import (
    ModelDirectoryError,
    config_fields,
    model_directory_problem,
    read_model_config,
    shape_mismatch,
)
from memfit.model_shape import ModelFamily, ModelShape
from tests.planning_fixtures import DECLARED_LLAMA

PLANNED = DECLARED_LLAMA
TINY = replace(PLANNED, hidden_size=64, num_layers=2)


def config_json(directory: Path, shape: ModelShape, **extra: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps({"model_type": shape.family.value, **config_fields(shape), **extra})
    )
    return directory


def test_the_same_shape_matches() -> None:
    assert shape_mismatch(PLANNED, {"model_type": "llama", **config_fields(PLANNED)}, "x") is None


def test_a_mismatch_names_both_sizes(tmp_path: Path) -> None:
    directory = config_json(tmp_path / "model", TINY)
    problem = model_directory_problem(directory, PLANNED)
    assert problem is not None
    held, planned = problem.split(" but ")
    assert str(directory) in held and "hidden_size 64" in held and "2 layers" in held
    assert "hidden_size 512" in planned and "24 layers" in planned
    assert "intermediate_size" not in problem  # only what differs
    assert "\n" not in problem


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_matches_its_own_fields_and_not_another_family(name: str) -> None:
    shape = model_preset(name)
    assert shape_mismatch(shape, {"model_type": shape.family.value, **config_fields(shape)}, name) is None
    other = "qwen2" if shape.family is not ModelFamily.QWEN2 else "llama"
    problem = shape_mismatch(shape, {"model_type": other, **config_fields(shape)}, name)
    assert problem is not None and f"a {other} model" in problem and f"a {shape.family.value} model" in problem


def test_fields_the_config_does_not_state_are_not_compared() -> None:
    stated = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 24, "head_dim": None}
    assert shape_mismatch(PLANNED, stated, "x") is None


def test_booleans_are_not_numbers() -> None:
    stated = {**config_fields(PLANNED), "tie_word_embeddings": 0}
    assert shape_mismatch(PLANNED, stated, "x") is not None


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirectoryError, match="no config.json"):
        read_model_config(tmp_path / "empty")
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        read_model_config(tmp_path / "absent")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert "cannot be read as JSON" in (model_directory_problem(tmp_path / "broken", PLANNED) or "")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[]")
    assert "no JSON object" in (model_directory_problem(tmp_path / "list", PLANNED) or "")
