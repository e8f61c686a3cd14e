"""A model profile: what a model's own ``transformers`` code builds from its config.json, as plain data.

memfit's per-family formulas (``memfit.model_shape``) cover six families; the models people fine-tune now
(hybrid linear attention, sliding-window layers, per-layer embeddings, many fused experts) are outside
them. A profile is the alternative: the trainer package builds the model on the meta device and records
every parameter tensor by role and layer type, which tensors bitsandbytes would quantize and which modules
LoRA would wrap. The core never imports torch, so the profile is pure pydantic: the trainer fills it, the
core (CLI, later the planner) reads it, and its JSON is the contract between the two.

Sums over the inventory are exact: every parameter tensor of the model is in exactly one group, and the
profiler checks that the groups add up to ``sum(p.numel() for p in model.parameters())``.
"""

from __future__ import annotations

import hashlib
import json
import math
from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_VERSION = 5
"""Bumped when a field changes meaning; a reader refuses a profile of a version it cannot read (2: ``activations``;
3: attention widths, and activations traced for full fine-tuning and for LoRA on packed rows, with the loss's
backward, and checkpointed; 4: the terms outside the layers also traced with the chunked loss; 5: every setup
also traced on an unmasked row, plain and with tiled MLPs: ``ActivationProfile.unmasked`` and ``tiled_mlp``)."""
READABLE_VERSIONS = frozenset({4, PROFILE_VERSION})
"""Versions this memfit reads. A version-4 profile has no unmasked terms: it is planned as before, with its traced
kernel on packed rows only (SDPA's s² document mask), until it is traced again (``make profiles``)."""


class Role(StrEnum):
    """What a parameter tensor does, the granularity the memory model needs."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    FINAL_NORM = "final_norm"
    ATTENTION = "attention"
    MLP = "mlp"
    EXPERTS = "experts"
    ROUTER = "router"
    NORM = "norm"
    OTHER = "other"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorGroup(_Frozen):
    """Parameter tensors of one name and shape: one tensor outside the decoder layers, or one per layer listed.

    ``name`` writes the decoder layer's index as ``*`` (``model.layers.*.self_attn.q_proj.weight``), so a
    64-layer model needs a dozen groups, not 64 times as many entries.
    """

    name: str
    role: Role
    shape: tuple[int, ...]
    layer_type: str | None = None
    """The decoder layers' type (``full_attention``, ``sliding_attention``, ``linear_attention``...); None
    outside the decoder layers."""
    layers: tuple[int, ...] = ()
    """The decoder layers holding this tensor; empty outside them."""
    count: int = Field(ge=1)
    quantizable: bool = False
    """An ``nn.Linear`` weight bitsandbytes 4-bit replaces (fused 3-D expert tensors are not ``nn.Linear``)."""

    @model_validator(mode="after")
    def _count_matches_layers(self) -> Self:
        if self.count != max(1, len(self.layers)):
            raise ValueError(f"{self.name}: count {self.count} but {len(self.layers)} layers")
        return self

    @property
    def numel(self) -> int:
        """Parameters in all tensors of the group."""
        return math.prod(self.shape) * self.count


class Experts(_Frozen):
    """A mixture of experts: how many experts, how many each token uses, and which layers route."""

    num_experts: int = Field(ge=1)
    experts_per_token: int = Field(ge=1)
    layers: tuple[int, ...]


class LoraModules(_Frozen):
    """Modules of one name and shape that LoRA wraps, the layer index written as ``*`` (see TensorGroup)."""

    name: str
    parameter: str | None = None
    """The fused parameter peft wraps inside the module (``gate_up_proj`` of fused experts), None for a Linear."""
    layers: tuple[int, ...] = ()
    in_features: int
    out_features: int
    rank_multiple: int = Field(default=1, ge=1)
    """lora_A's rows per unit of the configured rank: 1 for a Linear; a fused expert parameter's experts times
    the projections fused in it (peft stacks the experts' adapters along the rank and doubles ``r`` for
    ``gate_up_proj``)."""

    def adapter_parameters(self, rank: int) -> int:
        """Parameters of the adapters (lora_A and lora_B) on these modules at LoRA rank ``rank``."""
        return rank * self.rank_multiple * (self.in_features + self.out_features) * max(1, len(self.layers))

    def names(self) -> list[str]:
        """The full module names, as ``named_modules()`` spells them."""
        if not self.layers:
            return [self.name]
        return [self.name.replace("*", str(layer), 1) for layer in self.layers]


class LoraResolution(_Frozen):
    """What peft's own matching makes of ``target_modules`` on this model (``all-linear`` or explicit names)."""

    target_modules: str | tuple[str, ...]
    modules: tuple[LoraModules, ...]

    def names(self) -> list[str]:
        return sorted(name for group in self.modules for name in group.names())

    def adapter_parameters(self, rank: int) -> int:
        """Trainable parameters peft creates for these targets at LoRA rank ``rank``."""
        return sum(group.adapter_parameters(rank) for group in self.modules)


