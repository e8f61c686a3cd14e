"""Model states per GPU: weights, gradients and optimizer states under DeepSpeed ZeRO.

The accounting is the ZeRO paper's (Rajbhandari et al. 2020, §3: 2Ψ for 16-bit weights, 2Ψ for 16-bit
gradients, KΨ for the optimizer with K = 12 for mixed-precision Adam: fp32 master weights, momentum and
variance; each ZeRO stage partitions one more of them over the N data-parallel ranks) plus the one
buffer DeepSpeed adds that the paper leaves out: the fp32 copy of a rank's gradient partition that the
optimizer step works on (DeepSpeed's own estimators count it: ``2Ψ + 18Ψ/N`` for ZeRO-2).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from memfit.api.plan import Strategy
from memfit.api.vocabulary import Method, Offload, Optimizer, Precision
from memfit.model_shape import ModelShape

FP32 = 4

NF4_BLOCK = 64
"""bitsandbytes 4-bit quantizes weights in blocks of 64, one absmax per block."""
NF4_DOUBLE_QUANT_BLOCK = 256
"""With double quantization the absmaxes are themselves 8-bit, one fp32 scale per 256 of them."""
NF4_BYTES_PER_PARAMETER = (4 + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)) / 8
"""4.127 bits: the 4-bit code, the 8-bit absmax per block, the fp32 second-level scale."""


def compute_bytes(precision: Precision) -> int:
    """Bytes of one weight, gradient or activation element in the compute precision."""
    return FP32 if precision == Precision.FP32 else 2


def optimizer_bytes_per_parameter(optimizer: Optimizer, mixed_precision: bool) -> float:
    """Optimizer state bytes per trainable parameter, with the fp32 master copy mixed precision keeps."""
    states = {
        Optimizer.ADAMW: 8.0,  # momentum + variance, fp32
        Optimizer.ADAMW_8BIT: 2.0 + 2 * 4 / 256,  # two 8-bit states + an fp32 absmax per 256-element block each
        Optimizer.PAGED_ADAMW_8BIT: 2.0 + 2 * 4 / 256,
        Optimizer.LION: 4.0,  # momentum only
        Optimizer.ADAFACTOR: 0.0,  # factored second moment: see factored_state_elements, counted separately
    }[optimizer]
    return states + (FP32 if mixed_precision else 0.0)


@dataclass(frozen=True)
class TrainableSplit:
    """How a method splits the model's parameters into frozen and trained ones."""

    total: int
    trainable: int
    frozen_quantized: int
    """Base weights stored in 4-bit NF4 (QLoRA)."""
    frozen_unquantized: int
    """Frozen weights kept in higher precision."""
    factored_state_elements: int
    """Adafactor: fp32 elements of the factored second moment (rows + columns of each trained matrix)."""


@lru_cache(maxsize=256)
def trainable_split(shape: ModelShape, method: Method, lora_rank: int, lora_targets: tuple[str, ...]) -> TrainableSplit:
    total = shape.parameter_count
    if method == Method.FULL:
        matrices = shape.num_layers * sum((m.in_features + m.out_features) * m.count for m in shape.layer_linears)
        embeddings = (shape.vocab_size + shape.hidden_size) * (1 if shape.tie_word_embeddings else 2)
        vectors = shape.norm_parameters  # 1-d parameters keep a full second moment
        return TrainableSplit(total, total, 0, 0, matrices + embeddings + vectors)
    adapters = shape.lora_parameters(lora_rank, lora_targets)
    targets = shape.resolve_lora_targets(lora_targets)
    factored = shape.num_layers * sum(
        (lora_rank + m.in_features + m.out_features + lora_rank) * m.count
        for m in shape.layer_linears
        if m.name in targets
    )
    if method == Method.QLORA:
        quantized = shape.quantizable_parameters
        return TrainableSplit(total + adapters, adapters, quantized, total - quantized, factored)
    return TrainableSplit(total + adapters, adapters, 0, total, factored)


@dataclass(frozen=True)
class ModelStates:
    """Bytes per GPU (and what moved to the host) for one strategy."""

    parameters: int
    """Weights resident on the GPU, including a ZeRO-3 rank's gathered working set."""
    gradients: int
    """16-bit (or fp32) gradients resident through forward and backward."""
    step_gradients: int
    """The fp32 gradient partition that exists only during the optimizer step."""
    optimizer_states: int
    """Optimizer states and fp32 master weights resident on the GPU."""
    cpu_per_rank: int
    """Offloaded states one rank keeps in CPU memory."""
    nvme_per_rank: int
    """Offloaded states one rank keeps on NVMe."""


def zero3_working_set(shape: ModelShape) -> int:
    """Parameters a ZeRO-3 rank holds gathered at once: the module being computed (the embedding or
    LM head can be the largest) plus the next layer prefetched, plus the small persistent ones."""
    return shape.largest_layer_parameters + shape.layer_parameters + shape.norm_parameters


def model_states(shape: ModelShape, strategy: Strategy, lora_rank: int, lora_targets: tuple[str, ...]) -> ModelStates:
    """Weights, gradients and optimizer states of one rank for ``strategy``."""
    split = trainable_split(shape, strategy.method, lora_rank, lora_targets)
    n = strategy.gpus
    stage = strategy.zero_stage
    w = compute_bytes(strategy.precision)
    mixed = strategy.precision != Precision.FP32

    # QLoRA: only the decoder linears are 4-bit. peft's k-bit preparation upcasts the rest to fp32,
    # but DeepSpeed's bf16/fp16 engine casts every non-quantized parameter, adapters included, back
    # to the compute dtype (with fp32 masters of the adapters in the optimizer), as for LoRA.
    trainable_bytes = w
    frozen_bytes = split.frozen_quantized * NF4_BYTES_PER_PARAMETER + split.frozen_unquantized * w
    weights = frozen_bytes + split.trainable * trainable_bytes

    keeps_master = mixed
    opt_per_param = optimizer_bytes_per_parameter(strategy.optimizer, keeps_master)
    optimizer: float = split.trainable * opt_per_param
    if strategy.optimizer == Optimizer.ADAFACTOR:
        optimizer += split.factored_state_elements * FP32
    grads: float = split.trainable * trainable_bytes
    step_grads: float = split.trainable * FP32 if keeps_master else 0

    if stage >= 1:
        optimizer /= n
        step_grads /= n
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
            cpu += optimizer
        else:
            nvme += optimizer
        optimizer = step_grads = 0
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
