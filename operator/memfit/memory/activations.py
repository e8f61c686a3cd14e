"""Peak activation memory of one micro-batch's forward and backward, from the model's shape.

Derived op by op from what autograd saves in the ``transformers`` decoder layer of each family (the
tensors a backward pass needs), then checked against PyTorch MemTracker traces of real training steps
(``bench/memtrace_grid.py``; tests in ``tests/test_activations_vs_traces.py``). Every term is a tensor
size; there are no fitted fudge factors, which is what lets the model carry over to shapes that were
never traced.

Notation: t = micro_batch x sequence tokens, h hidden, i intermediate, q = heads x head_dim,
kv = kv_heads x head_dim, V vocabulary, w bytes per element of the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.states import FP32
from memfit.model_shape import ModelFamily, ModelShape

BOOL = 1


@dataclass(frozen=True)
class ActivationSetup:
    """What decides activation memory (a plan's knobs minus the ones that only move model states)."""

    method: str
    precision: str
    gradient_checkpointing: bool
    micro_batch_size: int
    sequence_length: int
    attention: str
    lora_rank: int = 0
    lora_targets: frozenset[str] = frozenset()
    lora_dropout: bool = True


@dataclass(frozen=True)
class ActivationEstimate:
    saved_per_layer: int
    """Bytes one decoder layer keeps for its backward pass."""
    kept_between_layers: int
    """Bytes kept per layer under gradient checkpointing (its input)."""
    logits_peak: int
    """LM head, upcast and cross-entropy buffers alive at the loss."""
    layer_backward_transient: int
    """Scratch of one layer's backward (gradients of its activations)."""
    peak: int
    """Peak bytes of the forward + backward beyond weights, gradients and optimizer states."""


def _attention_saved(shape: ModelShape, setup: ActivationSetup, t: int, w: int) -> int:
    """Tensors the attention core keeps: q, k, v after RoPE and what the kernel saves."""
    b, s = setup.micro_batch_size, setup.sequence_length
    q, kv = shape.q_size, shape.kv_size
    if setup.attention == "eager" or shape.family is ModelFamily.GEMMA2 and setup.attention != "flash":
        # Scores are materialised: softmax output in fp32 and its 16-bit cast for the value matmul;
        # keys and values are repeated to all query heads first (repeat_kv).
        scores = b * shape.num_attention_heads * s * s * (FP32 + w)
        return scores + t * 3 * q * w
    # Fused kernels (SDPA, flash) keep q, k, v, the output and a log-sum-exp per row.
    return t * (q + 2 * kv) * w + t * q * w + b * shape.num_attention_heads * s * FP32


def _lora_saved(shape: ModelShape, setup: ActivationSetup, t: int, w: int) -> int:
    """Each adapter keeps its (dropped-out) input and the rank-r intermediate."""
    if setup.method == "full":
        return 0
    per_layer = 0
    for module in shape.layer_linears:
        if module.name in setup.lora_targets:
            dropout = t * module.in_features * (w + BOOL) if setup.lora_dropout else 0
            per_layer += module.count * (dropout + t * setup.lora_rank * w)
    return per_layer


def saved_per_layer(shape: ModelShape, setup: ActivationSetup) -> int:
    """Bytes one decoder layer saves for backward (no checkpointing)."""
    t = setup.micro_batch_size * setup.sequence_length
    w = FP32 if setup.precision == "fp32" else 2
    h, i = shape.hidden_size, shape.intermediate_size
    norm_input = FP32 * t * h  # RMSNorm upcasts its input to fp32 and keeps it
    norm = norm_input + 2 * w * t * h  # plus the normalised value (for the weight grad) and its output
    mlp_width = i * (shape.experts_per_token if shape.is_moe else 1)
    saved = shape.norms_per_layer * norm
    saved += _attention_saved(shape, setup, t, w)
    saved += t * shape.q_size * w  # attention output, reshaped for o_proj
    saved += 4 * t * mlp_width * w  # gate, act(gate), up, act*up
    saved += _lora_saved(shape, setup, t, w)
    return saved


def logits_peak(shape: ModelShape, setup: ActivationSetup) -> int:
    """The loss: 16-bit logits, their fp32 upcast and the log-softmax output alive together."""
    t = setup.micro_batch_size * setup.sequence_length
    w = FP32 if setup.precision == "fp32" else 2
    upcast = 0 if w == FP32 else FP32
    return t * shape.vocab_size * (w + upcast + FP32)


def estimate_activations(shape: ModelShape, setup: ActivationSetup) -> ActivationEstimate:
    t = setup.micro_batch_size * setup.sequence_length
    w = FP32 if setup.precision == "fp32" else 2
    per_layer = saved_per_layer(shape, setup)
    between = t * shape.hidden_size * w
    logits = logits_peak(shape, setup)
    transient = 2 * t * max(shape.intermediate_size, shape.hidden_size) * w
    layers = shape.num_layers
    kept_per_layer = between if setup.gradient_checkpointing else per_layer
    recomputed = per_layer if setup.gradient_checkpointing else 0
    kept = layers * kept_per_layer + recomputed + transient
    return ActivationEstimate(
        saved_per_layer=per_layer,
        kept_between_layers=between,
        logits_peak=logits,
        layer_backward_transient=transient,
        peak=kept + logits,
    )
