"""The checkpoint layout: what decides whether a checkpoint loads under another plan.

DeepSpeed shards a checkpoint by method, precision, ZeRO stage and world size; a run of another layout
cannot load it directly. The planner's re-plan (memfit.planner.replan) prefers a plan of the failed plan's
layout, and the trainer keeps one checkpoint directory per layout and refuses a checkpoint of another:
both use this one definition.
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.api.plan import Strategy
from memfit.api.vocabulary import Method, Precision


class CheckpointLayout(NamedTuple):
    method: Method
    precision: Precision
    zero_stage: int
    world_size: int

    @classmethod
    def of(cls, strategy: Strategy) -> CheckpointLayout:
        return cls(strategy.method, strategy.precision, strategy.zero_stage, strategy.gpus)

    @property
    def directory_name(self) -> str:
        """The checkpoint directory of this layout, e.g. ``full-bf16-zero2-8ranks``."""
        return f"{self.method}-{self.precision}-zero{self.zero_stage}-{self.world_size}ranks"

    def to_dict(self) -> dict[str, str | int]:
        """As recorded in a checkpoint's marker file."""
        return {"method": self.method, "precision": self.precision, "zeroStage": self.zero_stage,
                "worldSize": self.world_size}  # fmt: skip
