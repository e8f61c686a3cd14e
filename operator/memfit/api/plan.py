"""A plan: one way to run a job, with its predicted memory and speed.

These models are both the JSON contract of ``memfit plan -o json`` and ``status.plan`` of a
FineTuneJob, so scripts and the cluster see exactly the same fields.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

from pydantic import Field

from memfit.api.base import ApiModel
from memfit.strategy import Strategy

MethodName = Literal["full", "lora", "qlora"]
PrecisionName = Literal["bf16", "fp16", "fp32"]
OffloadName = Literal["none", "cpu", "nvme"]
OptimizerName = Literal["adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "lion"]
AttentionName = Literal["sdpa", "eager", "flash"]


class PlanStrategy(ApiModel):
    """Every knob of one way to run the job."""

    method: MethodName
    """full, lora or qlora."""
    pool: str
    """The GPUPool the job runs on."""
    nodes: int = Field(ge=1)
    """Nodes (one trainer pod each)."""
    gpus_per_node: int = Field(ge=1)
    """GPUs used on each node."""
    zero_stage: int = Field(ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    offload_optimizer: OffloadName
    """Where optimizer states live."""
    offload_parameters: OffloadName
    """Where ZeRO-3 keeps parameters between uses."""
    gradient_checkpointing: bool
    """Whether activations are recomputed in the backward pass."""
    micro_batch_size: int = Field(ge=1)
    """Sequences per GPU per forward pass."""
    gradient_accumulation_steps: int = Field(ge=1)
    """Micro-batches per optimizer step."""
    precision: PrecisionName
    """Compute precision (bf16/fp16 are mixed precision with fp32 master weights)."""
    optimizer: OptimizerName
    """Optimizer."""
    attention: AttentionName
    """Attention kernel."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_strategy(self) -> Strategy:
        return Strategy(**self.model_dump())

    @classmethod
    def from_strategy(cls, strategy: Strategy) -> PlanStrategy:
        return cls.model_validate(asdict(strategy))

    def summary(self) -> str:
        return self.to_strategy().summary()


class PerGPUMemory(ApiModel):
    """Predicted memory of one GPU, in bytes. `total` = parameters + gradients + optimizerStates +
    activations + overhead; `peakAllocatedBytes` is the predicted torch.cuda.max_memory_allocated()."""

    parameters: int
    """Model weights resident on the GPU (16-bit copies, 4-bit for QLoRA, ZeRO-3 shard plus gathered layers)."""
    gradients: int
    """Gradients resident on the GPU."""
    optimizer_states: int
    """Optimizer states and fp32 master weights resident on the GPU."""
    activations: int
    """Peak memory of one micro-batch's forward and backward that is not weights, gradients or states."""
    overhead: int
    """CUDA context, allocator fragmentation and communication buckets."""
    peak_allocated_bytes: int
    """Predicted torch.cuda.max_memory_allocated() of one training step on one rank."""
    total: int
    """What the GPU must hold: the five parts above."""


class PerNodeMemory(ApiModel):
    """Host-side memory of one node, in bytes."""

    cpu: int
    """CPU RAM for offloaded states and model loading, all ranks of the node together."""
    nvme: int
    """NVMe space for offloaded states."""


class PlanMemory(ApiModel):
    """Predicted memory of a plan (estimates, never measurements)."""

    per_gpu: PerGPUMemory
    """Per GPU."""
    per_node: PerNodeMemory
    """Per node."""


class PlanThroughput(ApiModel):
    """Estimated speed (a model of FLOPs, communication and offload traffic, not a measurement)."""

    tokens_per_second: float
    """Estimated training tokens per second, all GPUs together."""
    step_seconds: float
    """Estimated seconds per optimizer step."""


class PlanCandidate(ApiModel):
    """One evaluated way to run the job."""

    strategy: PlanStrategy
    """The knobs."""
    parameter_count: int
    """Parameters of the model."""
    trainable_parameter_count: int
    """Parameters that are trained (all for full; the adapters for LoRA/QLoRA)."""
    memory: PlanMemory
    """Predicted memory."""
    gpu_memory_bytes: int
    """Memory of one GPU of the pool."""
    fits: bool
    """Whether the plan fits the GPU (with headroom) and the node's CPU memory and NVMe."""
    throughput: PlanThroughput
    """Estimated speed."""


class RejectedCandidate(PlanCandidate):
    """A candidate that was not chosen because it does not fit, with the reason."""

    reason: str
    """Why it cannot run."""


class PlanResult(ApiModel):
    """Everything the planner found for one job."""

    chosen: PlanCandidate | None
    """The fastest candidate that fits, or null when nothing fits."""
    candidates: list[PlanCandidate]
    """Candidates that fit, fastest first (the first 50; options another candidate dominates outright,
    such as recomputation where the largest micro-batch fits without it, are not evaluated)."""
    feasible_count: int = 0
    """How many candidates fit in all."""
    rejected: list[RejectedCandidate]
    """Candidates that do not fit, nearest miss first."""
    planning_seconds: float
    """How long planning took."""
    advice: list[str] = Field(default_factory=list)
    """When nothing fits: what would make the nearest miss fit."""
