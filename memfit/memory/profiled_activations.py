"""Activation memory of a model planned from its profile: the traced terms, composed over the model's layers.

The profile (``memfit.profile.ActivationProfile``) holds, per decoder-layer type, what one layer saves for its
backward and the most its own backward adds, traced on one packed 16-bit row for full fine-tuning and for LoRA
(``all-linear`` with dropout: the most any target set keeps). They compose as the formulas of
:mod:`memfit.memory.activations` do, at the same moments:

* rows: every term but its constant grows with the micro-batch (the constant is what the traces show no token
  count changes, such as rotary tables);
* without checkpointing, every layer keeps what it saved: at the loss the terms outside the layers add up
  with all of them; inside a layer's backward the loss buffers are gone and that layer's backward adds its peak;
* with checkpointing each layer keeps only its input (``rows x tokens x hidden`` in 16 bits), and the layer
  being back-propagated is recomputed whole beside its backward; the packed rows' attention mask (one bool, or
  for eager attention 16-bit, ``rows x tokens x tokens``) stays through the backward as every recomputation
  reads it.

QLoRA is planned with the LoRA terms: bitsandbytes' dequantized weight of the matmul in flight is not traced.
"""

from __future__ import annotations

from memfit.api.vocabulary import Attention, Method
from memfit.memory.activations import ActivationEstimate, ActivationSetup, estimate_activations
from memfit.model_shape import ModelShape
from memfit.planned_model import PlannedModel
from memfit.profile import ActivationTerm
from memfit.profiled_model import ProfiledModel

BF16 = 2


def _rows(term: ActivationTerm, tokens: int, rows: int) -> int:
    """The term for ``rows`` rows of ``tokens`` tokens (traced on one row)."""
    constant = round(term.constant) if term.exact else 0
    return rows * (term.bytes(tokens) - constant) + constant


def profiled_activations(model: ProfiledModel, setup: ActivationSetup) -> ActivationEstimate:
    terms = model.activations.full if setup.method == Method.FULL else model.activations.lora
    assert terms is not None  # the planner plans no LoRA where the profile says it cannot train
    rows, tokens = setup.micro_batch_size, setup.sequence_length
    kinds = model.profile.layer_types
    distinct = dict.fromkeys(kinds)
    saved = {kind: _rows(terms.layer(kind).saved, tokens, rows) for kind in distinct}
    peak = {kind: _rows(terms.layer(kind).backward_peak, tokens, rows) for kind in distinct}
    outside = _rows(terms.outside_layers, tokens, rows)
    between = rows * tokens * model.hidden_size * BF16
    one_layer = max(saved[kind] + peak[kind] for kind in distinct)
    layers = len(kinds)
    if setup.gradient_checkpointing:
        mask = rows * tokens * tokens * (BF16 if setup.attention == Attention.EAGER else 1)
        kept = layers * between
        loss_moment = kept + outside
        layer_moment = kept + one_layer + mask
        first_layer_moment = between + one_layer + mask
    else:
        kept = sum(saved[kind] for kind in kinds)
        loss_moment = kept + outside
        layer_moment = kept + max(peak.values())
        first_layer_moment = one_layer
    return ActivationEstimate(
        saved_per_layer=max(saved.values()),
        kept_between_layers=between,
        loss_moment=loss_moment,
        layer_moment=layer_moment,
        first_layer_moment=first_layer_moment,
        backward_end=between,
        peak=max(loss_moment, layer_moment),
    )


def model_activations(model: PlannedModel, setup: ActivationSetup) -> ActivationEstimate:
    """The activations of one micro-batch, from the model's traced terms or its family's formulas."""
    if isinstance(model, ProfiledModel):
        return profiled_activations(model, setup)
    assert isinstance(model, ModelShape)
    return estimate_activations(model, setup)
