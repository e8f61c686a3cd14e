"""The memory-saving techniques the planner can add to a plan, one descriptor each.

The search, ``Strategy.summary()`` and the "what it bought" text iterate over :data:`TECHNIQUES`; where a
technique is allowed is said by the rule table (:mod:`memfit.api.knobs`), so a new technique is a
descriptor here, its knob (``Knobs``, ``Strategy``, ``StrategySpec``), its rules, its memory and throughput
terms, and its trainer module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Technique:
    knob: str
    """Its field in ``Knobs``, ``Strategy`` and ``StrategySpec`` (a bool: on or off)."""
    name: str
    """In what a plan's techniques bought it, e.g. ``chunked loss: micro-batch 4 (2 without)``."""
    token: str
    """In ``Strategy.summary()``."""
    cost: int
    """Rank of its speed cost (0: none): the search tries cheaper combinations first."""
    may_hold_more: bool = False
    """Whether it can hold more memory than without it on some jobs (its own buffers outweigh what it saves):
    the search then does not bound what the techniques can fit by all of them together."""


CHUNKED_LOSS = Technique("chunked_loss", "chunked loss", "chunked-ce", cost=1)
"""The LM head and the cross-entropy chunk by chunk, recomputed in backward: the logits never exist whole."""
ACTIVATION_OFFLOADING = Technique("activation_offloading", "activation offloading", "act->cpu", cost=2)
"""Checkpointed layers' saved inputs wait in pinned host memory (PCIe copies)."""
OPTIMIZER_IN_BACKWARD = Technique("optimizer_in_backward", "optimizer step in backward", "opt-in-bwd", cost=0)
"""Each parameter steps as its gradient is reduced (the same work moved into the backward pass)."""

TILED_MLP = Technique("tiled_mlp", "tiled MLP", "tiled-mlp", cost=2, may_hold_more=True)
"""Each dense MLP runs tile by tile along the sequence, recomputed in backward (one more MLP forward per token):
its intermediate-sized activations exist for one tile at a time, at the price of a whole-sequence input gradient
and a tile's buffers (more than it saves on short sequences)."""

TECHNIQUES: tuple[Technique, ...] = (CHUNKED_LOSS, ACTIVATION_OFFLOADING, OPTIMIZER_IN_BACKWARD, TILED_MLP)
"""In the order a summary and a description name them."""
