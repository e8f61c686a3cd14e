"""Is the model a directory holds the one the plan was made for?

The plan is made for the typed shape of ``spec.model.architecture`` (explicit sizes or a preset); the
weights come from ``model.source`` (or the Hub). Nothing else ties the two together, so a model directory
holding another model would train (and fit, or not) against a plan made for something else. Both sides
compare the same fields, defined once here: ``memfit run --local`` parses the directory's ``config.json`` as
JSON before starting torchrun (no ``transformers`` in the core), and the trainer compares the config
``transformers`` resolves (defaults filled in) before it loads any weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memfit.model_shape import ModelFamily, ModelShape

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""A model's config.json is a few kilobytes; anything far larger is not one."""
FIX = "fix spec.model.architecture (or plan the job again) or point model.source at the planned model"


class ModelDirectoryError(ValueError):
    """The model directory is missing, or holds no readable config.json."""


def config_fields(shape: ModelShape) -> dict[str, Any]:
    """The ``transformers`` config fields (config.json keys) the shape fixes, with their values: what
    ``memfit_trainer.hf_config.transformers_config`` builds a model from, and what a loaded model is held to."""
    fields: dict[str, Any] = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
    }
    if shape.family is not ModelFamily.PHI3:
        fields["head_dim"] = shape.dim_head
    if shape.family in (ModelFamily.LLAMA, ModelFamily.MISTRAL, ModelFamily.MIXTRAL):
        fields["attention_bias"] = shape.attention_bias
    if shape.family is ModelFamily.MIXTRAL:
        fields["num_local_experts"] = shape.num_experts
        fields["num_experts_per_tok"] = shape.experts_per_token
    return fields


def _describe(key: str, value: Any) -> str:
    if key == "model_type":
        return f"a {value} model"
    if key == "num_hidden_layers":
        return f"{value} layers"
    return f"{key} {value}"


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _same(loaded: Any, planned: Any) -> bool:
    if isinstance(planned, bool) or isinstance(loaded, bool):
        return loaded is planned
    return bool(loaded == planned)


def shape_mismatch(shape: ModelShape, loaded: Mapping[str, Any], source: str) -> str | None:
    """One line naming every field the model config ``loaded`` (config.json's keys) holds differently from
    the planned ``shape``, or None when they agree (:func:`fields_mismatch`)."""
    return fields_mismatch({"model_type": shape.family.value, **config_fields(shape)}, loaded, source)


def _stated(loaded: Mapping[str, Any], key: str) -> Any:
    """``loaded``'s value of ``key``: ``model_type`` at the top, sizes in the text config of a multimodal one."""
    text = loaded.get("text_config")
    return loaded.get(key) if key == "model_type" or not isinstance(text, Mapping) else text.get(key)


def fields_mismatch(planned: Mapping[str, Any], loaded: Mapping[str, Any], source: str) -> str | None:
    """One line naming every planned field the model config ``loaded`` holds differently, or None when they
    agree. A field the config does not state (or states as null) is not compared: ``transformers`` fills it
    with its class default, which only the trainer knows."""
    differ = [key for key, value in planned.items() if _stated(loaded, key) is not None]
    differ = [key for key in differ if not _same(_stated(loaded, key), planned[key])]
    if not differ:
        return None
    where = f"model directory {source}" if Path(source).is_dir() else f"model {source}"
    held = _join([_describe(key, _stated(loaded, key)) for key in differ])
    wanted = _join([_describe(key, planned[key]) for key in differ])
    return f"{where} holds {held}, but the plan was made for {wanted}: {FIX}"


def read_model_config(directory: str | Path) -> dict[str, Any]:
    """The directory's config.json as parsed JSON; ModelDirectoryError in one line when there is none."""
    path = Path(directory)
    if not path.exists():
        raise ModelDirectoryError(f"model directory {directory} does not exist")
    if not path.is_dir():
        raise ModelDirectoryError(f"model directory {directory} is not a directory")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ModelDirectoryError(
            f"model directory {directory} holds no {CONFIG_FILE} (a model saved with save_pretrained has one)"
        )
    try:
        too_large = file.stat().st_size > MAX_CONFIG_BYTES
        loaded = None if too_large else json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelDirectoryError(f"{file} cannot be read as JSON: {error}") from None
    if too_large:
        raise ModelDirectoryError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes: not a model config")
    if not isinstance(loaded, dict):
        raise ModelDirectoryError(f"{file} holds no JSON object")
    return loaded


def model_directory_problem(
    directory: str | Path, shape: ModelShape | None, planned_fields: Mapping[str, Any] | None = None
) -> str | None:
    """Why the model directory cannot be the planned model (missing, no config.json, another shape than the
    typed one or than the profiled ``planned_fields``), or None."""
    try:
        loaded = read_model_config(directory)
    except ModelDirectoryError as error:
        return str(error)
    if planned_fields is not None:
        return fields_mismatch(planned_fields, loaded, str(directory))
    return shape_mismatch(shape, loaded, str(directory)) if shape is not None else None
