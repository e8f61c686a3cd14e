"""Estimated step time of a strategy: compute, communication, offload traffic and the optimizer.

It only has to rank candidates correctly, so it models what separates them (recomputation, ZeRO-3's
parameter gathers, PCIe and NVMe traffic, CPU optimizer time, 4-bit dequantization; each engine's traffic is
its own: :mod:`memfit.planner.engines`) with published
orders of magnitude; its absolute numbers are estimates and are labelled so everywhere.
"""

from __future__ import annotations

from memfit.api.gpupool import PoolCapacity
from memfit.api.plan import PlanThroughput, Strategy
from memfit.api.vocabulary import Method, Precision
from memfit.memory.sizes import compute_bytes
from memfit.model_facts import attention_heads, dense_mlp_parameters
from memfit.planned_model import PlannedModel
from memfit.planner.engines import ENGINE_TRAFFIC

PEAK_EFFICIENCY = 0.5
"""Share of the tensor-core peak a well-fed decoder layer reaches (model FLOPs utilisation)."""
HALF_EFFICIENCY_TOKENS = 1024
"""Tokens per micro-batch at which a GPU reaches half of PEAK_EFFICIENCY: small batches starve it."""
QLORA_SLOWDOWN = 1.35
"""Dequantizing NF4 weights before every matmul (QLoRA paper, bitsandbytes benchmarks: 30-40%)."""
COMM_OVERLAP = 0.5
"""Share of communication DeepSpeed hides behind compute (overlap_comm, prefetching)."""
FP32_SLOWDOWN = 8.0
"""fp32 matmuls run on TF32 or plain FP32 units, roughly an order of magnitude below 16-bit peak."""


def _training_flops_per_token(shape: PlannedModel, strategy: Strategy, sequence_length: int) -> float:
    """Forward 2N + causal attention; backward 2x forward for full training, 1x when the base is
    frozen (no weight gradients); checkpointing repeats the forward; the chunked loss repeats the LM
    head's matmul in backward (2 x hidden x vocabulary per token); the tiled MLP repeats each dense MLP's
    forward in backward (2 x its parameters per token: 6 x hidden x intermediate per gated MLP)."""
    model = shape.model_flops_per_token(sequence_length, trains_base=strategy.method == Method.FULL)
    recompute = shape.forward_flops_per_token(sequence_length) if strategy.gradient_checkpointing else 0
    if strategy.chunked_loss:
        recompute += 2 * shape.hidden_size * shape.vocab_size
    if strategy.tiled_mlp:
        recompute += 2 * dense_mlp_parameters(shape)
    return model + recompute


def peak_flops(pool: PoolCapacity, precision: Precision) -> float:
    """Dense peak FLOP/s of one GPU of the pool in ``precision`` (catalog or pool spec: not measured)."""
    if precision == Precision.BF16 and pool.peak_flops_bf16:
        return pool.peak_flops_bf16
    if precision == Precision.FP32:
        return pool.peak_flops_fp16 / FP32_SLOWDOWN
    return pool.peak_flops_fp16


def _bandwidth(pool: PoolCapacity, strategy: Strategy, across_nodes: bool) -> float:
    """Bytes/s each GPU sees in a collective: NVLink/PCIe within a node, its share of the NICs across nodes."""
    if not across_nodes:
        return pool.intra_node_bytes_per_second
    return min(pool.intra_node_bytes_per_second, pool.inter_node_bytes_per_second / strategy.gpus_per_node)


def _all_to_all_seconds(shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, local_tokens: int) -> float:
    """Ulysses' all-to-alls of one micro-batch, per rank: in the forward (and again in a checkpointed
    layer's recompute) and the backward, each layer sends (P-1)/P of its local queries, keys and values and
    of the attention output; key/value heads fewer than the ranks are replicated to one per rank. The layer
    waits for them: they neither hide behind compute nor hide other communication."""
    degree = strategy.sequence_parallel
    heads = attention_heads(shape)
    if degree == 1 or heads is None:
        return 0.0
    query_heads, kv_heads, head_dim = heads
    per_token = (2 * query_heads + 2 * max(kv_heads, degree)) * head_dim * compute_bytes(strategy.precision)
    passes = 2 + int(strategy.gradient_checkpointing)
    sent = shape.num_layers * passes * (degree - 1) / degree * local_tokens * per_token
    # A group's ranks are contiguous: within a node while the group fits in one.
    return sent / _bandwidth(pool, strategy, across_nodes=degree > strategy.gpus_per_node)


