"""Which attention kernel a plan runs on a pool: a pinned one where the pool's GPUs run it; else the model's own,
or flex or flash attention where the pool runs it, the model can be planned with it and it holds less memory.

The throughput model charges every kernel alike (the attention FLOPs are the same), so between two kernels
that both run, the one that needs less memory is planned: on packed batches (and padded ones, the plan's worst
case for ``packing: false``) flex attention's block mask replaces SDPA's dense ``(b, 1, s, s)`` mask, its 16-bit
copy in every layer and the keys and values repeated to every query head; flash attention (planned for a
profiled model from its unmasked terms) holds no mask at all.
"""

from __future__ import annotations

import functools
from typing import Final

from memfit.api.gpupool import PoolCapacity
from memfit.api.runtime import Runtime, package_needed
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import ActivationSetup
from memfit.memory.profiled_activations import model_activations
from memfit.planned_model import PlannedModel

KERNEL_NEEDS: Final[dict[Attention, str]] = {
    Attention.FLASH: "flash-attention 2 runs only on Ampere or later GPUs",
    Attention.FLEX: "flex attention is planned only on Ampere or later GPUs (torch has no flex backward pass on the "
    "CPU, and tunes its Triton kernels from Ampere on)",
}
"""The kernels that need more than any pool has, and what they need (said where a pinned one cannot run)."""


def runs_attention(attention: Attention | None, capacity: PoolCapacity) -> bool:
    """Whether the pool's GPUs run the kernel (:data:`KERNEL_NEEDS`): Ampere or later, which is also where bf16
    tensor cores came (a CPU pool has neither). SDPA and eager run anywhere."""
    return attention not in KERNEL_NEEDS or (capacity.bf16 and not capacity.cpu_only)


def can_plan(attention: Attention, capacity: PoolCapacity, runtime: Runtime) -> bool:
    """Whether a plan may run the kernel on the pool: its GPUs run it and the trainer has its package."""
    return runtime.runs(attention) and runs_attention(attention, capacity)


def missing_package(attention: Attention) -> str:
    """Why a pinned kernel cannot be planned where the trainer lacks its package (one clause)."""
    return (
        f"the trainer has no {package_needed(attention)} (memfit's trainer image and `pip install 'memfit[trainer]'` "
        "bring torch's kernels only: sdpa, eager, flex); install it and say so (chart value trainer.kernelPackages, "
        "memfit plan --trainer-packages), or leave strategy.attention out"
    )


ALTERNATIVES: Final = (Attention.FLEX, Attention.FLASH)
"""Kernels planned in place of SDPA where the pool runs them, the trainer has them (:mod:`memfit.api.runtime`),
the model can be planned with them and they hold less, the first such one: a model typed by its sizes gets flex
(torch's own; flash only where flex holds no less), a profiled one flash where the trainer has flash-attn (its
profile plans only its traced kernel, and flash from its unmasked terms), else its SDPA."""


def planned_attention(model: PlannedModel, capacity: PoolCapacity, sequence_length: int, runtime: Runtime) -> Attention:
    """The kernel planned on the pool when the job pins none: the first of :data:`ALTERNATIVES` the pool runs
    and the trainer has, the model can be planned with and that holds less than the model's SDPA; else the
    model's own kernel."""
    default = model.default_attention
    if default != Attention.SDPA:
        return default
    for kernel in ALTERNATIVES:
        # Whether the description plans the kernel at all (precision aside: bf16, which every description plans).
        plannable = model.unplannable(Precision.BF16, kernel, frozenset()) is None
        if can_plan(kernel, capacity, runtime) and plannable and holds_less(model, kernel, sequence_length):
            return kernel
    return default


@functools.lru_cache(maxsize=256)  # per model, kernel and sequence length: a few per job
def holds_less(model: PlannedModel, kernel: Attention, sequence_length: int) -> bool:
    """Whether the kernel's activations stay below SDPA's on a packed row of ``sequence_length``, with and without
    checkpointing. The terms in which they differ (masks, the per-layer mask copies, repeated keys and values,
    flex's maximum scores) are each per row, so one row decides for every micro-batch."""

    def peak(attention: Attention, checkpointing: bool) -> int:
        setup = ActivationSetup(Method.FULL, Precision.BF16, checkpointing, 1, sequence_length, attention)
        return model_activations(model, setup).peak

    return all(peak(kernel, checkpointing) < peak(Attention.SDPA, checkpointing) for checkpointing in (False, True))
