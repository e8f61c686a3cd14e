"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.trainer.runs import KilledRuns


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank in this process (the engines and collectives need one)."""
    assert not dist.is_initialized(), "a process group leaked from an earlier test in this process"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> KilledRuns:
    """Held-and-killed runs shared by the resumes of every test (one kill of each config and step)."""
    return KilledRuns(tmp_path_factory)
