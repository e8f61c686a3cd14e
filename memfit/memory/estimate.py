"""Per-GPU and per-node memory of one strategy: model states, activations and overhead together.

A training step has two peaks and the GPU must hold the larger:

* forward/backward: weights + optimizer states + activations, with gradients growing as activations
  are freed layer by layer (both are linear in the layers done, so the peak is at one end: all
  activations, or all gradients). With gradient accumulation the gradients of earlier micro-batches
  are alive throughout.
* optimizer step: weights + states + gradients + the fp32 gradient partition the optimizer reads.

Both moments are reported (``memory.phases``), each a breakdown whose parts add up to its total, with
the one that binds. The per-GPU summary is the binding moment's, except that its activations are always
the forward/backward's (the plan contract's meaning: the optimizer step holds none).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.api.plan import PerGPUMemory, PerNodeMemory, PhaseMemory, PlanMemory, PlanPhases, Strategy
from memfit.api.vocabulary import Engine, Method, Precision, StepPhase
from memfit.memory.activations import ActivationEstimate, ActivationSetup
from memfit.memory.fsdp2 import Fsdp2Moment, Fsdp2Step, fsdp2_step, is_fsdp2
from memfit.memory.overhead import FRAGMENTATION, communication_buffer_bytes, runtime_bytes
from memfit.memory.states import (
    BF16,
    NF4_BYTES_PER_PARAMETER,
    ModelStates,
    compute_bytes,
    model_states,
    trainable_split,
)
from memfit.model_shape import ModelShape

GIB = 1024**3
HOST_BYTES_PER_RANK = 3 * GIB
"""CPU memory of one trainer process besides offloaded states: Python, torch, CUDA host state, data
loading workers."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    targets: tuple[str, ...]
    dropout: bool


def activation_setup(
    shape: ModelShape, strategy: Strategy, sequence_length: int, lora: LoraSettings
) -> ActivationSetup:
    targets = shape.resolve_lora_targets(lora.targets) if strategy.method != Method.FULL else frozenset()
    return ActivationSetup(
        method=strategy.method,
        precision=strategy.precision,
        gradient_checkpointing=strategy.gradient_checkpointing,
        micro_batch_size=strategy.micro_batch_size,
        sequence_length=sequence_length,
        attention=strategy.attention,
        lora_rank=lora.rank if strategy.method != Method.FULL else 0,
        lora_targets=targets,
        lora_dropout=lora.dropout,
        adapter_bytes=compute_bytes(strategy.precision),  # the trainer casts the adapters to it (model.py)
        chunked_loss=strategy.chunked_loss,
        activation_offloading=strategy.activation_offloading,
        masked_batches=True,  # packed batches, or with `packing: false` the worst case: one with padding
    )


def loaded_on_host(shape: ModelShape, strategy: Strategy) -> int:
    """Bytes one rank holds in host memory while it builds the model, before the engine places it.

    On DeepSpeed, ZeRO-3 builds the model already partitioned and QLoRA quantizes shard by shard straight
    onto the GPU: neither holds the whole model on the host. Otherwise every rank loads the 16-bit model
    into host memory first; on fsdp2, QLoRA's rank builds its 4-bit model there (packed weights, quant
    states, the rest in bf16) and ``fully_shard`` moves it to the GPU layer by layer."""
    if strategy.engine == Engine.DEEPSPEED and (strategy.zero_stage == 3 or strategy.method == Method.QLORA):
        return 0
    if strategy.method == Method.QLORA:
        quantized = shape.quantizable_parameters
        return int(quantized * NF4_BYTES_PER_PARAMETER) + BF16 * (shape.parameter_count - quantized)
    return BF16 * shape.parameter_count


def host_memory_per_node(shape: ModelShape, strategy: Strategy, states: ModelStates) -> tuple[int, int]:
    """(CPU, NVMe) bytes of one node: its ranks' offloaded states, or loading the model, if larger."""
    ranks = strategy.gpus_per_node
    steady = ranks * (states.cpu_per_rank + HOST_BYTES_PER_RANK)
    loaded = loaded_on_host(shape, strategy)
    loading = ranks * (loaded + HOST_BYTES_PER_RANK) if loaded else 0
    return max(steady, loading), ranks * states.nvme_per_rank