def tokens_per_step(strategy: Strategy, sequence_length: int) -> int:
    """Tokens one optimizer step trains: each data-parallel group of ``sequence_parallel`` ranks shares its
    sequences."""
    return strategy.data_parallel * strategy.micro_batch_size * strategy.gradient_accumulation_steps * sequence_length


def _communication_seconds(shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
    if strategy.gpus == 1:
        return 0.0
    traffic = ENGINE_TRAFFIC[strategy.engine].communication_bytes(shape, strategy, trainable)
    return traffic / _bandwidth(pool, strategy, across_nodes=strategy.nodes > 1)  # a ring over every GPU


def _offload_seconds(shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, trainable: int) -> float:
    return ENGINE_TRAFFIC[strategy.engine].offload_seconds(shape, strategy, pool, trainable)


def _exposed_activation_copies(
    shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, micro_tokens: int, compute_seconds: float
) -> float:
    """Activation offloading copies every checkpointed layer's input to the host and back over PCIe on a
    side stream, overlapped with compute: what the copies take beyond the compute is waited for."""
    copied = 2 * shape.num_layers * micro_tokens * shape.hidden_size * compute_bytes(strategy.precision)
    return max(0.0, copied / pool.pcie_bytes_per_second - compute_seconds)


def estimate_throughput(
    shape: PlannedModel,
    strategy: Strategy,
    pool: PoolCapacity,
    sequence_length: int,
    trainable: int,
) -> PlanThroughput:
    step = step_seconds(shape, strategy, pool, sequence_length, trainable)
    tokens = tokens_per_step(strategy, sequence_length)
    return PlanThroughput.model_construct(tokens_per_second=tokens / step, step_seconds=step)


def step_seconds(
    shape: PlannedModel, strategy: Strategy, pool: PoolCapacity, sequence_length: int, trainable: int
) -> float:
    """Estimated seconds of one optimizer step. With the batch fixed it is shortest at the largest
    micro-batch (no accumulation): bigger micro-batches use the GPU better, and ZeRO-2/3 communicate
    and offloaded weights travel once per micro-batch. The optimizer step in backward
    (``optimizer_in_backward``) is the same optimizer work and traffic moved into the backward pass: it
    changes the step's memory, not its time, so nothing here depends on it. With sequence parallelism
    each rank computes its share of the micro-batch's tokens and waits for the all-to-alls."""
    micro_tokens = strategy.micro_batch_size * -(-sequence_length // strategy.sequence_parallel)
    efficiency = PEAK_EFFICIENCY * micro_tokens / (micro_tokens + HALF_EFFICIENCY_TOKENS)
    flops = _training_flops_per_token(shape, strategy, sequence_length) * micro_tokens
    micro_seconds = flops / (peak_flops(pool, strategy.precision) * efficiency)
    if strategy.method == Method.QLORA:
        micro_seconds *= QLORA_SLOWDOWN
    if strategy.activation_offloading:
        micro_seconds += _exposed_activation_copies(shape, strategy, pool, micro_tokens, micro_seconds)
    compute = micro_seconds * strategy.gradient_accumulation_steps
    communication = _communication_seconds(shape, strategy, pool, trainable)
    step = compute + (1 - COMM_OVERLAP) * communication + max(0.0, COMM_OVERLAP * communication - compute)
    all_to_all = _all_to_all_seconds(shape, strategy, pool, micro_tokens) * strategy.gradient_accumulation_steps
    return step + all_to_all + _offload_seconds(shape, strategy, pool, trainable)
