"""DeepSpeed ZeRO's traffic per optimizer step: gradient reduction, ZeRO-3's parameter gathers, and what
offloading moves over PCIe and NVMe."""

from __future__ import annotations

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Method, Offload
from memfit.memory.sizes import compute_bytes
from memfit.planned_model import PlannedModel
from memfit.planner.engine import CPU_ADAM_PARAMS_PER_SECOND_PER_NODE


class DeepSpeedTraffic:
    """:class:`memfit.planner.engine.EngineTraffic` of DeepSpeed ZeRO."""

    def communication_bytes(self, shape: PlannedModel, strategy: Strategy, trainable: int) -> float:
        n = strategy.gpus
        # ZeRO-3 also gathers the frozen base
        frozen_16bit = shape.parameter_count if strategy.method == Method.LORA else 0
        ring = (n - 1) / n
        w = compute_bytes(strategy.precision)
        accumulation = strategy.gradient_accumulation_steps
        grads = 2 * ring * trainable * w  # all-reduce = reduce-scatter + all-gather
        if strategy.zero_stage >= 2:
            grads *= accumulation  # ZeRO-2/3 reduce every micro-batch
        gathers = 0.0
        if strategy.zero_stage == 3:
            passes = 3 if strategy.gradient_checkpointing else 2  # forward, backward (and the recompute)
            gathers = passes * ring * (trainable + frozen_16bit) * w * accumulation
        return grads + gathers

    def offload_seconds(self, shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
        n, per_node = strategy.gpus, strategy.gpus_per_node
        shard = trainable / n
        seconds = 0.0
        if strategy.offload_optimizer != Offload.NONE:
            seconds += shard / (CPU_ADAM_PARAMS_PER_SECOND_PER_NODE / per_node)
            seconds += 4 * shard / pool.pcie_bytes_per_second  # 16-bit grads down, 16-bit weights up
            if strategy.offload_optimizer == Offload.NVME:
                seconds += 2 * 12 * shard / (pool.nvme_bytes_per_second / per_node)  # read and write states
        if strategy.offload_parameters != Offload.NONE:
            passes = (3 if strategy.gradient_checkpointing else 2) * strategy.gradient_accumulation_steps
            weights = 2 * shape.parameter_count / n * passes
            bandwidth = pool.pcie_bytes_per_second
            if strategy.offload_parameters == Offload.NVME:
                bandwidth = min(bandwidth, pool.nvme_bytes_per_second / per_node)
            seconds += weights / bandwidth
        return seconds
