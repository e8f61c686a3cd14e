"""Traced activation terms per layer type (``memfit_trainer.activation_profile``): exact, and they add up.

Each family's small config keeps the structure of the real one (its layer types, GQA, sliding window, linear
attention, experts and sinks) at widths a fake-tensor trace runs in seconds. The terms are solved from three
token counts; the profiler itself checks every further count to the byte, and here a held-out count and a
model of several mixed layers, traced whole, check that the terms compose.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from memfit.api.vocabulary import Attention, Method, Precision  # noqa: E402
from memfit.memory.activations import ActivationSetup, saved_per_layer  # noqa: E402
from memfit.model_shape import ModelFamily, ModelShape  # noqa: E402
from memfit.profile import ActivationTerm  # noqa: E402
from memfit_trainer.activation_profile import (  # noqa: E402
    activation_profile,
    attention_kernel,
    solve,
    text_config,
    trace,
)

WIDTHS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
WIDTHS = {**WIDTHS, "head_dim": 64, "vocab_size": 1024}
TOKENS = (64, 128, 192, 256, 384)
HELD_OUT = 320
WINDOW = 64
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, **WIDTHS},
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 2, **WIDTHS},
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "final_logit_softcapping": 30.0,
        **WIDTHS,
    },
    "qwen3_5_text": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        **WIDTHS,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        **WIDTHS,
    },
}
WINDOWED_TOKENS = (16, 32, 64, 128, 192, 256, 384)
"""For the windowed families: three counts up to the window, four above it."""


def _tokens(name: str) -> tuple[int, ...]:
    return WINDOWED_TOKENS if "sliding_window" in CONFIGS[name] else TOKENS


@pytest.fixture(scope="module")
def profiles() -> dict[str, Any]:
    return {name: activation_profile(config, _tokens(name)) for name, config in CONFIGS.items()}


def test_solve_is_exact_and_says_when_a_window_bounds_the_quadratic_term() -> None:
    def windowed(t: int) -> int:
        return 10 * t + 3 * t * min(t, 64) + 7

    term = solve([(t, windowed(t)) for t in (16, 32, 64, 128, 256)], window=64)
    assert (term.per_token, term.per_token_squared, term.constant, term.window, term.exact) == (10, 3, 7, 64, True)
    assert term.bytes(1000) == windowed(1000)
    cubic = solve([(t, t**3) for t in (1, 2, 3, 4)])
    assert not cubic.exact and cubic.measured[-1] == (4, 64)


def test_attention_kernel_is_sdpa_where_supported_else_eager() -> None:
    assert attention_kernel(text_config(CONFIGS["qwen3"])) == "sdpa"
    assert attention_kernel(text_config(CONFIGS["gpt_oss"])) == "eager"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_terms_are_exact_and_predict_a_held_out_count_and_a_whole_model(name: str, profiles: dict[str, Any]) -> None:
    profile = profiles[name]
    terms: list[ActivationTerm] = [profile.outside_layers]
    terms += [term for layer in profile.layers for term in (layer.saved, layer.backward_peak)]
    assert all(term.exact for term in terms), [term for term in terms if not term.exact]
    text = text_config(CONFIGS[name])
    kinds = tuple(text.layer_types) if getattr(text, "layer_types", None) else ("full_attention",) * 2
    whole = trace(text, kinds, HELD_OUT, profile.attention)
    for layer in whole.layers:
        terms_of_type = profile.layer(layer.layer_type)
        assert layer.saved == terms_of_type.saved.bytes(HELD_OUT)
        assert layer.backward_peak == terms_of_type.backward_peak.bytes(HELD_OUT)
    predicted = profile.forward_end_bytes(kinds, HELD_OUT)
    assert abs(predicted - whole.forward_end) <= 0.05 * whole.forward_end


@pytest.mark.slow
def test_a_sliding_layer_of_an_eager_kernel_is_bounded_by_nothing_the_window_does_not_bound(
    profiles: dict[str, Any],
) -> None:
    """gpt-oss runs eager attention: its scores are ``T×T`` whatever the window, so the quadratic term of a
    sliding layer equals the full layer's."""
    gpt_oss = profiles["gpt_oss"]
    sliding, full = gpt_oss.layer("sliding_attention").saved, gpt_oss.layer("full_attention").saved
    assert sliding.per_token_squared == full.per_token_squared > 0


@pytest.mark.slow
def test_llama_traced_layer_against_memfits_formula(profiles: dict[str, Any]) -> None:
    """The traced per-layer bytes and ``saved_per_layer`` for the same setup (bf16, full, SDPA, no mask).

    Traced, a layer keeps about 5% more than the formula (1.0525 at 320 tokens for these widths); the test
    bounds the gap at 10% until the difference is named.
    """
    config = CONFIGS["llama"]
    shape = ModelShape(
        family=ModelFamily.LLAMA,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"],
        head_dim=config["head_dim"],
    )
    traced = profiles["llama"].layer("full_attention").saved
    for tokens in (HELD_OUT, 4096):
        setup = ActivationSetup(
            method=Method.FULL,
            precision=Precision.BF16,
            gradient_checkpointing=False,
            micro_batch_size=1,
            sequence_length=tokens,
            attention=Attention.SDPA,
            masked_batches=False,
        )
        ratio = traced.bytes(tokens) / saved_per_layer(shape, setup)
        assert ratio == pytest.approx(1.0, abs=0.10), ratio
