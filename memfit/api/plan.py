"""A plan: one way to run a job, with its predicted memory and speed.

These models are both the JSON contract of ``memfit plan -o json`` and ``status.plan`` of a
FineTuneJob, so scripts and the cluster see exactly the same fields.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from operator import attrgetter
from typing import Any

from pydantic import ConfigDict, Field, PositiveInt

from memfit.api.base import ApiModel, to_camel
from memfit.api.knobs import Knobs, knobs_of
from memfit.api.techniques import TECHNIQUES
from memfit.api.vocabulary import (
    Attention,
    Engine,
    MasterWeights,
    Offload,
    Optimizer,
    PlannedMethod,
    PlannedPrecision,
    StepPhase,
    ZeroStage,
)

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
    chunked_loss: bool = False
    """Whether the LM head and the cross-entropy run chunk by chunk (recomputed in backward), so the
    full-vocabulary logits never exist."""
    activation_offloading: bool = False
    """Whether checkpointed layers' saved inputs wait in pinned host memory between forward and backward."""
    master_weights: MasterWeights = MasterWeights.FP32
    """fp32 master weights (mixed precision), or pure bf16 weights, gradients and optimizer states."""
    engine: Engine = Engine.DEEPSPEED
    """deepspeed (ZeRO), or fsdp2 (PyTorch fully_shard: zeroStage 3 reshards parameters after the forward
    pass, 2 keeps them gathered until the backward; offload moves parameters, gradients and optimizer states
    to the host together)."""
    optimizer_in_backward: bool = False
    """fsdp2 only: each parameter's optimizer step runs in the backward pass as soon as its sharded gradient
    is reduced, and the gradient is freed, so the full set of gradients never exists (accumulation 1, no
    gradient clipping)."""
    sequence_parallel: PositiveInt = 1
    """Ranks one sequence is split over (Ulysses sequence parallelism: each holds 1/n of its tokens and
    attends over all of them through two all-to-alls per attention); 1: every rank holds whole sequences."""
    tiled_mlp: bool = False
    """Whether each MLP runs tile by tile along the sequence, recomputed in backward, so its
    intermediate-sized activations exist for one tile at a time."""
    packing: bool = True
    """Whether documents are packed into full sequences (dataset.packing, or where the job leaves it out,
    whether the model keeps packed documents apart)."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Ranks that train on different sequences (each sequence is split over ``sequence_parallel`` of the
        GPUs): global batch = micro-batch x accumulation x data_parallel."""
        return self.gpus // self.sequence_parallel

    def knobs(self) -> Knobs:
        """Its choices (every one decided), for the rule table."""
        return knobs_of(self)

    def replaced(self, **changes: Any) -> Strategy:
        """``dataclasses.replace(self, **changes)``, built positionally: the planner copies strategies by the
        ten thousand, and ``replace`` costs it a fifth of its time."""
        values = list(_STRATEGY_VALUES(self))
        for name, value in changes.items():
            values[_STRATEGY_INDEX[name]] = value
        return Strategy(*values)

    def identity(self) -> str:
        """Every knob and the placement, `name=value` joined by commas: two strategies are the same exactly
        when their identities are (`status.excludedStrategies` records them; the summary leaves some out)."""
        return ",".join(f"{field.name}={getattr(self, field.name)}" for field in fields(self))

    def summary(self) -> str:
        """One line a person can read, e.g. `full zero2 ckpt mb2x4 bf16 adamw on 2x8 a100` (``sp4``: each
        sequence split over 4 GPUs)."""
        stage = f"zero{self.zero_stage}"
        parts: list[str] = [self.method, stage if self.engine == Engine.DEEPSPEED else f"fsdp2-{stage}"]
        if self.offload_optimizer != Offload.NONE:
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_parameters != Offload.NONE:
            parts.append(f"params->{self.offload_parameters}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.sequence_parallel > 1:
            parts.append(f"sp{self.sequence_parallel}")
        parts += [technique.token for technique in TECHNIQUES if getattr(self, technique.knob)]
        if self.master_weights == MasterWeights.BF16:
            parts.append("bf16-masters")
        if not self.packing:
            parts.append("unpacked")
        parts += [f"mb{self.micro_batch_size}x{self.gradient_accumulation_steps}", self.precision, self.optimizer]
        return " ".join(parts) + f" on {self.nodes}x{self.gpus_per_node} {self.pool}"


def current_identity(recorded: str) -> str:
    """``recorded``, a :meth:`Strategy.identity` written by any memfit version, as this version writes it: a knob
    added since takes its default (the value every strategy had before the knob existed), so that a strategy
    excluded before an upgrade stays excluded. One naming a field this version lacks is returned unchanged (it
    matches no strategy)."""
    values = dict(part.split("=", 1) for part in recorded.split(",") if "=" in part)
    parts = []
    for known in fields(Strategy):
        if known.name in values:
            parts.append(f"{known.name}={values.pop(known.name)}")
        elif known.default is not MISSING:
            parts.append(f"{known.name}={known.default}")
        else:
            return recorded
    return recorded if values else ",".join(parts)


_STRATEGY_VALUES = attrgetter(*(field.name for field in fields(Strategy)))
_STRATEGY_INDEX = {field.name: index for index, field in enumerate(fields(Strategy))}


@dataclass(frozen=True, slots=True)
class PhaseMemory:
    """What one GPU holds at one moment of the training step, in bytes: `total` is the five parts."""

    __pydantic_config__ = API_RECORD

    parameters: int
    """Model weights resident on the GPU."""
    gradients: int
    """Gradients alive at this moment (in the optimizer step, with the fp32 gradient partition it reads)."""
    optimizer_states: int
    """Optimizer states and fp32 master weights resident on the GPU."""
    activations: int
    """Memory of one micro-batch's forward and backward beyond weights, gradients and states (none is
    left in the optimizer step)."""
    overhead: int
    """CUDA context, allocator fragmentation and communication buckets (the same at both moments)."""
    total: int
    """The five parts above."""

    @classmethod
    def of(cls, parameters: int, gradients: int, optimizer_states: int, activations: int, overhead: int) -> PhaseMemory:
        """The breakdown with its total."""
        total = parameters + gradients + optimizer_states + activations + overhead
        return cls(parameters, gradients, optimizer_states, activations, overhead, total)


@dataclass(frozen=True, slots=True)
class PlanPhases:
    """The two moments of a training step; the GPU must hold the larger (`memory.binding`)."""

    __pydantic_config__ = API_RECORD

    forward_backward: PhaseMemory
    """At the worst point of one micro-batch's forward and backward passes."""
    optimizer_step: PhaseMemory
    """During the optimizer step."""

    def at(self, phase: StepPhase) -> PhaseMemory:
        return self.forward_backward if phase == StepPhase.FORWARD_BACKWARD else self.optimizer_step


@dataclass(frozen=True, slots=True)
class PerGPUMemory:
    """Predicted memory of one GPU, in bytes, at the moment of the step that binds (`memory.binding`;
    `memory.phases` breaks down both). `total` is what the GPU must hold: parameters + gradients +
    optimizerStates + overhead, plus activations when the forward/backward pass binds (the optimizer step
    runs after they are freed); `peakAllocatedBytes` is the predicted torch.cuda.max_memory_allocated()."""

    __pydantic_config__ = API_RECORD

    parameters: int
    """Model weights resident on the GPU (16-bit copies, 4-bit for QLoRA, ZeRO-3 shard plus gathered layers)."""
    gradients: int
    """Gradients resident on the GPU at the binding moment (in the optimizer step with the fp32 partition
    it reads)."""
    optimizer_states: int
    """Optimizer states and fp32 master weights resident on the GPU."""
    activations: int
    """Memory of one micro-batch's forward and backward that is not weights, gradients or states, at the
    forward/backward pass's binding moment (also when the optimizer step binds: it runs after they are freed, so
    `total` then leaves them out). Their own peak can come at another moment: `activationPeak`."""
    overhead: int
    """CUDA context, allocator fragmentation and communication buckets."""
    peak_allocated_bytes: int
    """Predicted torch.cuda.max_memory_allocated() of one training step on one rank."""
    total: int
    """What the GPU must hold: the total of the binding moment (`memory.phases`)."""
    activation_peak: int | None = None
    """The most one micro-batch's forward and backward hold beyond weights, gradients and states, at whichever
    moment (the loss's, for a checkpointed step): what a trace of the step's activations peaks at. It exceeds
    `activations` where the pass binds elsewhere (a sharded step binds where the most layers are gathered).
    None in plans recorded before it was."""


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
    phases: PlanPhases | None = None
    """Per GPU at each moment of the step: the forward/backward pass and the optimizer step (null only in
    plans recorded before memfit reported them)."""
    binding: StepPhase | None = None
    """The moment whose total is `perGPU.total`: forwardBackward or optimizerStep (the larger; null with
    `phases`)."""


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
    techniques: str | None = None
    """What the memory-saving techniques the plan uses (chunked loss, activation offloading, bf16 master
    weights) bought it, e.g. `chunked loss: micro-batch 4 (2 without)`; null when it uses none."""


class RejectedCandidate(PlanCandidate):
    """A candidate that was not chosen because it does not fit, with the reason."""

    reason: str
    """Why it cannot run."""


class PlanResult(ApiModel):
    """Everything the planner found for one job."""

    chosen: PlanCandidate | None
    """The fastest candidate that fits (with `method: auto`, of the method that changes the model least
    among those that fit: full, then lora, then qlora), or null when nothing fits."""
    why_chosen: str | None = None
    """Why the chosen candidate won, in one sentence (null when nothing fits)."""
    candidates: list[PlanCandidate]
    """Candidates that fit, in the order the planner prefers them, the chosen one first: by method (full,
    then lora, then qlora), then fastest first. At most 50, always including the best candidate of every
    method the spec allows that fits; options another candidate dominates outright, such as recomputation
    where the largest micro-batch fits without it, are not evaluated."""
    feasible_count: int = 0
    """How many candidates fit in all."""
    rejected: list[RejectedCandidate]
    """Candidates that do not fit, nearest miss first."""
    planning_seconds: float
    """How long planning took."""
    advice: list[str] = Field(default_factory=list)
    """When nothing fits: why, and what would make the nearest miss fit (each line follows from why the
    candidates were rejected or never tried)."""
    model_parameters: int
    """Parameters of the planned model, as ``transformers`` builds it."""
    model_basis: str
    """What the memory was computed from: the profile of the model's own code (its config.json), or sizes
    typed in the job (a preset or explicit sizes) counted by a family's formulas."""
