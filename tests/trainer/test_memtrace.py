"""Facts about real training-step memory that memfit's analytic model relies on, measured on fake tensors."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # each traces a training step of its own

from calibration.memtrace import saved_tensors, trace_training_step  # noqa: E402
from memfit.model_shape import ModelFamily, ModelShape  # noqa: E402

TINY = ModelShape(ModelFamily.LLAMA, 64, 160, 2, 4, 2, 512)
"""GQA (4 query heads, 2 key/value heads) so repeated keys/values would show."""

STEP_TENSOR_BYTES = 4
"""AdamW keeps its step count as one fp32 scalar tensor per parameter tensor."""


@functools.cache
def trace(shape: ModelShape = TINY, **kwargs: object) -> dict:
    settings = {"micro_batch": 1, "seq_len": 64, **kwargs}
    return trace_training_step(shape, **settings)  # type: ignore[arg-type]


def param_tensors(shape: ModelShape) -> int:
    """Parameter tensors of a Llama: embedding, LM head, final norm, and 7 linears + 2 norms per layer."""
    return 3 + 9 * shape.num_layers


def saved_activations(shape: ModelShape = TINY, **kwargs: object) -> int:
    """Activation bytes at the end of the forward pass (what autograd keeps for backward)."""
    return trace(shape, **kwargs)["phases"]["forward"]["end"]["ACT"]


def test_bf16_parameters_and_adamw_states_have_the_parameters_dtype() -> None:
    t = trace()
    assert t["parameters"] == TINY.parameter_count
    assert t["start"]["PARAM"] == 2 * TINY.parameter_count
    assert t["start"]["OPT"] == 2 * 2 * TINY.parameter_count + STEP_TENSOR_BYTES * param_tensors(TINY)
    assert t["phases"]["backward"]["end"]["GRAD"] == 2 * TINY.parameter_count


def test_fp32_adamw_states_are_eight_bytes_per_parameter() -> None:
    t = trace(dtype="fp32")
    assert t["start"]["PARAM"] == 4 * TINY.parameter_count
    assert t["start"]["OPT"] == 2 * 4 * TINY.parameter_count + STEP_TENSOR_BYTES * param_tensors(TINY)


def test_foreach_adamw_allocates_one_state_sized_temporary_and_fused_none() -> None:
    """PyTorch's CUDA default (foreach) takes sqrt(exp_avg_sq) for all parameters at once."""
    for impl, temporaries in (("foreach", 2 * TINY.parameter_count), ("fused", 0)):
        step = trace(optimizer_impl=impl)["phases"]["optimizer"]
        assert step["peak"]["OPT"] - step["end"]["OPT"] == temporaries, impl


def test_sdpa_activations_grow_linearly_with_sequence_length() -> None:
    a1, a2, a4 = (saved_activations(seq_len=s) for s in (64, 128, 256))
    assert a4 - a2 == 2 * (a2 - a1)


def test_eager_attention_activations_grow_superlinearly() -> None:
    a1, a2, a4 = (saved_activations(seq_len=s, attention="eager") for s in (64, 128, 256))
    assert a4 - a2 > 2 * (a2 - a1)
    assert a1 > saved_activations(seq_len=64)


def test_activations_are_linear_in_micro_batch_and_nearly_only_depend_on_tokens() -> None:
    """Only RoPE's cos/sin tables (one per position, not per sequence) break exact b*s symmetry.

    (From b=2 on: at b=1 the shifted labels are a view of the padded ones, 8 bytes more.)
    """
    a2, a3, a4 = (saved_activations(micro_batch=b, seq_len=64) for b in (2, 3, 4))
    assert a4 - a3 == a3 - a2
    assert abs(a2 - saved_activations(seq_len=128)) < 0.005 * a2


def test_checkpointing_keeps_only_each_layers_bf16_input() -> None:
    deeper = dataclasses.replace(TINY, num_layers=4)
    b, s = 1, 64
    per_layer = (
        saved_activations(deeper, gradient_checkpointing=True) - saved_activations(gradient_checkpointing=True)
    ) // 2
    assert per_layer == 2 * b * s * TINY.hidden_size
    assert saved_activations(gradient_checkpointing=True) < saved_activations()


def test_llama_layer_saves_the_derived_bytes_per_token() -> None:
    """16h (two RMSNorms: fp32 input + bf16 output + q/k/v and MLP input) + 4q + 4kv + 8i + 4 heads + 8."""
    s = 64
    rows = saved_tensors(TINY, micro_batch=1, seq_len=s)
    layer = sum(r["bytes"] for r in rows if ".layers.1." in r["module"] + ".")
    h, i, heads = TINY.hidden_size, TINY.intermediate_size, TINY.num_attention_heads
    assert layer == s * (16 * h + 4 * TINY.q_size + 4 * TINY.kv_size + 8 * i + 4 * heads + 8)


def test_loss_keeps_fp32_log_probabilities_and_backward_adds_two_more_logits_buffers() -> None:
    t = trace()
    s, v = 64, TINY.vocab_size
    rows = saved_tensors(TINY, micro_batch=1, seq_len=s)
    assert [r["bytes"] for r in rows if r["op"] == "_log_softmax"] == [4 * s * v]
    backward = t["phases"]["backward"]["transient_peak"]
    assert backward["TEMP"] == 2 * 4 * s * v
    shifted_labels = 8 * (s + 1)  # int64, freed by the loss's backward just before
    assert backward["ACT"] == t["phases"]["forward"]["end"]["ACT"] - shifted_labels


def test_lora_trains_fp32_adapters_on_a_frozen_bf16_base() -> None:
    t = trace(trainable="lora", lora_rank=8)
    adapters = TINY.lora_parameters(8, ("all-linear",))
    assert t["trainable_parameters"] == adapters
    assert t["start"]["PARAM"] == 2 * TINY.parameter_count + 4 * adapters
    assert t["phases"]["backward"]["end"]["GRAD"] == 4 * adapters


def test_tied_embeddings_hold_two_extra_embedding_sized_gradients_at_the_end_of_backward() -> None:
    """The LM head's (transposed-view) gradient waits in autograd's input buffer while the embedding's
    arrives; their sum is a third tensor. Untied, only the embedding output's gradient is extra."""
    b, s = 1, 8
    for tied, temporaries in ((True, 2), (False, 0)):
        shape = dataclasses.replace(TINY, vocab_size=4096, tie_word_embeddings=tied)
        peak = trace(shape, micro_batch=b, seq_len=s)["phases"]["backward"]["peak"]
        embedding = shape.vocab_size * shape.hidden_size * 2
        assert peak["GRAD"] == 2 * shape.parameter_count
        assert peak["TEMP"] == temporaries * embedding + (0 if tied else b * s * shape.hidden_size * 2)
