"""GPU memory that is neither model states nor activations: runtime and allocator (each engine's
communication buffers are its own: :mod:`memfit.memory.engines`).

These are estimates from typical CUDA 12 / NCCL 2.2x deployments (none of them can be measured on a
machine without a GPU); the planner's headroom (default 10%) covers their spread.
"""

from __future__ import annotations

from memfit.memory.setup import StaticSetup

MIB = 1024**2

CUDA_CONTEXT_BYTES = 640 * MIB
"""CUDA context, cuBLAS/cuDNN workspaces and lazily loaded kernels of one PyTorch process."""

NCCL_BYTES = 512 * MIB
"""NCCL communicator buffers of a multi-GPU run (channels x peers x 4 MiB, a few communicators)."""

FRAGMENTATION = 0.05
"""Caching-allocator fragmentation, as a share of the memory that is allocated and freed every step
(activations and gradients); the steady model states do not fragment."""


def runtime_bytes(setup: StaticSetup) -> int:
    """CUDA context, and NCCL's buffers when there is more than one GPU."""
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if setup.gpus > 1 else 0)