@dataclass(frozen=True, slots=True)
class StaticMemory:
    """Everything about a strategy's memory that does not depend on the micro-batch (the planner
    computes it once per combination of the other knobs)."""

    states: ModelStates
    trainable: int
    communication_buffers: int
    runtime: int
    """CUDA context and NCCL buffers."""
    cpu_per_node: int
    nvme_per_node: int
    zero_stage: int
    gradients_timeline: GradientTimeline
    ranks_per_node: int
    """Trainer processes (GPUs) per node, each holding its own offloaded activations."""
    fsdp2: Fsdp2Step | None = None
    """The FSDP2 engine's gathered parameters and communication buffers (None: DeepSpeed)."""

    @property
    def floor(self) -> int:
        """GPU bytes before any activation: no micro-batch fits when this does not."""
        return self.states.parameters + self.states.optimizer_states + self.communication_buffers + self.runtime


def static_memory(shape: ModelShape, strategy: Strategy, lora: LoraSettings) -> StaticMemory:
    states = model_states(shape, strategy, lora.rank, lora.targets)
    trainable = trainable_split(shape, strategy.method, lora.rank, lora.targets).trainable
    cpu, nvme = host_memory_per_node(shape, strategy, states)
    return StaticMemory(
        states=states,
        trainable=trainable,
        communication_buffers=communication_buffer_bytes(shape, strategy, trainable),
        runtime=runtime_bytes(strategy),
        cpu_per_node=cpu,
        nvme_per_node=nvme,
        zero_stage=strategy.zero_stage,
        gradients_timeline=gradient_timeline(shape, strategy.method, strategy.precision),
        ranks_per_node=strategy.gpus_per_node,
        fsdp2=fsdp2_step(shape, strategy, lora.rank, lora.targets) if is_fsdp2(strategy) else None,
    )


@dataclass(frozen=True, slots=True)
class GradientTimeline:
    """When gradients appear in the backward pass (full fine-tuning; adapters' are negligible)."""

    head: int
    """The LM head's weight gradient, made first."""
    missing_at_first_layer: int
    """Not yet made while the first layer back-propagates: its own and the (untied) embedding's."""
    tied_extra: int
    """Tied embeddings: at the very end the head's and the embedding's gradients and their sum are
    alive together."""


def gradient_timeline(shape: ModelShape, method: Method, precision: Precision) -> GradientTimeline:
    if method != Method.FULL:
        return GradientTimeline(0, 0, 0)
    w = compute_bytes(precision)
    head = shape.vocab_size * shape.hidden_size * w
    embedding = 0 if shape.tie_word_embeddings else head
    return GradientTimeline(
        head=head,
        missing_at_first_layer=shape.layer_parameters * w + embedding,
        tied_extra=2 * head if shape.tie_word_embeddings else 0,
    )


def _moment_gradients(gradients: int, grads_persist: bool, timeline: GradientTimeline) -> tuple[int, int, int, int]:
    """Gradient bytes alive at each candidate moment of the backward pass (see forward_backward_moments)."""
    resident = gradients if grads_persist else 0
    at_first_layer = gradients if grads_persist else max(0, gradients - timeline.missing_at_first_layer)
    return resident, resident + timeline.head, at_first_layer, gradients + timeline.tied_extra


def forward_backward_moments(
    activations: ActivationEstimate, gradients: int, grads_persist: bool, timeline: GradientTimeline
) -> tuple[int, int]:
    """(gradient bytes, activation bytes) at the worst moment of the forward and backward passes.

    Gradients grow as the backward pass frees activations, so the candidates are: its start (loss
    buffers), the last layer's backward (the head's gradient exists), the first layer's backward
    (nearly every gradient exists), and its end (tied embeddings' extra gradient copies)."""
    at_loss, at_last_layer, at_first_layer, at_end = _moment_gradients(gradients, grads_persist, timeline)
    moments = [
        (at_loss, activations.loss_moment),
        (at_last_layer, activations.layer_moment),
        (at_first_layer, activations.first_layer_moment),
        (at_end, activations.backward_end),
    ]
    return max(moments, key=sum)


