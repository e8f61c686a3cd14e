"""What the training engines differ in, for the memory model: one protocol that each engine implements
(:mod:`memfit.memory.engines`), so that the estimate combines their answers without asking which engine
it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from memfit.memory.activations import ActivationEstimate
from memfit.memory.setup import Adapters, StaticSetup
from memfit.memory.states import ModelStates
from memfit.planned_model import PlannedModel


@dataclass(frozen=True, slots=True)
class Moment:
    """What one GPU holds at one moment of the forward/backward beyond the resident model states (whose
    gradients an engine counts here, as many as exist at that moment)."""

    parameters: int
    """Gathered (unsharded) parameters and all-gather buffers, beyond the resident ones."""
    gradients: int
    """Gradients alive at the moment, with the engine's unsharded gradients and reduce buffers."""
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.activations


class ForwardBackward(Protocol):
    """An engine's forward and backward passes for one setup, before a micro-batch's activations are known
    (computed once per setup, asked once per micro-batch)."""

    def binding(self, activations: ActivationEstimate, grads_persist: bool) -> Moment:
        """The worst moment of the forward and backward passes with these activations; ``grads_persist``:
        gradients are alive from the start (accumulated, or a partition the engine keeps)."""
        ...

    def binding_total(self, activations: ActivationEstimate, grads_persist: bool) -> int:
        """``binding(...).total`` without building it (the planner's inner loop)."""
        ...


class EngineMemory(Protocol):
    """The memory facts that differ between training engines."""

    def model_states(self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters) -> ModelStates:
        """One rank's weights, gradients and optimizer states."""
        ...

    def communication_buffers(self, shape: PlannedModel, setup: StaticSetup, trainable: int) -> int:
        """GPU bytes the engine keeps for collective communication throughout the step."""
        ...

    def loaded_on_host(self, shape: PlannedModel, setup: StaticSetup) -> int:
        """Bytes one rank holds in host memory while it builds the model, before the engine places it."""
        ...

    def gradients_persist(self, setup: StaticSetup) -> bool:
        """Whether gradients stay alive from one step to the next without accumulation."""
        ...

    def forward_backward(
        self, shape: PlannedModel, setup: StaticSetup, adapters: Adapters, states: ModelStates
    ) -> ForwardBackward:
        """The forward and backward passes' buffers of ``setup``, whose model states are ``states``."""
        ...
