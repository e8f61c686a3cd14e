"""Model states per GPU: weights, gradients and optimizer states under DeepSpeed ZeRO.

The accounting is the ZeRO paper's (Rajbhandari et al. 2020, §3: 2Ψ for 16-bit weights, 2Ψ for 16-bit
gradients, KΨ for the optimizer with K = 12 for mixed-precision Adam: fp32 master weights, momentum and
variance; each ZeRO stage partitions one more of them over the N data-parallel ranks) plus the one
buffer DeepSpeed adds that the paper leaves out: the fp32 copy of a rank's gradient partition that the
optimizer step works on (DeepSpeed's own estimators count it: ``2Ψ + 18Ψ/N`` for ZeRO-2).

What the optimizer steps on decides the size of its states, so it is followed tensor by tensor:

* ZeRO 1-3 hand the optimizer one flat 1-d partition per rank (``single_partition_of_fp32_groups`` in
  ``stage_1_and_2.py``, ``fp32_partitioned_groups_flat`` in ``stage3.py``), in the master dtype;
* ZeRO-0 hands it the model's own tensors: DeepSpeed's mixed precision wraps a client optimizer in
  ``FP16_UnfusedOptimizer``, which keeps one fp32 master per parameter (its fused ``FP16_Optimizer``, for
  DeepSpeed's own Adam, flattens them, which changes nothing for Adam's element-wise states), and without
  mixed precision (fp32, or bf16 masters) the optimizer gets the parameters themselves.

Adafactor factors the second moment of tensors of two or more dimensions only: under ZeRO its flat
partition gets a full fp32 second moment. bitsandbytes' 8-bit Adam keeps 32-bit states for tensors under
``min_8bit_size`` elements and, paged, puts the 8-bit states of tensors of at least 1e5 elements in CUDA
managed memory (see :func:`optimizer_state_bytes`).

bf16 master weights (``Strategy.master_weights``, pure bf16 training) change three terms:

========================  ===================  ==========================  ================
per trainable parameter   ZeRO-0               ZeRO-1/2/3                  fp32 masters
========================  ===================  ==========================  ================
master copy               0 (the weights)      2/N (a bf16 clone)          4 (/N under ZeRO)
Adam moments              2 x 2                2 x 2/N                     2 x 4 (/N)
Lion momentum             2                    2/N                         4 (/N)
step gradient             0 (reads .grad)      2/N (the flattened bf16     4 (/N)
                                               partition)
========================  ===================  ==========================  ================

Weights and gradients stay 16-bit as with mixed precision; 8-bit and Adafactor states have their own
dtypes whatever the masters' (bitsandbytes quantizes, Adafactor upcasts to fp32). With bf16 masters the
step's transients are counted whole (:func:`bf16_step_transient`): the gradient norm's fp64 copy of one
gradient piece can outgrow the bf16 partition, and ZeRO-0's clipping copies one gradient to fp32.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from memfit.api.plan import Strategy
from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Engine, MasterWeights, Method, Offload, Optimizer, Precision
from memfit.model_shape import ModelShape

FP64 = 8
FP32 = 4
BF16 = 2

NF4_BLOCK = 64
"""bitsandbytes 4-bit quantizes weights in blocks of 64, one absmax per block."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""With double quantization the absmaxes are themselves 8-bit, one fp32 scale per 256 of them."""
NF4_PACKED_BYTES_PER_PARAMETER = 4 / 8
"""The 4-bit codes, two per byte, whatever element type packs them (uint8, or bf16 on the fsdp2 engine)."""
NF4_QUANT_STATE_BYTES_PER_PARAMETER = (8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)) / 8
"""The 8-bit absmax per block and the fp32 second-level scale per 256 blocks, on average."""
NF4_BYTES_PER_PARAMETER = NF4_PACKED_BYTES_PER_PARAMETER + NF4_QUANT_STATE_BYTES_PER_PARAMETER
"""4.127 bits: the 4-bit code, the 8-bit absmax per block, the fp32 second-level scale."""
NF4_CODE_TABLE_BYTES = (16 + 256 + 1) * FP32
"""Per 4-bit weight, beside its absmaxes: bitsandbytes' ``QuantState`` keeps its own 16-value NF4 code, the
256-value dynamic map of the double quantization and the absmaxes' offset, all fp32."""