def _grads_persist(static: StaticMemory, accumulation_steps: int) -> bool:
    """Accumulating micro-batches keeps gradients alive across them; ZeRO-2/3 keep their partition (FSDP2
    sets its sharded gradients to None after each step)."""
    return accumulation_steps > 1 or (static.zero_stage >= 2 and static.fsdp2 is None)


def _fsdp2_binding_moment(
    static: StaticMemory, activations: ActivationEstimate, accumulation_steps: int
) -> Fsdp2Moment:
    assert static.fsdp2 is not None
    return max(static.fsdp2.moments(activations, _grads_persist(static, accumulation_steps)), key=lambda m: m.total)


def _overhead(static: StaticMemory, activations: ActivationEstimate) -> int:
    fragmentation = int(FRAGMENTATION * (activations.peak + static.states.gradients))
    return static.runtime + static.communication_buffers + fragmentation


def step_total(static: StaticMemory, activations: ActivationEstimate, accumulation_steps: int) -> int:
    """``peak_memory(...).per_gpu.total`` without building the breakdown (the search's inner loop, where
    this is most of the planner's time: tests/test_plan_phases.py keeps the two equal)."""
    states, a = static.states, activations
    if static.fsdp2 is not None:
        step = states.gradients + states.step_gradients
        moment = _fsdp2_binding_moment(static, a, accumulation_steps)
        return states.parameters + states.optimizer_states + _overhead(static, a) + max(moment.total, step)
    at_loss, at_last_layer, at_first_layer, at_end = _moment_gradients(
        states.gradients, _grads_persist(static, accumulation_steps), static.gradients_timeline
    )
    forward_backward = max(at_loss + a.loss_moment, at_last_layer + a.layer_moment,
                           at_first_layer + a.first_layer_moment, at_end + a.backward_end)  # fmt: skip
    step = states.gradients + states.step_gradients
    return states.parameters + states.optimizer_states + _overhead(static, a) + max(forward_backward, step)


def peak_memory(static: StaticMemory, activations: ActivationEstimate, accumulation_steps: int) -> PlanMemory:
    """Combine the static part with one micro-batch's activations into the step's two moments; the
    larger binds."""
    states = static.states
    fwd_bwd_params = states.parameters
    if static.fsdp2 is not None:
        moment = _fsdp2_binding_moment(static, activations, accumulation_steps)
        fwd_bwd_params, fwd_bwd_grads, acts = (
            states.parameters + moment.parameters,
            moment.gradients,
            moment.activations,
        )
    else:
        fwd_bwd_grads, acts = forward_backward_moments(
            activations, states.gradients, _grads_persist(static, accumulation_steps), static.gradients_timeline
        )
    overhead = _overhead(static, activations)
    phases = PlanPhases(
        forward_backward=PhaseMemory.of(fwd_bwd_params, fwd_bwd_grads, states.optimizer_states, acts, overhead),
        optimizer_step=PhaseMemory.of(
            states.parameters, states.gradients + states.step_gradients, states.optimizer_states, 0, overhead
        ),
    )
    binding = (
        StepPhase.FORWARD_BACKWARD
        if phases.forward_backward.total >= phases.optimizer_step.total
        else StepPhase.OPTIMIZER_STEP
    )
    bound = phases.at(binding)
    resident = bound.parameters + states.optimizer_states + static.communication_buffers
    per_gpu = PerGPUMemory(
        parameters=bound.parameters,
        gradients=bound.gradients,
        optimizer_states=states.optimizer_states,
        activations=acts,  # the forward/backward's, also when the optimizer step binds
        overhead=overhead,
        peak_allocated_bytes=resident + bound.gradients + bound.activations,
        total=bound.total,
    )
    return PlanMemory(
        per_gpu=per_gpu,
        per_node=PerNodeMemory(
            cpu=static.cpu_per_node + static.ranks_per_node * activations.host_bytes, nvme=static.nvme_per_node
        ),  # fmt: skip
        phases=phases,
        binding=binding,
    )
