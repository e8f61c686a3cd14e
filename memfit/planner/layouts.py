"""The GPU counts the planner tries on a pool, and the sequence-parallel degrees on each."""

from __future__ import annotations

from collections.abc import Iterator

from memfit.api.finetunejob import MAX_SEQUENCE_PARALLEL
from memfit.api.gpupool import PoolCapacity


def sequence_parallel_degrees(gpus: int, pinned: int | None) -> list[int]:
    """GPUs one sequence may be split over on ``gpus``: the pinned degree where it divides them, else the powers
    of two that do, lowest first (so within a node before across nodes: the all-to-alls cross the group's
    links every layer)."""
    if pinned is not None:
        return [pinned] if gpus % pinned == 0 else []
    return [
        degree for degree in (2**power for power in range(MAX_SEQUENCE_PARALLEL.bit_length())) if gpus % degree == 0
    ]


def layouts(
    capacity: PoolCapacity, max_gpus: int | None, global_batch: int, pinned_degree: int | None = None
) -> Iterator[tuple[int, int]]:
    """(nodes, GPUs per node) to try: part of one node in powers of two, or whole nodes. The data-parallel
    ranks (GPUs over some sequence-parallel degree) must divide the global batch so that micro-batch x
    accumulation x data-parallel ranks equals it exactly."""
    per_node = capacity.gpus_per_node
    options = [(1, g) for g in (1, 2, 4, 8, 16) if g < per_node]
    options += [(nodes, per_node) for nodes in range(1, capacity.nodes + 1)]
    for nodes, gpus in options:
        total = nodes * gpus
        if (max_gpus is None or total <= max_gpus) and batch_degrees(total, global_batch, pinned_degree):
            yield nodes, gpus


def batch_degrees(gpus: int, global_batch: int, pinned_degree: int | None) -> list[int]:
    """The sequence-parallel degrees on ``gpus`` whose data-parallel ranks divide the global batch."""
    return [degree for degree in sequence_parallel_degrees(gpus, pinned_degree) if global_batch % (gpus // degree) == 0]
