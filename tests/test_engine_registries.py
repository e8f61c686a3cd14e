"""Every engine of the vocabulary has its memory model and its traffic model in the core's registries (the
trainer's registry is checked in tests/trainer/test_engine.py)."""

from __future__ import annotations

from memfit.api.vocabulary import Engine
from memfit.memory.engines import ENGINE_MEMORY
from memfit.planner.engines import ENGINE_TRAFFIC


def test_every_engine_has_a_memory_model_and_a_traffic_model() -> None:
    assert set(ENGINE_MEMORY) == set(Engine)
    assert set(ENGINE_TRAFFIC) == set(Engine)
