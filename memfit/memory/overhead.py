"""GPU memory that is neither model states nor activations: runtime, allocator and communication.

These are estimates from typical CUDA 12 / NCCL 2.2x deployments (none of them can be measured on a
machine without a GPU); the planner's headroom (default 10%) covers their spread.
"""

from __future__ import annotations

from memfit.api.plan import Strategy
from memfit.api.vocabulary import Engine
from memfit.memory.states import compute_bytes
from memfit.model_shape import ModelShape
from memfit.render.deepspeed import bucket_elements

MIB = 1024**2

CUDA_CONTEXT_BYTES = 640 * MIB
"""CUDA context, cuBLAS/cuDNN workspaces and lazily loaded kernels of one PyTorch process."""

NCCL_BYTES = 512 * MIB
"""NCCL communicator buffers of a multi-GPU run (channels x peers x 4 MiB, a few communicators)."""

FRAGMENTATION = 0.05
"""Caching-allocator fragmentation, as a share of the memory that is allocated and freed every step
(activations and gradients); the steady model states do not fragment."""

OVERLAP_BUCKETS = 4.5
"""DeepSpeed's documentation: with overlap_comm, ZeRO-1/2 keep about 4.5x each bucket size alive."""

DDP_ALLREDUCE_ELEMENTS = 500_000_000
"""ZeRO-0: DeepSpeed all-reduces gradients in flattened buckets of up to 5e8 elements."""


def communication_buffer_bytes(shape: ModelShape, strategy: Strategy, trainable: int) -> int:
    """Gradient and parameter buckets DeepSpeed allocates for collective communication. FSDP2 has no
    buckets: its all-gather and reduce-scatter buffers are counted where they are alive
    (:mod:`memfit.memory.fsdp2`)."""
    if strategy.gpus == 1 or strategy.engine == Engine.FSDP2:
        return 0
    w = compute_bytes(strategy.precision)
    buckets = bucket_elements(shape, strategy.zero_stage)
    if strategy.zero_stage == 0:
        return w * min(trainable, DDP_ALLREDUCE_ELEMENTS)
    if strategy.zero_stage in (1, 2):
        return int(OVERLAP_BUCKETS * w * (buckets["reduce"] + buckets["allgather"]))
    return 2 * w * buckets["reduce"]  # double-buffered reduce-scatter; prefetched weights are in the working set


def runtime_bytes(strategy: Strategy) -> int:
    """CUDA context, and NCCL's buffers when there is more than one GPU."""
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if strategy.gpus > 1 else 0)
