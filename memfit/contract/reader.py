"""Reading a trainer config file that may be hostile: every problem becomes one :class:`ConfigError` line.

Before validation the text itself is checked: UTF-8, at most ``MAX_CONFIG_BYTES``, one JSON object nested at
most ``MAX_CONFIG_DEPTH`` deep, no duplicate keys, no NaN or infinities (Python's json would accept all of
them). Validation then reads the JSON strictly (a string is never a number, a float never an integer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from memfit.api.loading import describe_validation_error
from memfit.contract.paths import MAX_PATH_LENGTH, absolute_path
from memfit.contract.trainer_config import TrainerConfig

# A trainer config is a few kilobytes of shallow JSON (a ConfigMap holds at most 1 MiB).
MAX_CONFIG_BYTES: Final = 1024 * 1024
MAX_CONFIG_DEPTH: Final = 16
"""Nesting of JSON objects and arrays (the deepest rendered key, engine.config.zero_optimization.offload_param.
device, is at depth 5)."""


class ConfigError(ValueError):
    """The config cannot be honoured; raised at start, before any GPU work.

    ``termination_log`` is where the config asked for the termination message when the config as a whole
    could not be read (None: the default path)."""

    def __init__(self, message: str, termination_log: str | None = None) -> None:
        super().__init__(message)
        self.termination_log = termination_log


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"the key {key!r} appears twice in one object")
        document[key] = value
    return document


def _depth(document: Any) -> int:
    """How deeply objects and arrays nest (without recursion: the document may be hostile)."""
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_CONFIG_DEPTH:
            break
        pending.extend((child, depth + 1) for child in children)
    return deepest


def _read_text(path: str | Path) -> str:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    except ValueError as error:  # a path with a NUL byte
        raise ConfigError(f"{path!r}: cannot read: {error}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes, not a trainer config")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 1]!r})"
        ) from None


def _parse(path: str | Path, text: str) -> dict[str, Any]:
    try:
        document = json.loads(text, parse_float=_finite, parse_constant=_not_a_number, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON: {error}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a trainer config: JSON nested too deeply") from None
    except ValueError as error:  # NaN, Infinity, 1e999, a duplicate key, an integer of thousands of digits
        raise ConfigError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: not a trainer config: expected a JSON object, got {type(document).__name__}")
    if _depth(document) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: not a trainer config: JSON nested deeper than {MAX_CONFIG_DEPTH} levels")
    return document


def _termination_log_of(document: dict[str, Any]) -> str | None:
    """The config's terminationLog, if it is usable although the rest of the config is not."""
    value = document.get("terminationLog")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH_LENGTH:
        return None
    try:
        return absolute_path(value)
    except ValueError:
        return None


def load_config(path: str | Path) -> TrainerConfig:
    """Read and validate a config file; every problem becomes one ConfigError line.

    JSON types are strict (``"8"`` is not a number, ``8.0`` not an integer, ``true`` neither); NaN,
    infinities, duplicate keys, non-UTF-8 bytes, files over ``MAX_CONFIG_BYTES`` and documents nested deeper
    than ``MAX_CONFIG_DEPTH`` are refused before validation."""
    text = _read_text(path)
    document = _parse(path, text)
    try:
        return TrainerConfig.model_validate_json(text, strict=True)
    except ValidationError as error:
        raise ConfigError(f"{path}: {describe_validation_error(error)}", _termination_log_of(document)) from None
