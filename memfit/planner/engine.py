"""What the training engines differ in, for the step time: the traffic each engine makes, as one protocol
that each implements (:mod:`memfit.planner.engines`)."""

from __future__ import annotations

from typing import Protocol

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import Strategy
from memfit.planned_model import PlannedModel

CPU_ADAM_PARAMS_PER_SECOND_PER_NODE = 1.5e9
"""DeepSpeedCPUAdam updates per second on a modern dual-socket host (ZeRO-Offload paper order)."""


class EngineTraffic(Protocol):
    """The step-time facts that differ between training engines."""

    def communication_bytes(self, shape: PlannedModel, strategy: Strategy, trainable: int) -> float:
        """Bytes each rank moves through collectives per optimizer step (more than one GPU)."""
        ...

    def offload_seconds(self, shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
        """Seconds per optimizer step of host traffic and of the optimizer stepping on the host."""
        ...
