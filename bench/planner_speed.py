"""How long a full planning search takes over a 10-pool inventory (the budget is 50 ms; 100 ms for a model
planned from its profile, whose profile is already at hand: stored or cached).

Run: python bench/planner_speed.py
Prints the first (cold: nothing about the job in the planner's per-process caches yet), median and worst of
repeated searches for a few jobs, and the median's ratio to the budget; with
``method: auto`` every method is searched (the best of each is shown). The CPU-time column is what to
compare on a shared machine, where other processes stretch the wall-clock times.
"""

from __future__ import annotations

import statistics
import time

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.vocabulary import Method
from memfit.planner.search import plan_job

BUDGET_SECONDS = 0.050

INVENTORY = [
    ("a100-80", "NVIDIA-A100-SXM4-80GB", 8, 4, 1800, 3500),
    ("a100-40", "NVIDIA-A100-SXM4-40GB", 8, 2, 1000, 0),
    ("h100", "NVIDIA-H100-80GB-HBM3", 8, 4, 2000, 7000),
    ("h200", "NVIDIA-H200", 8, 2, 2000, 7000),
    ("l40s", "NVIDIA-L40S", 4, 4, 500, 1000),
    ("l4", "NVIDIA-L4", 1, 8, 60, 0),
    ("a10g", "NVIDIA-A10G", 4, 2, 180, 0),
    ("rtx4090", "NVIDIA-GeForce-RTX-4090", 2, 4, 128, 1000),
    ("v100", "Tesla-V100-SXM2-32GB", 8, 2, 700, 0),
    ("t4", "Tesla-T4", 4, 4, 180, 0),
]

JOBS = {
    "llama-3.1-8b auto": ("llama-3.1-8b", Method.AUTO, 64, 4096),
    "llama-2-70b full": ("llama-2-70b", Method.FULL, 64, 2048),
    "qwen2.5-72b auto": ("qwen2.5-72b", Method.AUTO, 128, 8192),
    "qwen3-30b-a3b auto": ("qwen3-30b-a3b", Method.AUTO, 64, 4096),  # planned from its stored profile
}


def inventory() -> list[GPUPool]:
    return [
        GPUPool.model_validate({"metadata": {"name": name}, "spec": {
            "gpuProduct": product, "gpusPerNode": per_node, "nodes": nodes,
            "cpuMemoryGiBPerNode": cpu, "nvmeGiBPerNode": nvme}})
        for name, product, per_node, nodes, cpu, nvme in INVENTORY
    ]  # fmt: skip


def job(preset: str, method: Method, batch: int, sequence: int) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate({
        "model": {"name": preset, "architecture": {"preset": preset}},
        "dataset": {"source": {"pvc": "data"}}, "output": {"pvc": "out"}, "method": method,
        "training": {"globalBatchSize": batch, "sequenceLength": sequence}})  # fmt: skip


def main(repeats: int = 20) -> None:
    pools = inventory()
    print(f"{'job':<22} {'first ms':>9} {'median ms':>10} {'max ms':>8} {'cpu ms':>7} {'budget ratio':>13}  chosen")
    for title, args in JOBS.items():
        spec = job(*args)
        timings, cpu = [], []
        for _ in range(repeats):
            started, started_cpu = time.perf_counter(), time.process_time()
            result = plan_job(spec, pools)
            timings.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
        median = statistics.median(timings)
        chosen = result.chosen.strategy.summary() if result.chosen else "nothing fits"
        print(
            f"{title:<22} {timings[0] * 1000:>9.1f} {median * 1000:>10.1f} {max(timings) * 1000:>8.1f} "
            f"{statistics.median(cpu) * 1000:>7.1f} {median / BUDGET_SECONDS:>13.2f}  {chosen}"
        )


if __name__ == "__main__":
    main()
