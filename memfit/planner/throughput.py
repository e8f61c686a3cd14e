"""Estimated step time of a strategy: compute, communication, offload traffic and the optimizer.

It only has to rank candidates correctly, so it models what separates them (recomputation, ZeRO-3's
parameter gathers, PCIe and NVMe traffic, CPU optimizer time, 4-bit dequantization) with published
orders of magnitude; its absolute numbers are estimates and are labelled so everywhere.
"""

from __future__ import annotations

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import PlanThroughput, Strategy
from memfit.api.vocabulary import Engine, Method, Offload, Precision
from memfit.memory.engines.fsdp2 import fsdp2_widths
from memfit.memory.sizes import compute_bytes
from memfit.model_shape import ModelShape

PEAK_EFFICIENCY = 0.5
"""Share of the tensor-core peak a well-fed decoder layer reaches (model FLOPs utilisation)."""
HALF_EFFICIENCY_TOKENS = 1024
"""Tokens per micro-batch at which a GPU reaches half of PEAK_EFFICIENCY: small batches starve it."""
QLORA_SLOWDOWN = 1.35
"""Dequantizing NF4 weights before every matmul (QLoRA paper, bitsandbytes benchmarks: 30-40%)."""
COMM_OVERLAP = 0.5
"""Share of communication DeepSpeed hides behind compute (overlap_comm, prefetching)."""
CPU_ADAM_PARAMS_PER_SECOND_PER_NODE = 1.5e9
"""DeepSpeedCPUAdam updates per second on a modern dual-socket host (ZeRO-Offload paper order)."""
FP32_SLOWDOWN = 8.0
"""fp32 matmuls run on TF32 or plain FP32 units, roughly an order of magnitude below 16-bit peak."""


def _training_flops_per_token(shape: ModelShape, strategy: Strategy, sequence_length: int) -> float:
    """Forward 2N + causal attention; backward 2x forward for full training, 1x when the base is
    frozen (no weight gradients); checkpointing repeats the forward; the chunked loss repeats the LM
    head's matmul in backward (2 x hidden x vocabulary per token)."""
    forward = 2 * shape.active_parameters_per_token + 2 * shape.num_layers * sequence_length * shape.q_size
    backward = 2 * forward if strategy.method == Method.FULL else forward
    recompute = forward if strategy.gradient_checkpointing else 0
    if strategy.chunked_loss:
        recompute += 2 * shape.hidden_size * shape.vocab_size
    return forward + backward + recompute


def peak_flops(pool: PoolCapacity, precision: Precision) -> float:
    """Dense peak FLOP/s of one GPU of the pool in ``precision`` (catalog or pool spec: not measured)."""
    if precision == Precision.BF16 and pool.peak_flops_bf16:
        return pool.peak_flops_bf16
    if precision == Precision.FP32:
        return pool.peak_flops_fp16 / FP32_SLOWDOWN
    return pool.peak_flops_fp16


def _collective_bandwidth(pool: PoolCapacity, strategy: Strategy) -> float:
    """Bytes/s each GPU sees in a ring: NVLink/PCIe within a node, its share of the NICs across nodes."""
    if strategy.nodes == 1:
        return pool.intra_node_bytes_per_second
    return min(pool.intra_node_bytes_per_second, pool.inter_node_bytes_per_second / strategy.gpus_per_node)


def _communication_seconds(
    shape: ModelShape, strategy: Strategy, pool: PoolCapacity, trainable: int, frozen_16bit: int
) -> float:
    n = strategy.gpus
    if n == 1:
        return 0.0
    if strategy.engine == Engine.FSDP2:
        return _fsdp2_communication_bytes(shape, strategy, trainable) / _collective_bandwidth(pool, strategy)
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
    return (grads + gathers) / _collective_bandwidth(pool, strategy)


def _fsdp2_gathers(strategy: Strategy) -> int:
    """All-gathers of every parameter per micro-batch under FSDP2: forward, and backward again when
    resharding after forward (zero stage 3). A checkpointed layer's recomputation runs inside its backward,
    after its pre-backward unshard, so FSDPParamGroup.unshard finds it gathered: no third gather."""
    return 2 if strategy.zero_stage == 3 else 1