class ActivationTerm(_Frozen):
    """Bytes as a function of ``T``, the tokens of one micro-batch row (batch 1), solved exactly from traces.

    ``bytes(T) = per_token·T + per_token_squared·T·min(T, window) + constant`` (no window: ``T·T``). The
    coefficients are the exact solution through three traced token counts, and ``exact`` says whether they
    then predicted every further traced count to the byte; where not, ``measured`` is the truth to use.
    """

    per_token: float
    per_token_squared: float
    constant: float
    window: int | None = None
    """Where the quadratic term stops growing (a sliding window), if the traces show it does."""
    valid_from: int = 0
    """The form holds from this token count up; below it, only the measured points are known (an SDPA model
    builds a sliding-window mask only once the sequence outgrows the window)."""
    measured: tuple[tuple[int, int], ...]
    """``(tokens, bytes)`` of every trace (the three solved for and the ones checked) where the form does not
    reproduce them all (not exact, or exact from ``valid_from`` up); empty where it does (it is them)."""
    exact: bool

    def bytes(self, tokens: int) -> int:
        """The term at ``tokens`` tokens: below ``valid_from``, the larger of the traced counts on either side
        (the form there is unknown; a traced count itself is exact). A term no form reproduces is read off its
        traced counts (:meth:`_traced`)."""
        if not self.exact:
            return self._traced(tokens)
        if tokens < self.valid_from:
            known = sorted(self.measured)
            below = [value for count, value in known if count <= tokens][-1:]
            above = [value for count, value in known if count >= tokens][:1]
            return max(below + above)
        quadratic = tokens * min(tokens, self.window or tokens)
        return round(self.per_token * tokens + self.per_token_squared * quadratic + self.constant)

    def _traced(self, tokens: int) -> int:
        """The traced counts joined by straight lines, the last one continued: such a term is the largest of
        several moments (the chunked loss's, each growing linearly once a chunk is full), so between two traced
        counts the line is at or above it, and past the last one its steepest moment is the one that grows. No
        count reads below the first traced one."""
        known = sorted(self.measured)
        if tokens <= known[0][0]:
            return known[0][1]
        for (low, low_bytes), (high, high_bytes) in zip(known, known[1:], strict=False):
            if tokens <= high:
                return round(low_bytes + (high_bytes - low_bytes) * (tokens - low) / (high - low))
        (before, before_bytes), (last, last_bytes) = known[-2:]
        slope = max(0.0, (last_bytes - before_bytes) / (last - before))
        return round(last_bytes + slope * (tokens - last))


class LayerActivations(_Frozen):
    """What one decoder layer of a type keeps for backward, and the extra its own backward needs at its worst."""

    layer_type: str
    attention: str
    """The ``attn_implementation`` traced."""
    saved: ActivationTerm
    """Alive at the end of the forward because of this layer (what autograd saved, and its output)."""
    backward_peak: ActivationTerm
    """Above what was alive when the layer's backward started, the most its backward adds at once
    (gradients of parameters not counted: they are model state)."""


class OutsideTerms(_Frozen):
    """What one traced setup keeps outside the decoder layers: the terms the loss's implementation changes."""

    outside_layers: ActivationTerm
    """Alive at the end of the forward outside the decoder layers: embedding output, masks, rotary tables,
    final norm, logits and loss."""
    loss_backward: ActivationTerm
    """Above what was alive when the forward ended, the most the backward adds before the decoder layers'
    backward begins: the loss's, the LM head's and the final norm's gradients."""
    outside_backward: ActivationTerm
    """Alive when the decoder layers' backward begins beyond what they saved: the masks, the rotary tables, the
    embedding's output and the gradient arriving at the last layer, which every layer's backward stands on."""


class ActivationTerms(_Frozen):
    """The activation terms of one traced training setup."""

    outside: OutsideTerms
    """With the model's own loss (the full logits)."""
    chunked_loss: OutsideTerms | None
    """With the trainer's chunked loss (``memfit_trainer.chunked_loss``: the LM head inside the loss, one chunk
    of logits at a time); the decoder layers keep the same. None where a step with it failed."""
    layers: tuple[LayerActivations, ...]
    """One per layer type."""

    def layer(self, layer_type: str) -> LayerActivations:
        """The terms of a layer type."""
        return next(entry for entry in self.layers if entry.layer_type == layer_type)

    def outside_terms(self, chunked_loss: bool) -> OutsideTerms:
        """The terms outside the layers with the model's own loss or the chunked one (which must be traced)."""
        if not chunked_loss:
            return self.outside
        assert self.chunked_loss is not None  # the planner plans no chunked loss where it was not traced
        return self.chunked_loss

    def forward_end_bytes(self, layer_types: tuple[str, ...], tokens: int) -> int:
        """Activations alive when the forward of a model with these decoder layers ends, at ``tokens``."""
        saved = sum(self.layer(kind).saved.bytes(tokens) for kind in layer_types)
        return self.outside.outside_layers.bytes(tokens) + saved


class TracedSetups(_Frozen):
    """The four setups of :class:`ActivationProfile` traced on other rows or with another technique."""

    full: ActivationTerms
    full_checkpointed: ActivationTerms
    lora: ActivationTerms | None
    lora_checkpointed: ActivationTerms | None


