"""Per-GPU and per-node memory of one strategy: model states, activations and overhead together.

A training step has two peaks and the GPU must hold the larger:

* forward/backward: weights + optimizer states + activations, with gradients growing as activations
  are freed layer by layer (both are linear in the layers done, so the peak is at one end: all
  activations, or all gradients). With gradient accumulation the gradients of earlier micro-batches
  are alive throughout.
* optimizer step: weights + states + gradients + the fp32 gradient partition the optimizer reads.

The reported breakdown is the composition of memory at the winning peak, so its parts add up.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.api.plan import PerGPUMemory, PerNodeMemory, PlanMemory, PlanStrategy
from memfit.memory.activations import ActivationEstimate, ActivationSetup, estimate_activations
from memfit.memory.overhead import overhead
from memfit.memory.states import ModelStates, model_states, trainable_split
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


def activation_setup(shape: ModelShape, strategy: PlanStrategy, sequence_length: int, lora: LoraSettings) -> ActivationSetup:
    targets = shape.resolve_lora_targets(lora.targets) if strategy.method != "full" else frozenset()
    return ActivationSetup(
        method=strategy.method,
        precision=strategy.precision,
        gradient_checkpointing=strategy.gradient_checkpointing,
        micro_batch_size=strategy.micro_batch_size,
        sequence_length=sequence_length,
        attention=strategy.attention,
        lora_rank=lora.rank if strategy.method != "full" else 0,
        lora_targets=targets,
        lora_dropout=lora.dropout,
    )


def host_memory_per_node(shape: ModelShape, strategy: PlanStrategy, states: ModelStates) -> tuple[int, int]:
    """(CPU, NVMe) bytes of one node: its ranks' offloaded states, or loading the model, if larger.

    Every rank loads the 16-bit checkpoint into CPU memory before DeepSpeed moves or partitions it
    (ZeRO-3 builds the model already partitioned, so it skips that)."""
    ranks = strategy.gpus_per_node
    steady = ranks * (states.cpu_per_rank + HOST_BYTES_PER_RANK)
    loading = 0 if strategy.zero_stage == 3 else ranks * (2 * shape.parameter_count + HOST_BYTES_PER_RANK)
    return max(steady, loading), ranks * states.nvme_per_rank


def estimate_memory(
    shape: ModelShape,
    strategy: PlanStrategy,
    sequence_length: int,
    lora: LoraSettings,
    states: ModelStates | None = None,
    activations: ActivationEstimate | None = None,
) -> PlanMemory:
    """Memory of ``strategy``. ``states``/``activations`` may be passed in when the caller cached them."""
    if states is None:
        states = model_states(shape, strategy, lora.rank, lora.targets)
    if activations is None:
        activations = estimate_activations(shape, activation_setup(shape, strategy, sequence_length, lora))
    trainable = trainable_split(shape, strategy.method, lora.rank, lora.targets).trainable
    runtime = overhead(shape, strategy, trainable, activations.peak + states.gradients)

    grads_persist = strategy.gradient_accumulation_steps > 1 or strategy.zero_stage >= 2
    base = states.parameters + states.optimizer_states + runtime.communication_buffers
    if grads_persist:
        fwd_bwd_grads, fwd_bwd_acts = states.gradients, activations.peak
    elif activations.peak >= states.gradients:
        fwd_bwd_grads, fwd_bwd_acts = 0, activations.peak
    else:
        fwd_bwd_grads, fwd_bwd_acts = states.gradients, 0
    fwd_bwd = base + fwd_bwd_grads + fwd_bwd_acts
    step = base + states.gradients + states.step_gradients
    if fwd_bwd >= step:
        gradients, acts, peak = fwd_bwd_grads, fwd_bwd_acts, fwd_bwd
    else:
        gradients, acts, peak = states.gradients + states.step_gradients, 0, step

    cpu, nvme = host_memory_per_node(shape, strategy, states)
    return PlanMemory.model_construct(
        per_gpu=PerGPUMemory.model_construct(
            parameters=states.parameters,
            gradients=gradients,
            optimizer_states=states.optimizer_states,
            activations=acts,
            overhead=runtime.total,
            peak_allocated_bytes=peak,
            total=states.parameters + gradients + states.optimizer_states + acts + runtime.total,
        ),
        per_node=PerNodeMemory.model_construct(cpu=cpu, nvme=nvme),
    )
