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

What differs between training engines (model states, communication buffers, host loading, the moments of
the forward/backward) each engine answers for itself (:mod:`memfit.memory.engines`): this module asks the
strategy's engine and never branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from memfit.api.plan import PerGPUMemory, PerNodeMemory, PhaseMemory, PlanMemory, PlanPhases, Strategy
from memfit.api.vocabulary import Method, StepPhase
from memfit.memory.activations import ActivationEstimate, ActivationSetup
from memfit.memory.engine import ForwardBackward
from memfit.memory.engines import ENGINE_MEMORY
from memfit.memory.overhead import FRAGMENTATION, runtime_bytes
from memfit.memory.setup import Adapters, LoraSettings, StaticSetup
from memfit.memory.sizes import compute_bytes
from memfit.memory.states import ModelStates, trainable_split
from memfit.planned_model import PlannedModel
from memfit.units import GIB

HOST_BYTES_PER_RANK = 3 * GIB
"""CPU memory of one trainer process besides offloaded states: Python, torch, CUDA host state, data
loading workers."""


_activation_record = lru_cache(maxsize=4096)(ActivationSetup)
"""One record per distinct setup: a dictionary keyed by records then finds it by identity, without comparing
field by field (the planner looks activations up for every micro-batch it tries)."""


@lru_cache(maxsize=64)
def _lora_targets(shape: PlannedModel, targets: tuple[str, ...]) -> frozenset[str]:
    """``shape.resolve_lora_targets``, once per search rather than once per micro-batch tried."""
    return shape.resolve_lora_targets(targets)


def activation_setup(
    shape: PlannedModel,
    strategy: Strategy,
    sequence_length: int,
    lora: LoraSettings,
    micro_batch_size: int | None = None,
) -> ActivationSetup:
    """The activation knobs of ``strategy``, with another micro-batch if given (the search tries several
    micro-batches per strategy, and a record is cheaper to build than a strategy)."""
    with_adapters = strategy.method != Method.FULL
    # Positional, in the fields' order: an interned call with keywords costs four times more.
    return _activation_record(
        strategy.method,
        strategy.precision,
        strategy.gradient_checkpointing,
        micro_batch_size or strategy.micro_batch_size,
        sequence_length,
        strategy.attention,
        lora.adapters.rank if with_adapters else 0,
        _lora_targets(shape, lora.adapters.targets) if with_adapters else frozenset(),
        lora.dropout,
        compute_bytes(strategy.precision),  # adapter_bytes: the trainer casts the adapters to it (model.py)
        strategy.chunked_loss,
        strategy.activation_offloading,
        True,  # masked_batches: packed batches, or with `packing: false` the worst case: one with padding
        strategy.sequence_parallel,  # sequence_length stays the whole sequence; each rank holds 1/n of it
        strategy.tiled_mlp,
    )


def model_states(shape: PlannedModel, strategy: Strategy, adapters: Adapters) -> ModelStates:
    """Weights, gradients and optimizer states of one rank for ``strategy``, on its engine."""
    return ENGINE_MEMORY[strategy.engine].model_states(shape, StaticSetup.of(strategy), adapters)


def loaded_on_host(shape: PlannedModel, setup: StaticSetup) -> int:
    """Bytes one rank holds in host memory while it builds the model, before the engine places it."""
    return ENGINE_MEMORY[setup.engine].loaded_on_host(shape, setup)


def host_memory_per_node(shape: PlannedModel, setup: StaticSetup, states: ModelStates) -> tuple[int, int]:
    """(CPU, NVMe) bytes of one node: its ranks' offloaded states, or loading the model, if larger."""
    ranks = setup.gpus_per_node
    steady = ranks * (states.cpu_per_rank + HOST_BYTES_PER_RANK)
    loaded = loaded_on_host(shape, setup)
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
    ranks_per_node: int
    """Trainer processes (GPUs) per node, each holding its own offloaded activations."""
    gradients_persist: bool
    """Gradients stay alive from step to step without accumulation (the engine keeps them)."""
    forward_backward: ForwardBackward
    """The engine's forward and backward passes, which one micro-batch's activations complete."""

    @property
    def floor(self) -> int:
        """GPU bytes before any activation: no micro-batch fits when this does not."""
        return self.states.parameters + self.states.optimizer_states + self.communication_buffers + self.runtime


def static_memory(shape: PlannedModel, setup: StaticSetup, lora: LoraSettings) -> StaticMemory:
    engine, adapters = ENGINE_MEMORY[setup.engine], lora.adapters
    states = engine.model_states(shape, setup, adapters)
    trainable = trainable_split(shape, setup.method, adapters).trainable
    cpu, nvme = host_memory_per_node(shape, setup, states)
    return StaticMemory(
        states=states,
        trainable=trainable,
        communication_buffers=engine.communication_buffers(shape, setup, trainable),
        runtime=runtime_bytes(setup),
        cpu_per_node=cpu,
        nvme_per_node=nvme,
        ranks_per_node=setup.gpus_per_node,
        gradients_persist=engine.gradients_persist(setup),
        forward_backward=engine.forward_backward(shape, setup, adapters, states),
    )


def _grads_persist(static: StaticMemory, accumulation_steps: int) -> bool:
    """Accumulating micro-batches keeps gradients alive across them; some engines keep them anyway."""
    return accumulation_steps > 1 or static.gradients_persist


def _overhead(static: StaticMemory, activations: ActivationEstimate) -> int:
    fragmentation = int(FRAGMENTATION * (activations.peak + static.states.gradients))
    return static.runtime + static.communication_buffers + fragmentation


def step_total(static: StaticMemory, activations: ActivationEstimate, accumulation_steps: int) -> int:
    """``peak_memory(...).per_gpu.total`` without building the breakdown (the search's inner loop, where
    this is most of the planner's time: tests/test_plan_phases.py keeps the two equal)."""
    states, a = static.states, activations
    forward_backward = static.forward_backward.binding_total(a, _grads_persist(static, accumulation_steps))
    step = states.gradients + states.step_gradients
    return states.parameters + states.optimizer_states + _overhead(static, a) + max(forward_backward, step)


def peak_memory(static: StaticMemory, activations: ActivationEstimate, accumulation_steps: int) -> PlanMemory:
    """Combine the static part with one micro-batch's activations into the step's two moments; the
    larger binds."""
    states = static.states
    moment = static.forward_backward.binding(activations, _grads_persist(static, accumulation_steps))
    fwd_bwd_params, fwd_bwd_grads, acts = states.parameters + moment.parameters, moment.gradients, moment.activations
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
        activation_peak=activations.peak,
    )
    return PlanMemory(
        per_gpu=per_gpu,
        per_node=PerNodeMemory(
            cpu=static.cpu_per_node + static.ranks_per_node * activations.host_bytes, nvme=static.nvme_per_node
        ),  # fmt: skip
        phases=phases,
        binding=binding,
    )
