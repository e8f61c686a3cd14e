"""Whether a plan packs documents: the job's ``dataset.packing``, else packed wherever the model keeps packed
documents apart (a default decided like a knob, by the same rule that refuses a pinned ``true``)."""

from __future__ import annotations

from typing import Any

from memfit.api.knobs import Knobs, conflicts
from memfit.api.runtime import FLASH_LINEAR_ATTENTION, Runtime
from memfit.api.vocabulary import Attention


def _knobs(packing: bool, attention: Attention | None, facts: dict[str, Any], runtime: Runtime) -> Knobs:
    """Only what the packing rule reads: the rest undecided, so no other rule applies."""
    return Knobs(
        packing=packing,
        attention=attention,
        linear_attention=facts.get("linear_attention"),
        linear_attention_kernels=runtime.has(FLASH_LINEAR_ATTENTION),
    )


def planned_packing(pinned: bool | None, attention: Attention, facts: dict[str, Any], runtime: Runtime) -> bool:
    """The job's choice, else whether packing with ``attention`` keeps this model's documents apart."""
    if pinned is not None:
        return pinned
    return not conflicts(_knobs(True, attention, facts, runtime))


def pinned_packing_problem(
    pinned: bool | None, attention: Attention | None, facts: dict[str, Any], runtime: Runtime
) -> str | None:
    """Why a pinned ``dataset.packing: true`` cannot train this model with any plan (the trainer refuses it at
    start-up); None where it can, or where packing is not pinned on."""
    if not pinned:
        return None
    problems = conflicts(_knobs(True, attention, facts, runtime))
    return problems[0] if problems else None
