"""The step-time traffic of each training engine, keyed by the engine a strategy names."""

from __future__ import annotations

from memfit.api.vocabulary import Engine
from memfit.planner.engine import EngineTraffic
from memfit.planner.engines.deepspeed import DeepSpeedTraffic
from memfit.planner.engines.fsdp2 import Fsdp2Traffic

ENGINE_TRAFFIC: dict[Engine, EngineTraffic] = {Engine.DEEPSPEED: DeepSpeedTraffic(), Engine.FSDP2: Fsdp2Traffic()}
