"""What the sequence-parallel and tiled-MLP rules and speeds need to know about a model.

A profile states it (its heads, layer types and parameter tensors by role); typed sizes state heads and
modules, and their family says whether scores are soft-capped. Nothing here is guessed: what a description
does not say stays None, and the rules that read it skip.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from memfit import model_shape, profile
from memfit.model_shape import ModelFamily, ModelShape
from memfit.planned_model import PlannedModel
from memfit.profiled_model import LINEAR_ATTENTION, WINDOWED, ProfiledModel

SOFT_CAPPED = frozenset({ModelFamily.GEMMA2.value})
"""``model_type`` values whose attention soft-caps its scores (Gemma 2's ``attn_logit_softcapping``): inside
Ulysses' gathered attention only the flash kernel applies the cap."""


@lru_cache(maxsize=64)
def dense_mlp_parameters(model: PlannedModel) -> int:
    """Weights and biases of the dense MLPs of all layers (what the tiled MLP tiles; a mixture of experts'
    routed experts stay whole): one more forward through them per token is the tiled MLP's cost."""
    if isinstance(model, ProfiledModel):
        return sum(group.numel for group in model.profile.tensors if group.role == profile.Role.MLP)
    if isinstance(model, ModelShape):
        return model.num_layers * sum(module.parameters for module in model.linears_of(model_shape.Role.MLP))
    return 0


@lru_cache(maxsize=64)
def attention_heads(model: PlannedModel) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head width) of the full-attention layers; None where not stated."""
    if isinstance(model, ProfiledModel):
        return model.profile.num_attention_heads, model.profile.num_key_value_heads, model.profile.head_dim
    if isinstance(model, ModelShape):
        return model.num_attention_heads, model.num_key_value_heads, model.dim_head
    return None


@lru_cache(maxsize=64)
def model_facts(model: PlannedModel) -> dict[str, Any]:
    """The model-fact fields of ``Knobs`` for ``model`` (empty for a description that states none; shared by
    every caller: read it, do not change it)."""
    heads = attention_heads(model)
    if heads is None:
        return {}
    facts = {"attention_heads": heads[0], "kv_heads": heads[1], "dense_mlp": dense_mlp_parameters(model) > 0}
    if isinstance(model, ProfiledModel):
        kinds = set(model.profile.layer_types)
        return facts | {
            "linear_attention": LINEAR_ATTENTION in kinds,
            "windowed_attention": any(word in kind for kind in kinds for word in WINDOWED)
            or model.profile.model_type in SOFT_CAPPED,
        }
    assert isinstance(model, ModelShape)  # attention_heads states the heads of these two only
    return facts | {"linear_attention": False, "windowed_attention": model.family is ModelFamily.GEMMA2}
