"""Turn a :class:`~memfit.model_shape.ModelShape` into a ``transformers`` config.

Used to build tiny random models for tests and examples (nothing is downloaded) and to trace the real
modules for calibrating the memory model.
"""

from __future__ import annotations

from typing import Any

from memfit.model_shape import ModelFamily, ModelShape


def transformers_config(shape: ModelShape, **overrides: Any) -> Any:
    """The ``PretrainedConfig`` of the family's ``transformers`` model with exactly this shape."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
    }
    if shape.family is not ModelFamily.PHI3:
        kwargs["head_dim"] = shape.dim_head
    if shape.family in (ModelFamily.LLAMA, ModelFamily.MISTRAL, ModelFamily.MIXTRAL):
        kwargs["attention_bias"] = shape.attention_bias
    if shape.family is ModelFamily.MIXTRAL:
        kwargs["num_local_experts"] = shape.num_experts
        kwargs["num_experts_per_tok"] = shape.experts_per_token
    kwargs.update(overrides)
    return AutoConfig.for_model(shape.family.value, **kwargs)
