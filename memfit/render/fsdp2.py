"""The FSDP2 engine's settings of a plan (what the trainer passes to ``fully_shard``); no DeepSpeed JSON."""

from __future__ import annotations

from memfit.api.knobs import conflicts as knob_conflicts
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Engine, MasterWeights, Offload, Precision
from memfit.contract.engines import Fsdp2EngineSection


def fsdp2_config(strategy: Strategy) -> Fsdp2EngineSection:
    """ZeRO-3 reshards each layer's parameters after its forward, ZeRO-2 keeps them gathered until the
    backward; offload is CPUOffloadPolicy; gradients are reduced in fp32 with fp32 masters, else in bf16."""
    s = strategy
    assert s.engine == Engine.FSDP2
    conflicts = knob_conflicts(s.knobs())
    if conflicts:
        raise ValueError(f"strategy {s.summary()!r} cannot run as planned: " + "; ".join(conflicts))
    pure_bf16 = s.master_weights == MasterWeights.BF16 or s.precision == Precision.FP32
    return Fsdp2EngineSection(
        reshard_after_forward=s.zero_stage == 3,
        cpu_offload=s.offload_parameters == Offload.CPU,
        reduce_dtype=Precision.BF16 if pure_bf16 and s.precision == Precision.BF16 else Precision.FP32,
        optimizer_in_backward=s.optimizer_in_backward,
    )
