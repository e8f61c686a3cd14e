"""The config.json files memfit ships: the models people fine-tune, and one per preset of the formula families
(see configs/README.md).

``memfit profile qwen3-8b`` profiles the stored file by name; a path profiles any other model. Their profiles
are stored too (``profiles/``): a job whose model directory holds one of these configs, or that names one as
its ``preset``, is planned from the stored profile without profiling anything.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from memfit.profile import ModelProfile, canonical_config_sha256
from memfit.profiled_model import ProfiledModel

CONFIGS_DIR = Path(__file__).parent / "configs"


@lru_cache(maxsize=2)
def _stems(directory: Path) -> tuple[str, ...]:
    """The names of ``directory``'s JSON files, sorted: package data, fixed while a process runs (validating a
    spec asks for them, and the planner validates thousands)."""
    return tuple(sorted(path.stem for path in directory.glob("*.json")))


def stored_config_names() -> list[str]:
    return list(_stems(CONFIGS_DIR))


def stored_config_path(name: str) -> Path | None:
    """The stored config.json called ``name`` (``qwen3-8b``), None if memfit stores none by that name."""
    return CONFIGS_DIR / f"{name}.json" if name in stored_config_names() else None


PROFILES_DIR = Path(__file__).parent / "profiles"
"""``NAME.json``: the profile of ``configs/NAME.json`` (``make profiles`` writes them; a test fails on drift)."""


def stored_profile_names() -> list[str]:
    """Stored configs whose profile is stored too."""
    return list(_stems(PROFILES_DIR))


@lru_cache(maxsize=64)
def stored_profile(name: str) -> ModelProfile | None:
    """The stored profile of the stored config ``name``, None if there is none."""
    path = PROFILES_DIR / f"{name}.json"
    return ModelProfile.model_validate_json(path.read_text(encoding="utf-8")) if path.is_file() else None


@lru_cache(maxsize=64)
def stored_profiled_model(name: str) -> ProfiledModel | None:
    """The planner's model of the stored profile ``name`` (built once: it serialises the profile for its key)."""
    profile = stored_profile(name)
    return ProfiledModel(profile) if profile is not None else None


@lru_cache(maxsize=1)
def _stored_config_hashes() -> dict[str, str]:
    """sha256 of each stored config.json's content -> its name."""
    return {
        canonical_config_sha256(json.loads((CONFIGS_DIR / f"{name}.json").read_text(encoding="utf-8"))): name
        for name in stored_config_names()
    }


def stored_profile_of(config_sha256: str) -> ModelProfile | None:
    """The stored profile of a config.json whose content is one of the stored configs', else None."""
    name = _stored_config_hashes().get(config_sha256)
    return stored_profile(name) if name is not None else None
