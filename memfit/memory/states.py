"""Model states the engines share: which parameters train, the tensors they are, and the optimizer states
kept for them, as one rank's :class:`ModelStates` (each engine lays them out: :mod:`memfit.memory.engines`).

Adafactor factors the second moment of tensors of two or more dimensions only: under ZeRO its flat
partition gets a full fp32 second moment. bitsandbytes' 8-bit Adam keeps 32-bit states for tensors under
``min_8bit_size`` elements and, paged, puts the 8-bit states of tensors of at least 1e5 elements in CUDA
managed memory (see :func:`optimizer_state_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Method, Optimizer
from memfit.memory.setup import Adapters
from memfit.memory.sizes import FP32
from memfit.planned_model import PlannedModel, TensorCounts

EIGHT_BIT_MIN_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: a tensor of fewer elements gets two fp32 states instead of 8-bit ones."""
EIGHT_BIT_BLOCK = 256
"""bitsandbytes' 8-bit optimizer states are quantized blockwise, one fp32 absmax per 256 elements."""
QUANTILE_MAP_BYTES = 2 * 256 * FP32
"""The signed and unsigned dynamic quantization maps (256 fp32 values each) an 8-bit Adam keeps on the GPU."""
PAGED_MIN_SIZE = 100_000
"""``get_state_buffer``: a paged optimizer puts the states of tensors of at least 1e5 elements in CUDA managed
memory (``F.get_paged``), smaller ones in ordinary device memory."""


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
def trainable_split(shape: PlannedModel, method: Method, adapters: Adapters) -> TrainableSplit:
    total = shape.parameter_count
    if method == Method.FULL:
        return TrainableSplit(total, total, 0, 0)
    added = shape.lora_parameters(adapters.rank, adapters.targets)
    if method == Method.QLORA:
        quantized = shape.quantizable_parameters
        return TrainableSplit(total + added, added, quantized, total - quantized)
    return TrainableSplit(total + added, added, 0, total)


@lru_cache(maxsize=256)
def trainable_tensors(shape: PlannedModel, method: Method, adapters: Adapters) -> TensorCounts:
    """The shapes of the trained tensors, as ``transformers`` and ``peft`` build them, each with how many
    tensors have it: every parameter in full fine-tuning, the adapters' ``lora_A`` and ``lora_B`` otherwise."""
    if method == Method.FULL:
        return shape.full_tensors()
    return shape.lora_tensors(adapters.rank, adapters.targets)


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


def shard_numel(tensor: tuple[int, ...], ranks: int) -> int:
    """Elements of a rank's (largest) shard of ``tensor`` when FSDP2 splits its dim 0 over ``ranks``."""
    return -(-tensor[0] // ranks) * math.prod(tensor[1:])


@lru_cache(maxsize=1024)
def _per_tensor_state_bytes(
    shape: PlannedModel, method: Method, adapters: Adapters, optimizer: Optimizer, element_bytes: int, ranks: int
) -> OptimizerStateBytes:
    device = paged = 0.0
    eight_bit = False
    for tensor, count in trainable_tensors(shape, method, adapters):
        if optimizer == Optimizer.ADAFACTOR:
            device += count * _adafactor_bytes(tensor)
            continue
        numel = shard_numel(tensor, ranks)
        states = _tensor_state_bytes(optimizer, numel, element_bytes)
        device, paged = device + count * states.device, paged + count * states.paged
        eight_bit = eight_bit or (optimizer in EIGHT_BIT_OPTIMIZERS and numel >= EIGHT_BIT_MIN_SIZE)
    return OptimizerStateBytes(device + (QUANTILE_MAP_BYTES if eight_bit else 0), paged)


def optimizer_state_bytes(
    shape: PlannedModel,
    method: Method,
    adapters: Adapters,
    optimizer: Optimizer,
    element_bytes: int,
    partition: float | None,
    shards: int = 1,
) -> OptimizerStateBytes:
    """One rank's optimizer states (without master weights): for the flat ZeRO partition of ``partition``
    elements, or (``None``) for every trained tensor, whole (ZeRO-0) or, with ``shards`` ranks, this rank's
    FSDP2 shard of each (bitsandbytes steps each local shard: ``memfit_trainer.sharded_8bit``).
    ``element_bytes`` is the width of what the optimizer updates (4: fp32 masters or fp32 training; 2: bf16
    masters), the dtype of Adam's and Lion's states (``zeros_like(param)``)."""
    if partition is None:
        return _per_tensor_state_bytes(shape, method, adapters, optimizer, element_bytes, shards)
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


@lru_cache(maxsize=256)
def largest_trainable_tensor(shape: PlannedModel, method: Method, adapters: Adapters) -> int:
    """Elements of the largest trained tensor (the embedding or LM head in full fine-tuning)."""
    return max(math.prod(t) for t, _ in trainable_tensors(shape, method, adapters))