def nf4_quant_state_bytes(elements: int) -> int:
    """Exactly the ``QuantState`` tensors of one double-quantized 4-bit weight of ``elements`` parameters: the
    uint8 absmax of each block (the last one partial), the fp32 scale of each 256 of them, the code tables."""
    blocks = math.ceil(elements / NF4_BLOCK)
    return blocks + FP32 * math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK) + NF4_CODE_TABLE_BYTES


EIGHT_BIT_MIN_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: a tensor of fewer elements gets two fp32 states instead of 8-bit ones."""
EIGHT_BIT_BLOCK = 256
"""bitsandbytes' 8-bit optimizer states are quantized blockwise, one fp32 absmax per 256 elements."""
QUANTILE_MAP_BYTES = 2 * 256 * FP32
"""The signed and unsigned dynamic quantization maps (256 fp32 values each) an 8-bit Adam keeps on the GPU."""
PAGED_MIN_SIZE = 100_000
"""``get_state_buffer``: a paged optimizer puts the states of tensors of at least 1e5 elements in CUDA managed
memory (``F.get_paged``), smaller ones in ordinary device memory."""


def compute_bytes(precision: Precision) -> int:
    """Bytes of one weight, gradient or activation element in the compute precision."""
    return FP32 if precision == Precision.FP32 else 2


@dataclass(frozen=True)
class TrainableSplit:
    """How a method splits the model's parameters into frozen and trained ones."""

    total: int
    trainable: int
    frozen_quantized: int
    """Base weights stored in 4-bit NF4 (QLoRA)."""
    frozen_unquantized: int
    """Frozen weights kept in higher precision."""


@lru_cache(maxsize=256)
def trainable_split(shape: ModelShape, method: Method, lora_rank: int, lora_targets: tuple[str, ...]) -> TrainableSplit:
    total = shape.parameter_count
    if method == Method.FULL:
        return TrainableSplit(total, total, 0, 0)
    adapters = shape.lora_parameters(lora_rank, lora_targets)
    if method == Method.QLORA:
        quantized = shape.quantizable_parameters
        return TrainableSplit(total + adapters, adapters, quantized, total - quantized)
    return TrainableSplit(total + adapters, adapters, 0, total)


