"""The GPU counts the planner tries on a pool."""

from __future__ import annotations

from collections.abc import Iterator

from memfit.api.gpupool import PoolCapacity


def layouts(capacity: PoolCapacity, max_gpus: int | None, global_batch: int) -> Iterator[tuple[int, int]]:
    """(nodes, GPUs per node) to try: part of one node in powers of two, or whole nodes. The GPU count
    must divide the global batch so that micro-batch x accumulation x GPUs equals it exactly."""
    per_node = capacity.gpus_per_node
    options = [(1, g) for g in (1, 2, 4, 8, 16) if g < per_node]
    options += [(nodes, per_node) for nodes in range(1, capacity.nodes + 1)]
    for nodes, gpus in options:
        total = nodes * gpus
        if (max_gpus is None or total <= max_gpus) and global_batch % total == 0:
            yield nodes, gpus
