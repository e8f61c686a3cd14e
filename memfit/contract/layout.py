"""The checkpoint layout: what decides whether a checkpoint loads under another plan.

DeepSpeed shards a checkpoint by method, precision, master weights (fp32 or bf16 optimizer partitions), ZeRO
stage and world size; a run of another layout cannot load it directly. The fsdp2 engine writes
``torch.distributed.checkpoint`` checkpoints, which load into any world size and sharding: its layout is
method, precision and master weights only. The planner's re-plan
(memfit.planner.replan) prefers a plan of the failed plan's layout, and the trainer keeps one checkpoint
directory per layout and refuses a checkpoint of another: both use this one definition.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.api.plan import Strategy
from memfit.api.vocabulary import Engine, MasterWeights, Method, Precision


class CheckpointLayout(NamedTuple):
    method: Method
    precision: Precision
    zero_stage: int
    world_size: int
    master_weights: MasterWeights = MasterWeights.FP32
    engine: Engine = Engine.DEEPSPEED

    @classmethod
    def of(cls, strategy: Strategy) -> CheckpointLayout:
        return cls.of_run(strategy.method, strategy.precision, strategy.zero_stage, strategy.gpus,
                          strategy.master_weights, strategy.engine)  # fmt: skip

    @classmethod
    def of_run(
        cls,
        method: Method,
        precision: Precision,
        zero_stage: int,
        world_size: int,
        master_weights: MasterWeights,
        engine: Engine,
    ) -> CheckpointLayout:
        """The layout of a run; on fsdp2 the stage and world size do not matter (recorded as 0)."""
        if engine == Engine.FSDP2:
            zero_stage = world_size = 0
        return cls(method, precision, zero_stage, world_size, master_weights, engine)

    @property
    def directory_name(self) -> str:
        """The checkpoint directory of this layout, e.g. ``full-bf16-zero2-8ranks`` (``-bf16masters`` appended
        with bf16 master weights, so that fp32-master directories keep the names they always had), or on
        fsdp2 ``full-bf16-fsdp2``."""
        masters = "" if self.master_weights == MasterWeights.FP32 else f"-{self.master_weights}masters"
        if self.engine == Engine.FSDP2:
            return f"{self.method}-{self.precision}-fsdp2{masters}"
        return f"{self.method}-{self.precision}-zero{self.zero_stage}-{self.world_size}ranks{masters}"

    def to_dict(self) -> dict[str, str | int]:
        """As recorded in a checkpoint's marker file (fp32 masters recorded as before they were a choice, so
        that older checkpoints still load)."""
        recorded: dict[str, str | int] = {"method": self.method, "precision": self.precision,
                                          "zeroStage": self.zero_stage, "worldSize": self.world_size}  # fmt: skip
        if self.master_weights != MasterWeights.FP32:
            recorded["masterWeights"] = self.master_weights
        if self.engine != Engine.DEEPSPEED:
            recorded["engine"] = self.engine
        return recorded
