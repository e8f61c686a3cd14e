"""Small builders for jobs and pools used across the planner tests."""

from __future__ import annotations

import re
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.runtime import Runtime
from memfit.api.vocabulary import Method
from memfit.model_shape import ModelFamily, ModelShape


def pool(name: str, product: str, gpus_per_node: int, nodes: int, cpu_gib: float, nvme_gib: float = 0) -> GPUPool:
    return GPUPool.model_validate({"metadata": {"name": name}, "spec": {
        "gpuProduct": product, "gpusPerNode": gpus_per_node, "nodes": nodes,
        "cpuMemoryGiBPerNode": cpu_gib, "nvmeGiBPerNode": nvme_gib}})  # fmt: skip


def job(preset: str, method: str = "auto", batch: int = 32, sequence: int = 2048, **extra: Any) -> FineTuneJobSpec:
    document: dict[str, Any] = {
        "model": {"name": preset, "architecture": {"preset": preset}},
        "dataset": {"source": {"pvc": "data"}},
        "method": method,
        "training": {"globalBatchSize": batch, "sequenceLength": sequence},
        "output": {"pvc": "out"},
    }
    document.update(extra)
    return FineTuneJobSpec.model_validate(document)


def unvalidated_job(preset: str, method: str, batch: int = 32, **pins: dict[str, Any]) -> FineTuneJobSpec:
    """``job`` with ``pins`` (camelCase fields per section) set without validation: a spec the API refuses,
    as code could still build one, for checking that the planner holds the same rules by itself."""
    valid = job(preset, "full", batch=batch)
    parts = {
        section: getattr(valid, section).model_copy(
            update={re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower(): value for key, value in fields.items()}
        )
        for section, fields in pins.items()
    }
    return valid.model_copy(update={"method": Method(method), **parts})


WITH_FLASH_ATTN = Runtime.of(["flash-attn"])
"""A trainer with flash-attn installed (an image built with the Dockerfile's KERNEL_PACKAGES): what plans that
pin or choose flash attention need."""

A100_NODE = pool("a100", "NVIDIA-A100-SXM4-80GB", 8, 1, 1000)
A100_4_NODES = pool("a100", "NVIDIA-A100-SXM4-80GB", 8, 4, 1000)
ONE_A100 = pool("a100", "NVIDIA-A100-SXM4-80GB", 1, 1, 128)
RTX_4090 = pool("rtx", "NVIDIA-GeForce-RTX-4090", 1, 1, 64)
RTX_4090_BIG_HOST = pool("rtx", "NVIDIA-GeForce-RTX-4090", 1, 1, 256)
V100_NODE = pool("v100", "Tesla-V100-SXM2-32GB", 8, 1, 700)


DECLARED_LLAMA = ModelShape(
    ModelFamily.LLAMA,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=24,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=258,
)
"""A llama a job declares (hidden 512, 24 layers), for the checks that the loaded model is the planned one."""