def _fsdp2_communication_bytes(shape: ModelShape, strategy: Strategy, trainable: int) -> float:
    """Bytes each rank moves per optimizer step under FSDP2: every micro-batch all-gathers all parameters
    (frozen ones too) in the gathered dtype and reduce-scatters the trained ones' gradients in
    ``reduce_dtype`` (no ``no_sync``: gradients are reduced every micro-batch), each a ring's (n-1)/n."""
    n = strategy.gpus
    w = fsdp2_widths(strategy.precision, strategy.master_weights)
    frozen = shape.parameter_count if strategy.method != Method.FULL else 0
    per_micro = _fsdp2_gathers(strategy) * (trainable + frozen) * w.gathered + trainable * w.reduce
    return (n - 1) / n * per_micro * strategy.gradient_accumulation_steps


def _fsdp2_offload_seconds(shape: ModelShape, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
    """CPUOffloadPolicy: each all-gather copies the rank's parameter shards host-to-device, each reduced
    gradient shard goes device-to-host, every micro-batch; the optimizer steps the shards on the CPU."""
    n, per_node = strategy.gpus, strategy.gpus_per_node
    w = fsdp2_widths(strategy.precision, strategy.master_weights)
    frozen = shape.parameter_count if strategy.method != Method.FULL else 0
    shard = (trainable * w.sharded_trained + frozen * w.sharded_frozen) / n
    pcie = (_fsdp2_gathers(strategy) * shard + trainable * w.reduce / n) * strategy.gradient_accumulation_steps
    return pcie / pool.pcie_bytes_per_second + trainable / n / (CPU_ADAM_PARAMS_PER_SECOND_PER_NODE / per_node)


def _offload_seconds(shape: ModelShape, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
    if strategy.engine == Engine.FSDP2:
        return (
            _fsdp2_offload_seconds(shape, strategy, pool, trainable)
            if strategy.offload_parameters != Offload.NONE
            else 0.0
        )
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


def _exposed_activation_copies(
    shape: ModelShape, strategy: Strategy, pool: PoolCapacity, micro_tokens: int, compute_seconds: float
) -> float:
    """Activation offloading copies every checkpointed layer's input to the host and back over PCIe on a
    side stream, overlapped with compute: what the copies take beyond the compute is waited for."""
    copied = 2 * shape.num_layers * micro_tokens * shape.hidden_size * compute_bytes(strategy.precision)
    return max(0.0, copied / pool.pcie_bytes_per_second - compute_seconds)


def estimate_throughput(
    shape: ModelShape,
    strategy: Strategy,
    pool: PoolCapacity,
    sequence_length: int,
    trainable: int,
) -> PlanThroughput:
    step = step_seconds(shape, strategy, pool, sequence_length, trainable)
    tokens = strategy.gpus * strategy.micro_batch_size * strategy.gradient_accumulation_steps * sequence_length
    return PlanThroughput.model_construct(tokens_per_second=tokens / step, step_seconds=step)


def step_seconds(
    shape: ModelShape, strategy: Strategy, pool: PoolCapacity, sequence_length: int, trainable: int
) -> float:
    """Estimated seconds of one optimizer step. With the batch fixed it is shortest at the largest
    micro-batch (no accumulation): bigger micro-batches use the GPU better, and ZeRO-2/3 communicate
    and offloaded weights travel once per micro-batch. The optimizer step in backward
    (``optimizer_in_backward``) is the same optimizer work and traffic moved into the backward pass: it
    changes the step's memory, not its time, so nothing here depends on it."""
    micro_tokens = strategy.micro_batch_size * sequence_length
    efficiency = PEAK_EFFICIENCY * micro_tokens / (micro_tokens + HALF_EFFICIENCY_TOKENS)
    flops = _training_flops_per_token(shape, strategy, sequence_length) * micro_tokens
    micro_seconds = flops / (peak_flops(pool, strategy.precision) * efficiency)
    if strategy.method == Method.QLORA:
        micro_seconds *= QLORA_SLOWDOWN
    if strategy.activation_offloading:
        micro_seconds += _exposed_activation_copies(shape, strategy, pool, micro_tokens, micro_seconds)
    compute = micro_seconds * strategy.gradient_accumulation_steps
    frozen_16bit = shape.parameter_count if strategy.method == Method.LORA else 0  # ZeRO-3 also gathers the frozen base
    communication = _communication_seconds(shape, strategy, pool, trainable, frozen_16bit)
    step = compute + (1 - COMM_OVERLAP) * communication + max(0.0, COMM_OVERLAP * communication - compute)
    return step + _offload_seconds(shape, strategy, pool, trainable)
