"""The checkpoint layout: what decides whether a checkpoint loads under another plan.

DeepSpeed shards a checkpoint by method, precision, master weights (fp32 or bf16 optimizer partitions), ZeRO
stage and world size; a run of another layout cannot load it directly. The fsdp2 engine writes
``torch.distributed.checkpoint`` checkpoints, which load into any world size and sharding: its layout is
method, precision and master weights only. The planner's re-plan
(memfit.planner.replan) prefers a plan of the failed plan's layout, and the trainer keeps one checkpoint
directory per layout; after a re-plan to another layout it converts the newest checkpoint of another layout
where :meth:`CheckpointLayout.converts_to` says a conversion exists (DeepSpeed's universal checkpoint), and
the operator's Event says which will happen: all use this one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    def converts_to(self, other: CheckpointLayout) -> str | None:
        """Why a run of layout ``other`` cannot resume from a checkpoint of this layout, or ``None`` where it can
        (the same layout, or a conversion through DeepSpeed's universal checkpoint: DeepSpeed at ZeRO 1-3 and
        any world size to fsdp2 or to DeepSpeed at another world size and stage, except ZeRO-3 to 1-2). Pure,
        so that the operator's Event says what the trainer will do."""
        if self == other:
            return None
        for name in ("method", "precision", "master_weights"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the {name.replace('_', ' ')} changed ({mine} to {theirs}): the trained state differs"
        if self.engine == Engine.FSDP2:
            return "no conversion from fsdp2's torch.distributed.checkpoint to DeepSpeed's sharding exists"
        if self.master_weights != MasterWeights.FP32:
            return "DeepSpeed's universal checkpoint is converted with fp32 master weights only"
        for layout in (self, other):
            if layout.engine == Engine.DEEPSPEED and layout.zero_stage == 0:
                return "DeepSpeed checkpoints are converted here from and to ZeRO stages 1-3 only, not ZeRO-0"
        if self.zero_stage == 3 and other.engine == Engine.DEEPSPEED and other.zero_stage != 3:
            # Its files hold flat tensors without the {"param": ...} dict ZeRO-1/2's loader reads.
            return "DeepSpeed's universal checkpoint of ZeRO-3 loads into ZeRO-3 or fsdp2 only"
        return None

    @classmethod
    def from_dict(cls, recorded: Mapping[str, object]) -> CheckpointLayout:
        """The layout a checkpoint's marker records (:meth:`to_dict`); ``ValueError`` on a malformed one."""
        try:
            return cls(
                Method(str(recorded["method"])),
                Precision(str(recorded["precision"])),
                int(str(recorded["zeroStage"])),
                int(str(recorded["worldSize"])),
                MasterWeights(str(recorded.get("masterWeights", MasterWeights.FP32))),
                Engine(str(recorded.get("engine", Engine.DEEPSPEED))),
            )
        except (KeyError, ValueError) as error:
            raise ValueError(f"not a checkpoint layout: {dict(recorded)} ({error})") from None

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
