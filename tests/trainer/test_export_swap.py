"""The final export replaces an earlier one only once it is complete (memfit_trainer.export): a rerun of a
finished job never leaves the output without a complete ``final/``."""

from __future__ import annotations

from pathlib import Path

from memfit_trainer.export import _swap_into_place


def export(directory: Path, text: str) -> Path:
    directory.mkdir()
    (directory / "model.safetensors").write_text(text)
    return directory


def test_the_new_export_replaces_the_old_and_nothing_else_is_left(tmp_path: Path) -> None:
    final = export(tmp_path / "final", "old")
    _swap_into_place(export(tmp_path / "final.tmp", "new"), final)
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_swap_interrupted_between_its_renames_is_redone(tmp_path: Path) -> None:
    """A crash after the old export was renamed aside: both exports are on disk; the rerun's swap completes."""
    export(tmp_path / "final.previous", "old")
    _swap_into_place(export(tmp_path / "final.tmp", "new"), tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
