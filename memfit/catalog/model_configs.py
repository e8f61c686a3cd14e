"""The config.json files memfit ships for models its presets do not cover (see configs/README.md).

``memfit profile qwen3-8b`` profiles the stored file by name; a path profiles any other model.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS_DIR = Path(__file__).parent / "configs"


def stored_config_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.json"))


def stored_config_path(name: str) -> Path | None:
    """The stored config.json called ``name`` (``qwen3-8b``), None if memfit stores none by that name."""
    return CONFIGS_DIR / f"{name}.json" if name in stored_config_names() else None
