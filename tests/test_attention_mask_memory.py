"""The attention mask's bytes in the activation model (``memfit.memory.activations``): what ``transformers``
builds from packed ``position_ids`` or padding, and what SDPA and eager attention make of it."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import (
    ActivationSetup,
    attention_mask_bytes,
    estimate_activations,
    saved_per_layer,
)
from memfit.model_shape import ModelFamily, ModelShape

GQA = ModelShape(ModelFamily.LLAMA, 2048, 5632, 6, 16, 4, 32_000)
B, S = 2, 4096


def _setup(attention: Attention, checkpointing: bool, masked: bool = True) -> ActivationSetup:
    return ActivationSetup(
        method=Method.FULL,
        precision=Precision.BF16,
        gradient_checkpointing=checkpointing,
        micro_batch_size=B,
        sequence_length=S,
        attention=attention,
        masked_batches=masked,
    )


@pytest.mark.parametrize(
    ("attention", "element_bytes"), [(Attention.SDPA, 1), (Attention.EAGER, 2), (Attention.FLASH, 0)]
)
def test_the_mask_is_one_b_by_s_by_s_tensor_of_the_kernels_dtype(attention: Attention, element_bytes: int) -> None:
    assert attention_mask_bytes(GQA, _setup(attention, True)) == B * S * S * element_bytes


def test_sdpa_without_a_mask_builds_none() -> None:
    assert attention_mask_bytes(GQA, _setup(Attention.SDPA, True, masked=False)) == 0


def test_a_masked_sdpa_layer_keeps_a_16_bit_copy_and_keys_and_values_for_every_head() -> None:
    masked, unmasked = _setup(Attention.SDPA, False), _setup(Attention.SDPA, False, masked=False)
    tokens, repeated_heads = B * S, GQA.q_size - GQA.kv_size
    extra = B * S * S * 2 + 2 * tokens * repeated_heads * 2
    assert saved_per_layer(GQA, masked) - saved_per_layer(GQA, unmasked) == extra


def test_flash_attention_keeps_no_mask_whatever_the_batch() -> None:
    flash = _setup(Attention.FLASH, True)
    assert estimate_activations(GQA, flash) == estimate_activations(
        GQA, dataclasses.replace(flash, masked_batches=False)
    )


@pytest.mark.parametrize("attention", [Attention.SDPA, Attention.EAGER])
def test_checkpointing_keeps_the_mask_through_the_backward_pass(attention: Attention) -> None:
    """The checkpointed layers' recomputation holds the mask until the backward pass ends; without
    checkpointing it is gone before the loss (only SDPA's per-layer copies stay)."""
    setup = _setup(attention, True)
    unmasked = dataclasses.replace(setup, masked_batches=False, attention=Attention.FLASH)
    with_mask, without = estimate_activations(GQA, setup), estimate_activations(GQA, unmasked)
    per_layer = saved_per_layer(GQA, setup) - saved_per_layer(GQA, unmasked)
    mask = attention_mask_bytes(GQA, setup)
    assert with_mask.loss_moment - without.loss_moment == mask
    assert with_mask.layer_moment - without.layer_moment >= mask + per_layer
    assert with_mask.backward_end == without.backward_end
