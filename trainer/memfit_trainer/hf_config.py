"""Turn a :class:`~memfit.model_shape.ModelShape` into a ``transformers`` config.

Used to build tiny random models for tests and examples (nothing is downloaded) and to trace the real
modules for calibrating the memory model.
"""

from __future__ import annotations

from typing import Any

from memfit.contract.model_match import config_fields
from memfit.model_shape import ModelShape


def transformers_config(shape: ModelShape, **overrides: Any) -> Any:
    """The ``PretrainedConfig`` of the family's ``transformers`` model with exactly this shape."""
    from transformers import AutoConfig

    kwargs = config_fields(shape)
    kwargs.update(overrides)
    return AutoConfig.for_model(shape.family.value, **kwargs)
