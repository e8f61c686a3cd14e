"""The strategy knobs that decide a plan's static memory, as a record of their own, and what trains on top of
the model (:class:`Adapters`, :class:`LoraSettings`).

The planner caches static memory per combination of knobs; keyed by this record, the cache cannot serve a
strategy the static memory of another that differs in a knob the computation reads, as long as that
computation reads the record and not the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from memfit.api.finetunejob import LoraSpec
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Engine, MasterWeights, Offload, Optimizer, PlannedMethod, PlannedPrecision


@dataclass(frozen=True, slots=True)
class StaticSetup:
    """Exactly the knobs of a :class:`Strategy` that static memory (model states, communication buffers,
    host memory, the engine's step buffers) reads: not the micro-batch, accumulation or activation knobs."""

    engine: Engine
    method: PlannedMethod
    nodes: int
    gpus_per_node: int
    zero_stage: int
    offload_optimizer: Offload
    offload_parameters: Offload
    precision: PlannedPrecision
    master_weights: MasterWeights
    optimizer: Optimizer
    optimizer_in_backward: bool
    chunked_loss: bool
    """Read by the fsdp2 engine's forward-loss moment (:class:`memfit.memory.engines.fsdp2.Fsdp2Step`)."""
    tiled_mlp: bool
    """Read by the deepspeed engine's gradient timeline: a tiled MLP makes its weights' gradients early."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def of(cls, strategy: Strategy) -> StaticSetup:
        s = strategy  # positional, in the fields' order: an interned call with keywords costs four times more
        return _interned(
            s.engine,
            s.method,
            s.nodes,
            s.gpus_per_node,
            s.zero_stage,
            s.offload_optimizer,
            s.offload_parameters,
            s.precision,
            s.master_weights,
            s.optimizer,
            s.optimizer_in_backward,
            s.chunked_loss,
            s.tiled_mlp,
        )


_interned = lru_cache(maxsize=4096)(StaticSetup)
"""One record per distinct setup: a dictionary keyed by records then finds it by identity, without comparing
field by field (the planner looks static memory up for every candidate it tries)."""


@dataclass(frozen=True, slots=True)
class Adapters:
    """The LoRA adapters trained on top of the model (LoRA and QLoRA; full fine-tuning reads neither field):
    what the model states and the engines' buffers read of the job's ``lora`` section. Hashable, so that the
    memory model's caches take it as one argument."""

    rank: int
    targets: tuple[str, ...]
    """Target modules as the job names them (``all-linear`` or module names), unresolved."""


NO_ADAPTERS = Adapters(0, ())
"""For full fine-tuning, which trains the model's own parameters."""


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The job's ``lora`` section as the memory model reads it: the adapters, and whether dropout (which
    keeps a mask and a dropped copy of each adapter input for the backward) is on."""

    adapters: Adapters
    dropout: bool

    @classmethod
    def of(cls, spec: LoraSpec, dropout: float) -> LoraSettings:
        """``dropout``: the one the trainer applies (``memfit.planned_model.lora_dropout``)."""
        return cls(Adapters(spec.rank, tuple(spec.target_modules)), dropout > 0)
