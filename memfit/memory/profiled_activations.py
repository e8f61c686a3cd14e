"""Activation memory of a model planned from its profile: the traced terms, composed over the model's layers.

The profile (``memfit.profile.ActivationProfile``) holds, per decoder-layer type, what one layer saves for its
backward and the most its own backward adds, traced on one packed 16-bit row for full fine-tuning and for LoRA
(``all-linear`` with dropout: the most any target set keeps). They compose as the formulas of
:mod:`memfit.memory.activations` do, at the same moments:

* rows: every term but its constant grows with the micro-batch (the constant is what the traces show no token
  count changes, such as rotary tables);
* every layer keeps what it saved: at the loss the terms outside the layers, and what the loss's and the LM
  head's backward add (with the model's own loss or the chunked loss, each traced), stand on all of them;
  inside a layer's backward the loss buffers are gone, and what stays outside the layers (masks, rotary
  tables, the arriving gradient) and that layer's backward peak add (``tests/test_activation_profile.py``
  holds the composed peak within 5% of a trace of the whole model);
* with checkpointing the same, with the terms traced checkpointed: a layer then keeps its output (the next
  one's input), and its backward peak holds its recomputation;
* with activation offloading on top, the layers' inputs (``hidden_size`` values per token each) leave the GPU
  and come back on the trainer's schedule, the one the family formulas count
  (:func:`memfit.memory.activations.offloaded_inputs`): the rest of what each layer saved stays.

QLoRA is planned with the LoRA terms: bitsandbytes' dequantized weight of the matmul in flight is not traced.
"""

from __future__ import annotations

from memfit.api.vocabulary import Method
from memfit.memory.activations import (
    ActivationEstimate,
    ActivationSetup,
    estimate_activations,
    offloaded_inputs,
    offloaded_layers,
    pinned_host_bytes,
)
from memfit.memory.sizes import BF16
from memfit.model_shape import ModelShape
from memfit.planned_model import PlannedModel
from memfit.profile import ActivationTerm, ActivationTerms
from memfit.profiled_model import ProfiledModel


def _rows(term: ActivationTerm, tokens: int, rows: int) -> int:
    """The term for ``rows`` rows of ``tokens`` tokens (traced on one row). A term no form reproduces is read
    at the micro-batch's tokens together: the only ones the traces leave so are the loss's, which flattens the
    micro-batch (for a term of one row's attention this over-counts, never under)."""
    if not term.exact:
        return term.bytes(rows * tokens)
    constant = round(term.constant)
    return rows * (term.bytes(tokens) - constant) + constant


def profiled_activations(model: ProfiledModel, setup: ActivationSetup) -> ActivationEstimate:
    activations = model.activations
    terms: ActivationTerms | None
    if setup.method == Method.FULL:
        terms = activations.full_checkpointed if setup.gradient_checkpointing else activations.full
    else:
        terms = activations.lora_checkpointed if setup.gradient_checkpointing else activations.lora
    assert terms is not None  # the planner plans no LoRA where the profile says it cannot train
    return composed(terms, model.profile.layer_types, model.hidden_size, setup)


def composed(
    terms: ActivationTerms, kinds: tuple[str, ...], hidden_size: int, setup: ActivationSetup
) -> ActivationEstimate:
    """The moments of one micro-batch through decoder layers of these types (module docstring)."""
    rows, tokens = setup.micro_batch_size, setup.sequence_length
    distinct = dict.fromkeys(kinds)
    saved = {kind: _rows(terms.layer(kind).saved, tokens, rows) for kind in distinct}
    peak = {kind: _rows(terms.layer(kind).backward_peak, tokens, rows) for kind in distinct}
    between = rows * tokens * hidden_size * BF16
    offloading = setup.gradient_checkpointing and setup.activation_offloading
    moved = offloaded_layers(setup, len(kinds)) if offloading else 0
    kept = sum(saved[kind] for kind in kinds) - moved * between
    outside = terms.outside_terms(setup.chunked_loss)
    loss_moment = kept + _rows(outside.outside_layers, tokens, rows) + _rows(outside.loss_backward, tokens, rows)
    during = _rows(outside.outside_backward, tokens, rows)
    back = offloaded_inputs(setup, len(kinds), between)[1:] if offloading else (0, 0)
    layer_moment = kept + during + max(peak.values()) + sum(back)
    if not offloading:
        first_layer_moment = during + max(saved[kind] + peak[kind] for kind in distinct)
    elif setup.method == Method.FULL:
        # The first layer's input came back for its recomputation and is gone by its backward's worst moment.
        first_layer_moment = during + max(saved[kind] - between + peak[kind] for kind in distinct)
    else:
        # LoRA's gradients are counted whole: a middle layer's backward, beside the first layer's kept input.
        first_layer_moment = during + max(saved[kind] + peak[kind] for kind in distinct) + sum(back)
    return ActivationEstimate(
        saved_per_layer=max(saved.values()),
        kept_between_layers=between,
        loss_moment=loss_moment,
        layer_moment=layer_moment,
        first_layer_moment=first_layer_moment,
        backward_end=between,
        peak=max(loss_moment, layer_moment),
        host_bytes=moved * pinned_host_bytes(between),
    )


def model_activations(model: PlannedModel, setup: ActivationSetup) -> ActivationEstimate:
    """The activations of one micro-batch, from the model's traced terms or its family's formulas."""
    if isinstance(model, ProfiledModel):
        return profiled_activations(model, setup)
    assert isinstance(model, ModelShape)
    return estimate_activations(model, setup)