class ActivationProfile(_Frozen):
    """Activation terms traced from a truncated copy of the model (one layer of each type, real widths): a
    training micro-batch of one row in bf16, forward and backward, under FakeTensorMode with torch's MemTracker
    (``memfit_trainer.activation_profile``), without and with gradient checkpointing (a checkpointed layer keeps
    its input, and its recomputation is part of its backward peak). The row holds two packed documents
    (restarting ``position_ids``, as the trainer packs), so the attention mask ``transformers`` builds for packed
    rows is traced with the rest; every setup is traced again on a row that needs no mask (``unmasked``), and
    there with tiled MLPs (``tiled_mlp``)."""

    dtype: str
    micro_batch: int = Field(ge=1)
    attention: str
    full: ActivationTerms
    """Full fine-tuning: every parameter trained."""
    full_checkpointed: ActivationTerms
    """Full fine-tuning, the decoder layers checkpointed as the trainer checkpoints them."""
    lora: ActivationTerms | None
    """LoRA on ``all-linear`` at rank ``lora_rank`` with dropout ``lora_dropout``, adapters in bf16 (as the
    trainer casts them): the most any LoRA target set keeps (fewer targets, or no dropout, keep less). Each
    layer is traced as one deeper in the stack (its input requiring grad); over the frozen embedding the
    model's first layer keeps less, so the terms count it high. Dropout is 0 where peft adapts fused experts
    or a router in place (it refuses dropout there). None when the adapted model cannot train
    (``lora_failure``)."""
    lora_checkpointed: ActivationTerms | None
    """LoRA as ``lora``, the decoder layers checkpointed."""
    unmasked: TracedSetups | None = None
    """The setups traced again on a row of one unpadded document: no attention mask at all, so SDPA runs
    ``is_causal`` and saves its output and log-sum-exp, what flash attention saves (which takes packed documents
    as sequence boundaries, ``cu_seq_lens``, not as a mask). The terms of a plan with flash attention, and of
    SDPA on batches that need no mask. None in a version-4 profile."""
    tiled_mlp: TracedSetups | None = None
    """The unmasked setups with the trainer's tiled MLP (``memfit_trainer.tiled_mlp``), traced at multiples of
    the hidden size (whole tiles), with the model's own loss only: what tiling changes is inside the layers.
    None in a version-4 profile."""
    lora_rank: int = Field(ge=1)
    lora_dropout: float = Field(ge=0, lt=1)
    lora_failure: str | None = None
    """Why a training step of the model with peft's adapters failed (e.g. peft wrapping a module whose forward
    returns a tuple): the planner plans no LoRA or QLoRA for it."""

    def terms(self, lora: bool, checkpointed: bool, setups: TracedSetups | None = None) -> ActivationTerms | None:
        """The terms of one setup: LoRA or full, checkpointed or not, of these traced setups (default: the
        packed rows'); None where that setup cannot train."""
        traced: ActivationProfile | TracedSetups = setups or self
        if lora:
            return traced.lora_checkpointed if checkpointed else traced.lora
        return traced.full_checkpointed if checkpointed else traced.full


class ModelProfile(_Frozen):
    """A model as its ``transformers`` class builds it from one config.json."""

    version: int = PROFILE_VERSION
    config_sha256: str
    """sha256 of the canonical config.json (``canonical_config_sha256``): which file this profile describes."""
    model_type: str
    architecture: str
    """The class ``AutoModelForCausalLM.from_config`` built (e.g. ``Qwen3ForCausalLM``)."""
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    """Of the full-attention layers (the text config's ``num_attention_heads``)."""
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    """One per decoder layer; ``full_attention`` everywhere where the config names no layer types."""
    sliding_window: int | None = None
    tie_word_embeddings: bool
    experts: Experts | None = None
    attention_kernels: tuple[str, ...]
    """``attn_implementation`` values the class supports (``eager`` always)."""
    tensors: tuple[TensorGroup, ...]
    lora: tuple[LoraResolution, ...] = ()
    activations: ActivationProfile | None = None
    """Traced activation terms per layer type; None unless asked for (``--activations``)."""

    @model_validator(mode="after")
    def _known_version(self) -> Self:
        if self.version not in READABLE_VERSIONS:
            readable = ", ".join(map(str, sorted(READABLE_VERSIONS)))
            raise ValueError(f"profile version {self.version}, this memfit reads versions {readable}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        return self

    @property
    def total_parameters(self) -> int:
        return sum(group.numel for group in self.tensors)

    @property
    def quantizable_parameters(self) -> int:
        return sum(group.numel for group in self.tensors if group.quantizable)

    def parameters_by(self) -> dict[tuple[Role, str | None], int]:
        """Parameters per (role, layer type), in the order the roles first appear."""
        totals: dict[tuple[Role, str | None], int] = {}
        for group in self.tensors:
            key = (group.role, group.layer_type)
            totals[key] = totals.get(key, 0) + group.numel
        return totals


def canonical_config_sha256(config: dict[str, Any]) -> str:
    """sha256 of a config.json's content, independent of its key order and whitespace."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
