"""When nothing fits: say how close the nearest miss came and what would make it fit."""

from __future__ import annotations

from collections.abc import Sequence

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool, pool_capacity
from memfit.api.plan import RejectedCandidate
from memfit.api.vocabulary import Method, Precision
from memfit.model_shape import ModelShape

GIB = 1024**3


def advise(
    spec: FineTuneJobSpec, shape: ModelShape, misses: Sequence[RejectedCandidate], pools: Sequence[GPUPool]
) -> list[str]:
    """Sentences for a person: the nearest miss, then each change that would close the gap."""
    if not misses:
        return _why_nothing_was_tried(spec, pools)
    nearest = misses[0]
    strategy, gpu = nearest.strategy, nearest.memory.per_gpu
    usable = nearest.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100)
    advice = [f"nearest miss: {strategy.summary()} ({nearest.reason})"]
    lighter_method = spec.method not in (Method.AUTO, Method.QLORA)
    if not nearest.reason.startswith("GPU memory"):
        advice.append(
            "the states offloaded to the host need more room: more CPU memory or NVMe per node "
            "(cpuMemoryGiBPerNode, nvmeGiBPerNode), or more nodes (ZeRO-3 divides them between nodes)"
        )
        if lighter_method:
            advice.append("method auto (or lora/qlora) trains adapters and offloads almost nothing")
        return advice
    gap = gpu.total - usable
    headroom = 1 - spec.resources.memory_headroom_percent / 100
    advice.append(f"it needs {gap / GIB:.1f} GiB more per GPU: a GPU with at least "
                  f"{gpu.total / headroom / GIB:.0f} GiB would fit it")  # fmt: skip
    if gpu.activations > gap and spec.training.sequence_length > 256:
        advice.append(
            f"activations take {gpu.activations / GIB:.1f} GiB at sequenceLength {spec.training.sequence_length}: "
            "a shorter sequence or gradient checkpointing shrinks them"
        )
    if spec.method not in (Method.AUTO, Method.QLORA):
        advice.append(
            "method auto (or lora/qlora) trains adapters on a frozen, possibly 4-bit base: far smaller states"
        )
    states = gpu.parameters + gpu.gradients + gpu.optimizer_states
    if states > gap and strategy.zero_stage == 3:
        advice.append("more GPUs: ZeRO-3 divides weights, gradients and optimizer states by the GPU count "
                      "(raise resources.maxGPUs or add nodes to a pool)")  # fmt: skip
    if spec.strategy.offload_optimizer is not None or spec.strategy.zero_stage is not None:
        advice.append("unpin strategy.zeroStage/offloadOptimizer to let the planner offload states to CPU or NVMe")
    return advice


def _why_nothing_was_tried(spec: FineTuneJobSpec, pools: Sequence[GPUPool]) -> list[str]:
    """No candidate was even evaluated: the batch does not divide, or a pinned knob rules pools out."""
    batch, max_gpus = spec.training.global_batch_size, spec.resources.max_gpus
    advice = []
    if spec.training.precision is Precision.BF16 and not any(pool_capacity(p).bf16 for p in pools):
        advice.append("training.precision bf16 is pinned, but no pool's GPU supports bf16: use auto or fp16")
    if spec.strategy.micro_batch_size is not None:
        advice.append(f"strategy.microBatchSize {spec.strategy.micro_batch_size} must divide the per-GPU batch "
                      f"(globalBatchSize {batch} / GPUs)")  # fmt: skip
    advice.append(f"training.globalBatchSize {batch} must be divisible by the GPU count"
                  + (f" (at most resources.maxGPUs {max_gpus})" if max_gpus else "")
                  + ": a power of two fits every layout")  # fmt: skip
    return advice
