"""The settings a job may leave at their defaults whose change alone can make it fit: where nothing fits, each is
planned with the other value and the advice names the ones that fit (planned, not presumed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.vocabulary import Optimizer


@dataclass(frozen=True, slots=True)
class DefaultChange:
    """One default and the value that may fit where it does not."""

    section: str
    """The spec's section (``training``...)."""
    field: str
    """The field's Python name in that section."""
    value: Any
    setting: str
    """How the job writes the change (``training.maxGradNorm: 0``)."""
    why: str
    """What the change buys, in a few words."""

    def applies(self, spec: FineTuneJobSpec) -> bool:
        """Whether the job has this setting at its default (the advice names a change, never the same value)."""
        section = getattr(spec, self.section)
        default = type(section).model_fields[self.field].default
        return bool(getattr(section, self.field) == default != self.value)

    def applied(self, spec: FineTuneJobSpec) -> FineTuneJobSpec:
        section = getattr(spec, self.section)
        return spec.model_copy(update={self.section: section.model_copy(update={self.field: self.value})})


DEFAULT_CHANGES: Final = (
    DefaultChange(
        "training",
        "max_grad_norm",
        0.0,
        "training.maxGradNorm: 0",
        "no gradient clipping, so each parameter can step in the backward pass and the gradients never all exist",
    ),
    DefaultChange(
        "training",
        "optimizer",
        Optimizer.ADAMW_8BIT,
        "training.optimizer: adamw8bit",
        "bitsandbytes' AdamW, its states in 8 bits",
    ),
)
