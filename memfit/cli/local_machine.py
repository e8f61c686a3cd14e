"""This machine as a GPUPool, so ``memfit run --local`` plans with the same planner as the cluster.

With NVIDIA GPUs (``nvidia-smi`` answers) the pool is those GPUs, as GPU Feature Discovery would label
them. Without, the pool is a CPU pool (``gpuProduct: cpu``, as on a cluster's CPU-only nodes): every rank is a
CPU process with an equal share of the RAM as its "device memory", and the compute figure is a rough
estimate used only to rank local candidates against each other.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from memfit.api.gpupool import CPU_PRODUCT, GPUPool
from memfit.catalog.gpus import gpu_product
from memfit.units import GIB

HOST_SHARE_FOR_RANKS = 0.8
"""Share of the RAM given to the ranks' device memory on a CPU run (the rest: the OS, data loading)."""


@dataclass(frozen=True)
class LocalMachine:
    gpu_names: tuple[str, ...]
    gpu_memory_mib: tuple[int, ...]
    memory_bytes: int
    cpus: int

    @property
    def has_gpus(self) -> bool:
        return bool(self.gpu_names)


def _total_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo")


def _nvidia_gpus() -> tuple[tuple[str, ...], tuple[int, ...]]:
    if shutil.which("nvidia-smi") is None:
        return (), ()
    completed = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if completed.returncode != 0:
        return (), ()
    rows = [line.rsplit(",", 1) for line in completed.stdout.strip().splitlines() if "," in line]
    return tuple(name.strip() for name, _ in rows), tuple(int(mib) for _, mib in rows)


def inspect_machine() -> LocalMachine:
    names, memory = _nvidia_gpus()
    return LocalMachine(names, memory, _total_memory_bytes(), os.cpu_count() or 1)


def local_pool(machine: LocalMachine, ranks: int) -> GPUPool:
    """A one-node pool of ``ranks`` devices of this machine."""
    host_gib = machine.memory_bytes / GIB
    if machine.has_gpus:
        if ranks > len(machine.gpu_names):
            raise ValueError(f"--nproc {ranks}: this machine has {len(machine.gpu_names)} GPU(s)")
        product = machine.gpu_names[0].replace(" ", "-")
        spec = {"gpuProduct": product, "gpuMemoryGiB": machine.gpu_memory_mib[0] / 1024}
        try:
            gpu_product(product)
        except KeyError:  # not in the table: an order-of-magnitude estimate, to rank local candidates
            spec["peakTFLOPS"] = {"fp16": 100.0}
    else:
        spec = {"gpuProduct": CPU_PRODUCT, "gpuMemoryGiB": HOST_SHARE_FOR_RANKS * host_gib / ranks}
    spec.update({"gpusPerNode": ranks, "nodes": 1, "cpuMemoryGiBPerNode": host_gib})
    return GPUPool.model_validate({"metadata": {"name": "local"}, "spec": spec})