@lru_cache(maxsize=256)
def trainable_tensors(
    shape: ModelShape, method: Method, lora_rank: int, lora_targets: tuple[str, ...]
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The shapes of the trained tensors, as ``transformers`` and ``peft`` build them, each with how many
    tensors have it (the layers repeat theirs: counted, not listed, whatever the depth).

    Full fine-tuning: embedding, LM head (unless tied), the final norm and per layer its norms, the linear
    weights (``out x in``) and biases. Mixtral's experts are two fused 3-d parameters per layer in
    ``transformers`` (``gate_up_proj``: experts x 2·intermediate x hidden, ``down_proj``: experts x hidden x
    intermediate), its router a plain ``experts x hidden`` weight. LoRA and QLoRA: ``lora_A`` (rank x in) and
    ``lora_B`` (out x rank) per targeted linear (and per expert)."""
    h = shape.hidden_size
    layer: list[tuple[int, ...]] = []
    if method == Method.FULL:
        layer += [(h,)] * shape.norms_per_layer
        experts = {m.name: m for m in shape.layer_linears if m.count > 1}
        for m in shape.layer_linears:
            if m.count > 1:
                continue
            layer.append((m.out_features, m.in_features))
            if m.bias:
                layer.append((m.out_features,))
        if experts:
            w1, w3, w2 = experts["w1"], experts["w3"], experts["w2"]
            layer.append((w1.count, w1.out_features + w3.out_features, w1.in_features))
            layer.append((w2.count, w2.out_features, w2.in_features))
        model = [(shape.vocab_size, h), (h,)] + ([] if shape.tie_word_embeddings else [(shape.vocab_size, h)])
        return _counted(model, layer, shape.num_layers)
    targets = shape.resolve_lora_targets(lora_targets)
    for m in shape.layer_linears:
        if m.name in targets:
            layer += [(lora_rank, m.in_features), (m.out_features, lora_rank)] * m.count
    return _counted([], layer, shape.num_layers)


def _counted(
    once: list[tuple[int, ...]], per_layer: list[tuple[int, ...]], layers: int
) -> tuple[tuple[tuple[int, ...], int], ...]:
    counts: Counter[tuple[int, ...]] = Counter(once)
    for tensor in per_layer:
        counts[tensor] += layers
    return tuple(counts.items())


@dataclass(frozen=True)
class OptimizerStateBytes:
    """One rank's optimizer states (not the master weights), by where they live."""

    device: float
    """In device memory, counted by PyTorch's allocator."""
    paged: float = 0.0
    """In CUDA managed memory (bitsandbytes' paged optimizers): the driver moves it to the host when the GPU
    runs short, and PyTorch's allocator does not see it."""


ELEMENTWISE_STATES = {Optimizer.ADAMW: 2, Optimizer.LION: 1}
"""States per element, each as wide as the master (``zeros_like(param)``): Adam's two moments, Lion's momentum."""


def _tensor_state_bytes(optimizer: Optimizer, numel: float, element_bytes: int) -> OptimizerStateBytes:
    """The states Adam, Lion or an 8-bit Adam keep for one tensor of ``numel`` elements whose master is
    ``element_bytes`` wide."""
    if optimizer == Optimizer.ADAMW:  # exp_avg, exp_avg_sq: zeros_like(param)
        return OptimizerStateBytes(2 * element_bytes * numel)
    if optimizer == Optimizer.LION:  # exp_avg: zeros_like(param)
        return OptimizerStateBytes(element_bytes * numel)
    if optimizer == Optimizer.ADAFACTOR:  # always fp32 (it upcasts 16-bit gradients first); see optimizer_state_bytes
        raise AssertionError("Adafactor's states depend on the tensor's shape")
    # bitsandbytes Optimizer2State.init_state: two fp32 states under min_8bit_size, else two uint8 states and
    # one fp32 absmax per block of each; get_state_buffer pages state1 and state2 (not the absmaxes).
    if numel < EIGHT_BIT_MIN_SIZE:
        return OptimizerStateBytes(2 * FP32 * numel)
    absmax = 2 * FP32 * math.ceil(numel / EIGHT_BIT_BLOCK)
    if optimizer == Optimizer.PAGED_ADAMW_8BIT and numel >= PAGED_MIN_SIZE:
        return OptimizerStateBytes(absmax, paged=2 * numel)
    return OptimizerStateBytes(absmax + 2 * numel)


ADAFACTOR_RMS_BYTES = FP32
"""transformers' Adafactor keeps each tensor's RMS as a 0-d fp32 tensor in its state."""


def _adafactor_bytes(tensor: tuple[int, ...]) -> int:
    """transformers' Adafactor (beta1 None: no first moment): a factored fp32 second moment (row and column
    means) for tensors of two or more dimensions, a full one for vectors, and the RMS."""
    if len(tensor) < 2:
        return FP32 * tensor[0] + ADAFACTOR_RMS_BYTES
    rows = math.prod(tensor[:-1])
    columns = math.prod(tensor[:-2]) * tensor[-1]
    return FP32 * (rows + columns) + ADAFACTOR_RMS_BYTES


@lru_cache(maxsize=1024)
def _per_tensor_state_bytes(
    shape: ModelShape,
    method: Method,
    lora_rank: int,
    lora_targets: tuple[str, ...],
    optimizer: Optimizer,
    element_bytes: int,
) -> OptimizerStateBytes:
    device = paged = 0.0
    eight_bit = False
    for tensor, count in trainable_tensors(shape, method, lora_rank, lora_targets):
        if optimizer == Optimizer.ADAFACTOR:
            device += count * _adafactor_bytes(tensor)
            continue
        numel = math.prod(tensor)
        states = _tensor_state_bytes(optimizer, numel, element_bytes)
        device, paged = device + count * states.device, paged + count * states.paged
        eight_bit = eight_bit or (optimizer in EIGHT_BIT_OPTIMIZERS and numel >= EIGHT_BIT_MIN_SIZE)
    return OptimizerStateBytes(device + (QUANTILE_MAP_BYTES if eight_bit else 0), paged)


def optimizer_state_bytes(
    shape: ModelShape,
    method: Method,
    lora_rank: int,
    lora_targets: tuple[str, ...],
    optimizer: Optimizer,
    element_bytes: int,
    partition: float | None,
) -> OptimizerStateBytes:
    """One rank's optimizer states (without master weights): for the flat ZeRO partition of ``partition``
    elements, or (``None``, ZeRO-0) for every trained tensor. ``element_bytes`` is the width of what the
    optimizer updates (4: fp32 masters or fp32 training; 2: bf16 masters), the dtype of Adam's and Lion's
    states (``zeros_like(param)``)."""
    if partition is None:
        return _per_tensor_state_bytes(shape, method, lora_rank, lora_targets, optimizer, element_bytes)
    if optimizer == Optimizer.ADAFACTOR:
        return OptimizerStateBytes(FP32 * partition + ADAFACTOR_RMS_BYTES)  # 1-d: not factored
    states = _tensor_state_bytes(optimizer, partition, element_bytes)
    if optimizer in EIGHT_BIT_OPTIMIZERS and partition >= EIGHT_BIT_MIN_SIZE:
        return OptimizerStateBytes(states.device + QUANTILE_MAP_BYTES, states.paged)
    return states


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU (and what moved to the host) for one strategy."""

    parameters: int
    """Weights resident on the GPU, including a ZeRO-3 rank's gathered working set."""
    gradients: int
    """16-bit (or fp32) gradients resident through forward and backward."""
    step_gradients: int
    """What exists only during the optimizer step: the gradient partition in the master dtype (fp32 masters:
    an fp32 copy; none in fp32 training, where the optimizer reads the gradients themselves); with bf16
    masters the larger of the flattened bf16 partition and the gradient norm's fp64 copy of one piece, or at
    ZeRO-0 the clipping's fp32 copy of one gradient (:func:`bf16_step_transient`)."""
    optimizer_states: int
    """Optimizer states and master weights resident on the GPU (not paged states: see cpu_per_rank)."""
    cpu_per_rank: int
    """Offloaded states one rank keeps in CPU memory, and paged optimizer states (CUDA managed memory that the
    driver evicts to the host under pressure)."""
    nvme_per_rank: int
    """Offloaded states one rank keeps on NVMe."""


def zero3_working_set(shape: ModelShape) -> int:
    """Parameters a ZeRO-3 rank holds gathered at once: the module being computed (the embedding or
    LM head can be the largest) plus the next layer prefetched, plus the small persistent ones."""
    return shape.largest_layer_parameters + shape.layer_parameters + shape.norm_parameters


def master_bytes(strategy: Strategy) -> int:
    """Bytes of one master weight (0: the optimizer updates the weights themselves)."""
    if strategy.precision == Precision.FP32:
        return 0
    if strategy.master_weights == MasterWeights.BF16 and strategy.precision == Precision.BF16:
        return BF16 if strategy.zero_stage > 0 else 0
    return FP32


@lru_cache(maxsize=256)
def largest_trainable_tensor(shape: ModelShape, method: Method, lora_rank: int, lora_targets: tuple[str, ...]) -> int:
    """Elements of the largest trained tensor (the embedding or LM head in full fine-tuning)."""
    return max(math.prod(t) for t, _ in trainable_tensors(shape, method, lora_rank, lora_targets))


def bf16_step_transient(shape: ModelShape, strategy: Strategy, lora_rank: int, lora_targets: tuple[str, ...]) -> float:
    """What exists only during the optimizer step with bf16 masters, beyond gradients, masters and states.

    ZeRO 1-3 flatten the rank's gradient partition for the optimizer (bf16: ``.to(master dtype)`` then copies
    nothing), after computing the gradient norm piece by piece, each piece cast to fp64 first
    (``get_norm_dtype``): the larger of the partition and the largest piece's fp64 copy. A piece is the part of
    a gradient inside the partition under ZeRO-1/2 and a parameter's partition under ZeRO-3. With bf16 masters
    the norm's copy is often the larger one (Llama 3.1 8B on 8 GPUs: the 525M-element embedding, 4.2 GB
    in fp64, against a 2 GB partition).

    ZeRO-0 has no partition (the optimizer reads the gradients) but DeepSpeed clips them itself
    (``clip_fp32_gradients``: the norm of ``grad.float()``, one gradient at a time): the largest gradient's
    fp32 copy.

    Adafactor computes in fp32: over bf16 it adds ``grad.float()`` and ``p.float()`` of the tensor it steps
    (the flat partition under ZeRO, one tensor at a time at ZeRO-0), 8 bytes per element. (Its update's own
    two fp32 temporaries, 8 bytes per element, exist with fp32 masters too, and like every optimizer's
    temporaries are not counted here.)"""
    trainable = trainable_split(shape, strategy.method, lora_rank, lora_targets).trainable
    largest = largest_trainable_tensor(shape, strategy.method, lora_rank, lora_targets)
    upcasts = 2 * FP32 if strategy.optimizer == Optimizer.ADAFACTOR else 0
    if strategy.zero_stage == 0:
        return max(FP32, upcasts) * largest
    partition = trainable / strategy.gpus
    piece = largest / strategy.gpus if strategy.zero_stage == 3 else min(largest, partition)
    return max((BF16 + upcasts) * partition, FP64 * piece)


def model_states(shape: ModelShape, strategy: Strategy, lora_rank: int, lora_targets: tuple[str, ...]) -> ModelStates:
    """Weights, gradients and optimizer states of one rank for ``strategy``."""
    if strategy.engine == Engine.FSDP2:
        from memfit.memory.fsdp2 import fsdp2_model_states  # it builds on this module

        return fsdp2_model_states(shape, strategy, lora_rank, lora_targets)
    split = trainable_split(shape, strategy.method, lora_rank, lora_targets)
    n = strategy.gpus
    stage = strategy.zero_stage
    w = compute_bytes(strategy.precision)
    bf16_masters = strategy.master_weights == MasterWeights.BF16 and strategy.precision == Precision.BF16

    # QLoRA: only the decoder linears are 4-bit; the trainer keeps everything else (embeddings, LM head,
    # norms, adapters) in the compute dtype (memfit_trainer.model.prepare_kbit_model).
    trainable_bytes = w
    frozen_bytes = split.frozen_quantized * NF4_BYTES_PER_PARAMETER + split.frozen_unquantized * w
    weights = frozen_bytes + split.trainable * trainable_bytes

    # What the optimizer updates: fp32 masters (mixed precision), bf16 ones, or the weights themselves.
    masters = master_bytes(strategy)
    element_bytes = BF16 if bf16_masters else FP32
    shards = n if stage >= 1 else 1
    optimizer: float
    paged: float = 0
    if strategy.optimizer in ELEMENTWISE_STATES:  # the same bytes per element in any tensor
        optimizer = split.trainable * (masters + ELEMENTWISE_STATES[strategy.optimizer] * element_bytes) / shards
    else:
        states = optimizer_state_bytes(
            shape, strategy.method, lora_rank, lora_targets, strategy.optimizer, element_bytes,
            split.trainable / n if stage >= 1 else None,
        )  # fmt: skip
        optimizer = split.trainable * masters / shards + states.device
        paged = states.paged
    grads: float = split.trainable * trainable_bytes
    step_grads: float = split.trainable * masters / shards
    if bf16_masters:
        step_grads = bf16_step_transient(shape, strategy, lora_rank, lora_targets)
    if stage >= 2:
        grads /= n
    # Under ZeRO-3 the module being reduced holds its full gradient before the reduce-scatter.
    gathered_grads = shape.largest_layer_parameters * w if stage == 3 and strategy.method == Method.FULL else 0
    if stage == 3:
        working_set = zero3_working_set(shape) * w
        weights = weights / n + working_set
        grads += gathered_grads
        if strategy.offload_parameters != Offload.NONE:
            weights = working_set

    cpu = nvme = 0.0
    if strategy.offload_optimizer != Offload.NONE:
        # Master weights and states move to the host, and reduced gradient partitions are copied
        # straight into the fp32 buffers the CPU optimizer reads: the GPU keeps only the buckets
        # (and, under ZeRO-3, the full gradient of the module being reduced).
        cpu += step_grads
        grads = gathered_grads
        if strategy.offload_optimizer == Offload.CPU:
            cpu += optimizer + paged
        else:
            nvme += optimizer + paged
        optimizer = step_grads = paged = 0
    cpu += paged
    if stage == 3 and strategy.offload_parameters != Offload.NONE:
        shard = (frozen_bytes + split.trainable * trainable_bytes) / n
        if strategy.offload_parameters == Offload.CPU:
            cpu += shard
        else:
            nvme += shard
    return ModelStates(
        parameters=int(weights),
        gradients=int(grads),
        step_gradients=int(step_grads),
        optimizer_states=int(optimizer),
        cpu_per_rank=int(cpu),
        nvme_per_rank=int(nvme),
    )
