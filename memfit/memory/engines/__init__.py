"""The memory model of each training engine, keyed by the engine a strategy names."""

from __future__ import annotations

from memfit.api.vocabulary import Engine
from memfit.memory.engine import EngineMemory
from memfit.memory.engines.deepspeed import DeepSpeedMemory
from memfit.memory.engines.fsdp2 import Fsdp2Memory

ENGINE_MEMORY: dict[Engine, EngineMemory] = {Engine.DEEPSPEED: DeepSpeedMemory(), Engine.FSDP2: Fsdp2Memory()}
