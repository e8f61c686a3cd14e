"""PyTorch FSDP2's traffic per optimizer step: every micro-batch's all-gathers and reduce-scatters, and
with ``CPUOffloadPolicy`` the shards' copies over PCIe and the optimizer step on the host."""

from __future__ import annotations

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Method, Offload
from memfit.memory.engines.fsdp2 import fsdp2_widths
from memfit.planned_model import PlannedModel
from memfit.planner.engine import CPU_ADAM_PARAMS_PER_SECOND_PER_NODE


def _gathers(strategy: Strategy) -> int:
    """All-gathers of every parameter per micro-batch under FSDP2: forward, and backward again when
    resharding after forward (zero stage 3). A checkpointed layer's recomputation runs inside its backward,
    after its pre-backward unshard, so FSDPParamGroup.unshard finds it gathered: no third gather."""
    return 2 if strategy.zero_stage == 3 else 1


def fsdp2_communication_bytes(shape: PlannedModel, strategy: Strategy, trainable: int) -> float:
    """Bytes each rank moves per optimizer step under FSDP2: every micro-batch all-gathers all parameters
    (frozen ones too) in the gathered dtype and reduce-scatters the trained ones' gradients in
    ``reduce_dtype`` (no ``no_sync``: gradients are reduced every micro-batch), each a ring's (n-1)/n."""
    n = strategy.gpus
    w = fsdp2_widths(strategy.precision, strategy.master_weights)
    frozen = shape.parameter_count if strategy.method != Method.FULL else 0
    per_micro = _gathers(strategy) * (trainable + frozen) * w.gathered + trainable * w.reduce
    return (n - 1) / n * per_micro * strategy.gradient_accumulation_steps


def fsdp2_offload_seconds(shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
    """CPUOffloadPolicy: each all-gather copies the rank's parameter shards host-to-device, each reduced
    gradient shard goes device-to-host, every micro-batch; the optimizer steps the shards on the CPU."""
    n, per_node = strategy.gpus, strategy.gpus_per_node
    w = fsdp2_widths(strategy.precision, strategy.master_weights)
    frozen = shape.parameter_count if strategy.method != Method.FULL else 0
    shard = (trainable * w.sharded_trained + frozen * w.sharded_frozen) / n
    pcie = (_gathers(strategy) * shard + trainable * w.reduce / n) * strategy.gradient_accumulation_steps
    return pcie / pool.pcie_bytes_per_second + trainable / n / (CPU_ADAM_PARAMS_PER_SECOND_PER_NODE / per_node)


class Fsdp2Traffic:
    """:class:`memfit.planner.engine.EngineTraffic` of PyTorch FSDP2."""

    def communication_bytes(self, shape: PlannedModel, strategy: Strategy, trainable: int) -> float:
        return fsdp2_communication_bytes(shape, strategy, trainable)

    def offload_seconds(self, shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
        if strategy.offload_parameters == Offload.NONE:
            return 0.0
        return fsdp2_offload_seconds(shape, strategy, pool, trainable)
