"""A plan: one way to run a job, with its predicted memory and speed.

These models are both the JSON contract of ``memfit plan -o json`` and ``status.plan`` of a
FineTuneJob, so scripts and the cluster see exactly the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ConfigDict, Field, PositiveInt

from memfit.api.base import ApiModel, to_camel
from memfit.api.vocabulary import (
    EIGHT_BIT_OPTIMIZERS,
    Attention,
    Engine,
    MasterWeights,
    Method,
    Offload,
    Optimizer,
    PlannedMethod,
    PlannedPrecision,
    Precision,
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

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def summary(self) -> str:
        """One line a person can read, e.g. `full zero2 ckpt mb2x4 bf16 adamw on 2x8 a100`."""
        stage = f"zero{self.zero_stage}"
        parts: list[str] = [self.method, stage if self.engine == Engine.DEEPSPEED else f"fsdp2-{stage}"]
        if self.offload_optimizer != Offload.NONE:
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_parameters != Offload.NONE:
            parts.append(f"params->{self.offload_parameters}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.chunked_loss:
            parts.append("chunked-ce")
        if self.activation_offloading:
            parts.append("act->cpu")
        if self.master_weights == MasterWeights.BF16:
            parts.append("bf16-masters")
        if self.optimizer_in_backward:
            parts.append("opt-in-bwd")
        parts += [f"mb{self.micro_batch_size}x{self.gradient_accumulation_steps}", self.precision, self.optimizer]
        return " ".join(parts) + f" on {self.nodes}x{self.gpus_per_node} {self.pool}"


_OFFLOADED = (Offload.CPU, Offload.NVME)


def strategy_conflicts(
    method: Method | None = None,
    precision: Precision | None = None,
    zero_stage: int | None = None,
    offload_optimizer: Offload | None = None,
    offload_parameters: Offload | None = None,
    optimizer: Optimizer | None = None,
    chunked_loss: bool | None = None,
    *,
    gradient_checkpointing: bool | None = None,
    activation_offloading: bool | None = None,
    master_weights: MasterWeights | None = None,
    engine: Engine | None = None,
    optimizer_in_backward: bool | None = None,
    gradient_accumulation_steps: int | None = None,
    clips_gradients: bool | None = None,
) -> list[str]:
    """Why a combination of knobs cannot run as planned: the trainer's preflight refuses it, DeepSpeed
    refuses it, or DeepSpeed silently ignores part of it. ``None`` (and ``auto``) is a knob not decided
    yet: only the rules whose knobs are all decided apply, so the same rules check a spec's pinned knobs
    and each strategy the planner generates."""
    qlora = method == Method.QLORA
    # DeepSpeed cannot partition or offload 4-bit weights; FSDP2 shards their bf16-stored codes (FSDP-QLoRA).
    qlora_on_deepspeed = qlora and engine != Engine.FSDP2
    offloads_optimizer = offload_optimizer in _OFFLOADED
    offloads_parameters = offload_parameters in _OFFLOADED
    conflicts = []
    if qlora and precision in (Precision.FP16, Precision.FP32):
        conflicts.append(
            f"method qlora computes in bf16 (the trainer refuses it in {precision}): set training.precision "
            "to bf16 or auto, on a GPU with bf16"
        )
    if qlora_on_deepspeed and zero_stage == 3:
        conflicts.append("method qlora cannot run under ZeRO-3 (4-bit weights are not partitioned); use zeroStage 0-2")
    if qlora_on_deepspeed and offloads_parameters:
        conflicts.append(
            "method qlora keeps its 4-bit base on the GPU: parameter offload needs ZeRO-3, which qlora cannot use"
        )
    if offloads_parameters and zero_stage is not None and zero_stage != 3:
        conflicts.append(
            "strategy.offloadParameters needs zeroStage 3 (only ZeRO-3 partitions parameters; DeepSpeed "
            "ignores parameter offload under ZeRO 0-2)"
        )
    if offloads_optimizer and zero_stage == 0:
        conflicts.append("strategy.offloadOptimizer needs zeroStage 1-3 (DeepSpeed ignores it without ZeRO)")
    if offload_optimizer == Offload.NVME and (zero_stage in (1, 2) or (qlora and zero_stage is None)):
        conflicts.append(
            "strategy.offloadOptimizer nvme needs zeroStage 3 (ZeRO-1 and ZeRO-2 keep offloaded optimizer "
            "states in CPU memory, whatever the device says)"
        )
    if offloads_optimizer and optimizer in EIGHT_BIT_OPTIMIZERS:
        conflicts.append("8-bit optimizers run on the GPU; they cannot be combined with strategy.offloadOptimizer")
    if chunked_loss and zero_stage == 3:
        conflicts.append(
            "strategy.chunkedLoss needs zeroStage 0-2 (ZeRO-3 partitions the LM head's weight, which the chunked "
            "loss reads whole)"
        )
    if activation_offloading and gradient_checkpointing is False:
        conflicts.append(
            "strategy.activationOffloading moves the saved inputs of checkpointed layers: it needs "
            "strategy.gradientCheckpointing true"
        )
    bf16_masters = master_weights == MasterWeights.BF16
    if bf16_masters and precision in (Precision.FP16, Precision.FP32):
        conflicts.append(f"strategy.masterWeights bf16 needs training.precision bf16 (not {precision})")
    if engine == Engine.FSDP2:
        conflicts += _fsdp2_conflicts(precision, zero_stage, offload_optimizer, offload_parameters, optimizer)
    if bf16_masters and offloads_optimizer and engine != Engine.FSDP2:
        conflicts.append(
            "strategy.masterWeights bf16 keeps the optimizer on the GPU; with strategy.offloadOptimizer use fp32 "
            "masters (host memory holds them)"
        )
    if optimizer_in_backward:
        conflicts += _optimizer_in_backward_conflicts(engine, gradient_accumulation_steps, clips_gradients)
    return conflicts


def _optimizer_in_backward_conflicts(
    engine: Engine | None, gradient_accumulation_steps: int | None, clips_gradients: bool | None
) -> list[str]:
    """Each parameter steps as soon as its gradient is reduced: only fsdp2's hooks do that, the gradient must
    be final (one micro-batch per step), and no step can wait for the norm of all gradients."""
    conflicts = []
    if engine is not None and engine != Engine.FSDP2:
        conflicts.append(
            "strategy.optimizerInBackward needs strategy.engine fsdp2 (it steps each sharded parameter from its "
            "post-accumulate-grad hook)"
        )
    if gradient_accumulation_steps is not None and gradient_accumulation_steps > 1:
        conflicts.append(
            f"strategy.optimizerInBackward needs gradient accumulation 1 (got {gradient_accumulation_steps}): "
            "each micro-batch's gradients are stepped on as its backward makes them; use a micro-batch of "
            "globalBatchSize / GPUs"
        )
    if clips_gradients:
        conflicts.append(
            "strategy.optimizerInBackward cannot clip gradients (a parameter's step cannot wait for the global "
            "norm of all of them): set training.maxGradNorm: 0"
        )
    return conflicts


def _fsdp2_conflicts(
    precision: Precision | None,
    zero_stage: int | None,
    offload_optimizer: Offload | None,
    offload_parameters: Offload | None,
    optimizer: Optimizer | None,
) -> list[str]:
    """What the FSDP2 engine cannot run: it always shards parameters, gradients and optimizer states (ZeRO
    2 or 3, by whether parameters are resharded after the forward pass), and its CPUOffloadPolicy moves all
    three to the host together."""
    conflicts = []
    if precision == Precision.FP16:
        conflicts.append("strategy.engine fsdp2 trains in bf16 or fp32 (fp16 needs loss scaling, which it does not do)")
    if zero_stage in (0, 1):
        conflicts.append(
            "strategy.engine fsdp2 shards parameters, gradients and optimizer states: zeroStage 3 (resharded "
            "after the forward pass) or 2 (kept gathered until the backward pass)"
        )
    if Offload.NVME in (offload_optimizer, offload_parameters):
        conflicts.append("strategy.engine fsdp2 offloads to CPU memory only (no NVMe)")
    elif None not in (offload_optimizer, offload_parameters) and offload_optimizer != offload_parameters:
        conflicts.append(
            "strategy.engine fsdp2 offloads parameters, gradients and optimizer states together: set "
            "offloadOptimizer and offloadParameters alike"
        )
    if optimizer is not None and optimizer != Optimizer.ADAMW:
        conflicts.append(
            f"training.optimizer {optimizer} runs on the deepspeed engine; strategy.engine fsdp2 runs adamw (on "
            "its sharded tensors)"
        )
    return conflicts


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
    """Peak memory of one micro-batch's forward and backward that is not weights, gradients or states
    (also when the optimizer step binds: it runs after they are freed, so `total` then leaves them out)."""
    overhead: int
    """CUDA context, allocator fragmentation and communication buckets."""
    peak_allocated_bytes: int
    """Predicted torch.cuda.max_memory_allocated() of one training step on one rank."""
    total: int
    """What the GPU must hold: the total of the binding moment (`memory.phases`)."""


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
