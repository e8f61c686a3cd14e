"""A grid of jobs over a mixed inventory, for checks that hold for every plan the planner reports.

Run as a script, it prints every grid job's plan as JSON (timings left out), so that a refactoring can be
compared byte for byte with the plans before it: ``python tests/plan_grid.py > before.json``.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from tests.planning_fixtures import job, pool

INVENTORY: list[GPUPool] = [
    pool("h100", "NVIDIA-H100-80GB-HBM3", 8, 2, 2000, 7000),
    pool("a100-40", "NVIDIA-A100-SXM4-40GB", 8, 1, 1000),
    pool("l4", "NVIDIA-L4", 1, 4, 60),
    pool("rtx4090", "NVIDIA-GeForce-RTX-4090", 2, 2, 128, 1000),
]
"""Large and small GPUs, with and without NVMe, one and several nodes."""

PRESETS = ("llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b", "mixtral-8x7b", "llama-2-70b")
METHODS = ("auto", "full", "lora", "qlora")
NO_DROPOUT = ("mixtral-8x7b",)
"""Models whose all-linear adapters include fused experts, which peft adapts without dropout."""
PINS: dict[str, dict[str, Any]] = {
    "free": {},
    "fsdp2": {"strategy": {"engine": "fsdp2"}},
    "fsdp2-unclipped": {"strategy": {"engine": "fsdp2"}, "training": {"maxGradNorm": 0}},
    "chunked": {"strategy": {"chunkedLoss": True}},
    "deepspeed-offload": {"strategy": {"engine": "deepspeed", "zeroStage": 3, "offloadOptimizer": "cpu"}},
}
"""Pinned strategy knobs (merged into the spec's sections)."""


def grid_jobs() -> Iterator[tuple[str, FineTuneJobSpec]]:
    """(name, spec) of every grid job the API accepts (some pins exclude a method: qlora at ZeRO-3)."""
    for preset, method, (pin_name, pins) in itertools.product(PRESETS, METHODS, PINS.items()):
        training = {"globalBatchSize": 16, "sequenceLength": 4096, **pins.get("training", {})}
        extra = {key: value for key, value in pins.items() if key != "training"}
        if preset in NO_DROPOUT:
            extra["lora"] = {"dropout": 0.0}
        try:
            yield f"{preset} {method} {pin_name}", job(preset, method, training=training, **extra)
        except ValidationError:
            continue


def plans() -> dict[str, Any]:
    from memfit.planner.search import plan_job

    result = {}
    for name, spec in grid_jobs():
        plan = plan_job(spec, INVENTORY).model_dump(mode="json", by_alias=True)
        plan.pop("planningSeconds")
        result[name] = plan
    return result


if __name__ == "__main__":
    json.dump(plans(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
