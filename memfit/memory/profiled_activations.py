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
  (:func:`memfit.memory.activations.offloaded_inputs`): the rest of what each layer saved stays;
* without a mask (flash attention, or SDPA on batches that need none) the terms traced on an unmasked row;
  a version-4 profile has none and plans only its traced kernel on packed rows;
* with tiled MLPs, each layer's terms change by what tiling changed on the unmasked rows (the mask's bytes and
  the MLP's are apart: a packed row's layer changes as much);
* with sequence parallelism over ``P`` ranks (Ulysses), every per-token part of a term holds the rank's
  ``ceil(s/P)`` tokens of each row, every part in ``s²`` (the masks) the whole sequence's, and each attention
  layer keeps one more query-sized tensor of the rank's tokens (the kernel's output in the gathered layout and
  ``o_proj``'s re-partitioned input, ``t·q·w``, trace-confirmed in ``docs/design/sequence-parallel.md`` §0.5):
  saved by the layer, or under checkpointing held by its recomputation.

QLoRA is planned with the LoRA terms: bitsandbytes' dequantized weight of the matmul in flight is not traced.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.api.vocabulary import Attention, Method
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
from memfit.profile import ActivationTerm, ActivationTerms, LayerActivations
from memfit.profiled_model import LINEAR_ATTENTION, ProfiledModel


@dataclass(frozen=True)
class Tiling:
    """What tiled MLPs change in a layer: its terms on unmasked rows with them and without them."""

    tiled: ActivationTerms
    untiled: ActivationTerms

    def change(self, kind: str, setup: ActivationSetup) -> tuple[int, int]:
        """Bytes tiling adds to (saved, backward peak) of a layer of this type (negative: it spares them)."""
        tiled, untiled = self.tiled.layer(kind), self.untiled.layer(kind)
        return (
            _rows(tiled.saved, setup) - _rows(untiled.saved, setup),
            _rows(tiled.backward_peak, setup) - _rows(untiled.backward_peak, setup),
        )


def _rows(term: ActivationTerm, setup: ActivationSetup) -> int:
    """The term for the micro-batch's rows (traced on one row) on one rank.

    A term no form reproduces is read at the rank's tokens of the micro-batch together: the only ones the traces
    leave so are the loss's, which flattens the micro-batch (for a term of one row's attention this over-counts,
    never under). Under sequence parallelism a solved form's per-token part counts the rank's tokens and its
    quadratic part the whole sequence; where the rank's tokens are below where the form holds, the whole sequence
    is counted (never under)."""
    rows, sequence, local = setup.micro_batch_size, setup.sequence_length, setup.row_tokens
    if not term.exact:
        return term.bytes(rows * local)
    constant = round(term.constant)
    if local == sequence or local < term.valid_from:
        return rows * (term.bytes(sequence) - constant) + constant
    quadratic = sequence * min(sequence, term.window or sequence)
    return rows * round(term.per_token * local + term.per_token_squared * quadratic) + constant


def profiled_activations(model: ProfiledModel, setup: ActivationSetup) -> ActivationEstimate:
    activations = model.activations
    lora, checkpointed = setup.method != Method.FULL, setup.gradient_checkpointing
    unmasked = activations.unmasked if setup.attention == Attention.FLASH or not setup.masked_batches else None
    terms = activations.terms(lora, checkpointed, unmasked)
    assert terms is not None  # the planner plans no LoRA where the profile says it cannot train
    tiling = None
    if setup.tiled_mlp:
        # The planner plans no tiled MLP where it was not traced (ProfiledModel.untraced_techniques).
        assert activations.tiled_mlp is not None and activations.unmasked is not None
        tiled = activations.terms(lora, checkpointed, activations.tiled_mlp)
        untiled = activations.terms(lora, checkpointed, activations.unmasked)
        assert tiled is not None and untiled is not None
        tiling = Tiling(tiled, untiled)
    profile = model.profile
    heads = AttentionHeads(profile.num_attention_heads, profile.num_key_value_heads, profile.head_dim)
    return composed(terms, profile.layer_types, model.hidden_size, heads, setup, tiling)


@dataclass(frozen=True)
class AttentionHeads:
    """The full-attention layers' heads, which decide what sequence parallelism adds to a layer."""

    query: int
    key_value: int
    head_dim: int

    def split_extra(self, setup: ActivationSetup) -> int:
        """What one attention layer holds more under sequence parallelism, per rank: the attention output's
        re-partitioned copy (t x q), and, with more ranks than key/value heads, the keys and values Ulysses
        replicates so that every rank gets one (``kv_replication_factor``)."""
        tokens = setup.tokens
        replicas = max(1, setup.sequence_parallel // self.key_value)
        widths = self.query + 2 * (replicas - 1) * self.key_value
        return tokens * widths * self.head_dim * setup.element_bytes


def _layer(
    terms: LayerActivations, setup: ActivationSetup, heads: AttentionHeads, tiling: Tiling | None
) -> tuple[int, int]:
    """(saved, backward peak) of one layer of this type on one rank (module docstring)."""
    saved, peak = _rows(terms.saved, setup), _rows(terms.backward_peak, setup)
    if tiling is not None:
        saved_change, peak_change = tiling.change(terms.layer_type, setup)
        saved, peak = saved + saved_change, peak + peak_change
    if setup.sequence_parallel > 1 and terms.layer_type != LINEAR_ATTENTION:
        gathered = heads.split_extra(setup)
        if setup.gradient_checkpointing:
            peak += gathered
        else:
            saved += gathered
    return saved, peak


def composed(
    terms: ActivationTerms,
    kinds: tuple[str, ...],
    hidden_size: int,
    heads: AttentionHeads,
    setup: ActivationSetup,
    tiling: Tiling | None = None,
) -> ActivationEstimate:
    """The moments of one micro-batch through decoder layers of these types on one rank (module docstring)."""
    distinct = dict.fromkeys(kinds)
    layers = {kind: _layer(terms.layer(kind), setup, heads, tiling) for kind in distinct}
    saved = {kind: layers[kind][0] for kind in distinct}
    peak = {kind: layers[kind][1] for kind in distinct}
    between = setup.tokens * hidden_size * BF16
    offloading = setup.gradient_checkpointing and setup.activation_offloading
    moved = offloaded_layers(setup, len(kinds)) if offloading else 0
    kept = sum(saved[kind] for kind in kinds) - moved * between
    outside = terms.outside_terms(setup.chunked_loss)
    loss_moment = kept + _rows(outside.outside_layers, setup) + _rows(outside.loss_backward, setup)
    during = _rows(outside.outside_backward, setup)
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
