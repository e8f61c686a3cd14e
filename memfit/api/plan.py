"""A plan: one way to run a job, with its predicted memory and speed.

These models are both the JSON contract of ``memfit plan -o json`` and ``status.plan`` of a
FineTuneJob, so scripts and the cluster see exactly the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ConfigDict, Field, PositiveInt

from memfit.api.base import ApiModel, to_camel
from memfit.api.vocabulary import Attention, Offload, Optimizer, PlannedMethod, PlannedPrecision, ZeroStage

API_RECORD = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True)
"""ApiModel's wire conventions for the plain dataclasses below: the planner builds thousands of them per
search, so they are frozen slotted dataclasses rather than validated models, and pydantic validates and
serialises them only where they cross the API (status.plan, `memfit plan -o json`)."""


@dataclass(frozen=True, slots=True)
class Strategy:
    """Every knob of one way to run the job."""

    __pydantic_config__ = API_RECORD

    method: PlannedMethod
    """full, lora or qlora."""
    pool: str
    """The GPUPool the job runs on."""
    nodes: PositiveInt
    """Nodes (one trainer pod each)."""
    gpus_per_node: PositiveInt
    """GPUs used on each node."""
    zero_stage: ZeroStage
    """DeepSpeed ZeRO stage."""
    offload_optimizer: Offload
    """Where optimizer states live."""
    offload_parameters: Offload
    """Where ZeRO-3 keeps parameters between uses."""
    gradient_checkpointing: bool
    """Whether activations are recomputed in the backward pass."""
    micro_batch_size: PositiveInt
    """Sequences per GPU per forward pass."""
    gradient_accumulation_steps: PositiveInt
    """Micro-batches per optimizer step."""
    precision: PlannedPrecision
    """Compute precision (bf16/fp16 are mixed precision with fp32 master weights)."""
    optimizer: Optimizer
    """Optimizer."""
    attention: Attention
    """Attention kernel."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def summary(self) -> str:
        """One line a person can read, e.g. `full zero2 ckpt mb2x4 bf16 adamw on 2x8 a100`."""
        parts: list[str] = [self.method, f"zero{self.zero_stage}"]
        if self.offload_optimizer != Offload.NONE:
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_parameters != Offload.NONE:
            parts.append(f"params->{self.offload_parameters}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        parts += [f"mb{self.micro_batch_size}x{self.gradient_accumulation_steps}", self.precision, self.optimizer]
        return " ".join(parts) + f" on {self.nodes}x{self.gpus_per_node} {self.pool}"


@dataclass(frozen=True, slots=True)
class PerGPUMemory:
    """Predicted memory of one GPU, in bytes. `total` = parameters + gradients + optimizerStates +
    activations + overhead; `peakAllocatedBytes` is the predicted torch.cuda.max_memory_allocated()."""

    __pydantic_config__ = API_RECORD

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

    @classmethod
    def of(cls, parameters: int, gradients: int, optimizer_states: int, activations: int, overhead: int,
           peak_allocated_bytes: int) -> PerGPUMemory:  # fmt: skip
        """The breakdown with its total."""
        total = parameters + gradients + optimizer_states + activations + overhead
        return cls(parameters, gradients, optimizer_states, activations, overhead, peak_allocated_bytes, total)


@dataclass(frozen=True, slots=True)
class PerNodeMemory:
    """Host-side memory of one node, in bytes."""

    __pydantic_config__ = API_RECORD

    cpu: int
    """CPU RAM for offloaded states and model loading, all ranks of the node together."""
    nvme: int
    """NVMe space for offloaded states."""


@dataclass(frozen=True, slots=True)
class PlanMemory:
    """Predicted memory of a plan (estimates, never measurements)."""

    __pydantic_config__ = API_RECORD

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

    strategy: Strategy
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
