"""Flex attention in the activation model (``memfit.memory.activations``): a ``BlockMask`` instead of the dense
``(b, 1, s, s)`` mask, no per-layer 16-bit copies, keys and values repeated only where ``transformers`` does;
the block mask's size against the tensors torch builds, and the whole peak against MemTracker traces of the
trainer's packed batches (through torch's reference implementation: ``calibration.flex_reference``)."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import (
    ActivationSetup,
    attention_mask_bytes,
    estimate_activations,
    flex_block_mask_bytes,
    saved_per_layer,
)
from memfit.model_shape import ModelFamily, ModelShape
from tests.test_activations_vs_traces import PACKED_SHAPES, WORST_OVER, WORST_UNDER

GQA = ModelShape(ModelFamily.LLAMA, 2048, 5632, 6, 16, 4, 32_000)
ODD_HEADS = ModelShape(ModelFamily.QWEN2, 448, 1376, 3, 7, 1, 8192, tie_word_embeddings=True)
"""Seven query heads: transformers' flex path repeats keys and values (native GQA only for powers of two)."""
B, S = 2, 4096


def _setup(attention: Attention, checkpointing: bool = True, masked: bool = True, seq: int = S) -> ActivationSetup:
    return ActivationSetup(
        method=Method.FULL,
        precision=Precision.BF16,
        gradient_checkpointing=checkpointing,
        micro_batch_size=B,
        sequence_length=seq,
        attention=attention,
        masked_batches=masked,
    )


def test_the_block_mask_is_kilobytes_where_the_dense_mask_is_megabytes() -> None:
    flex, sdpa = attention_mask_bytes(GQA, _setup(Attention.FLEX)), attention_mask_bytes(GQA, _setup(Attention.SDPA))
    tiles = S // 128
    assert flex == B * 4 * (tiles + tiles**2) * 4 + B * S * 8
    assert sdpa == B * S * S and flex * 100 < sdpa


def test_a_flex_layer_keeps_what_an_unmasked_sdpa_layer_keeps_and_both_statistics() -> None:
    """No 16-bit mask copy, no repeated keys and values (native GQA), the fp32 maximum score beside the
    log-sum-exp: packed or not."""
    unmasked_sdpa = saved_per_layer(GQA, _setup(Attention.SDPA, masked=False))
    for masked in (True, False):
        flex = saved_per_layer(GQA, _setup(Attention.FLEX, masked=masked))
        assert flex - unmasked_sdpa == B * S * GQA.num_attention_heads * 4


def test_flex_repeats_keys_and_values_for_a_number_of_heads_that_is_no_power_of_two() -> None:
    flex, unmasked_sdpa = _setup(Attention.FLEX), _setup(Attention.SDPA, masked=False)
    statistics = B * S * ODD_HEADS.num_attention_heads * 4
    repeated = 2 * B * S * (ODD_HEADS.q_size - ODD_HEADS.kv_size) * 2
    assert saved_per_layer(ODD_HEADS, flex) - saved_per_layer(ODD_HEADS, unmasked_sdpa) == statistics + repeated


def test_every_flex_layer_saves_the_block_mask_until_the_backward_ends() -> None:
    """Without checkpointing too: each flex call saves it for its backward (a dense mask is gone by then)."""
    setup = _setup(Attention.FLEX, checkpointing=False)
    without = estimate_activations(GQA, dataclasses.replace(setup, attention=Attention.FLASH))
    with_mask = estimate_activations(GQA, setup)
    per_layer = saved_per_layer(GQA, setup) - saved_per_layer(
        GQA, dataclasses.replace(setup, attention=Attention.FLASH)
    )
    assert with_mask.loss_moment - without.loss_moment == GQA.num_layers * per_layer + flex_block_mask_bytes(setup)


@pytest.mark.parametrize("seq", [128, 1000, 2048])
@pytest.mark.parametrize("packed", [False, True], ids=["one-per-row", "packed"])
def test_the_block_mask_counts_the_tensors_of_the_mask_transformers_builds(seq: int, packed: bool) -> None:
    """transformers' ``create_causal_mask`` for flex, from the trainer's position ids: the BlockMask's tensors
    are what :func:`flex_block_mask_bytes` counts for them (the packed document index aside)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.masking_utils import create_causal_mask

    from calibration.flex_reference import flex_reference_on_cpu
    from memfit_trainer.hf_config import transformers_config

    config = transformers_config(PACKED_SHAPES["llama"], use_cache=False)
    config._attn_implementation = "flex_attention"
    half = torch.arange(seq // 2)
    positions = torch.cat([half, torch.arange(seq - seq // 2)]) if packed else torch.arange(seq)
    embeddings = torch.zeros(B, seq, 8)
    with flex_reference_on_cpu():
        mask = create_causal_mask(config, embeddings, None, None, position_ids=positions.expand(B, -1))
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    assert len(tensors) == 8
    documents = B * seq * 8 if packed else 0
    setup = _setup(Attention.FLEX, masked=packed, seq=seq)
    assert sum(t.numel() * t.element_size() for t in tensors) == flex_block_mask_bytes(setup) - documents


FLEX_SHAPES = {**PACKED_SHAPES, "qwen2 seven heads": ODD_HEADS}


@pytest.mark.slow
@pytest.mark.parametrize("trainable", ["full", "lora"])
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", sorted(FLEX_SHAPES))
def test_fresh_flex_traces_of_the_trainers_packed_batches(
    name: str, gradient_checkpointing: bool, trainable: str
) -> None:
    pytest.importorskip("transformers")
    from calibration.compare import relative_error
    from calibration.memtrace import trace_training_step

    record = trace_training_step(
        FLEX_SHAPES[name], micro_batch=2, seq_len=1024, attention=Attention.FLEX,
        gradient_checkpointing=gradient_checkpointing, trainable=trainable, batch="packed",  # type: ignore[arg-type]
    )  # fmt: skip
    error = relative_error(record)
    assert WORST_UNDER <= error <= WORST_OVER, f"{name} flex {gradient_checkpointing} {trainable}: {error:+.1%}"


SOFT_CAPPED_AND_FUSED = {
    "gemma2 soft-capped": (ModelShape(ModelFamily.GEMMA2, 512, 1408, 4, 8, 4, 8192, tie_word_embeddings=True), False),
    "phi3 fused qkv": (ModelShape(ModelFamily.PHI3, 512, 1408, 3, 8, 8, 32064), False),
    "phi3 fused qkv checkpointed": (ModelShape(ModelFamily.PHI3, 512, 1408, 3, 8, 8, 32064), True),
}
"""Gemma 2's soft-cap runs inside flex (a ``score_mod``: not eager, as it is under SDPA); Phi-3's fused QKV. (Gemma 2
checkpointed is not traced: make_fx cannot retrace the soft-cap's ``score_mod`` inside the recomputation.)"""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOFT_CAPPED_AND_FUSED))
def test_fresh_flex_traces_of_soft_capped_and_fused_attention(name: str) -> None:
    pytest.importorskip("transformers")
    from calibration.compare import relative_error
    from calibration.memtrace import trace_training_step

    shape, gradient_checkpointing = SOFT_CAPPED_AND_FUSED[name]
    record = trace_training_step(
        shape, micro_batch=2, seq_len=1024, attention=Attention.FLEX, gradient_checkpointing=gradient_checkpointing,
        batch="packed",
    )  # fmt: skip
    error = relative_error(record)
    assert WORST_UNDER <= error <= WORST_OVER, f"{name}: {error:+.1%}"


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("name", ["llama", "qwen2 seven heads"])
def test_what_flex_saves_over_sdpa_on_a_packed_batch_is_what_the_model_says(
    name: str, gradient_checkpointing: bool
) -> None:
    """The traced difference between SDPA (dense mask, its 16-bit copies, repeated keys and values) and flex
    (a block mask, the maximum scores) on the same packed batch, to within a few bytes."""
    pytest.importorskip("transformers")
    from calibration.compare import activation_estimate, measured_beyond_states
    from calibration.memtrace import trace_training_step

    records = {
        attention: trace_training_step(
            FLEX_SHAPES[name],
            micro_batch=2,
            seq_len=1024,
            attention=attention,
            gradient_checkpointing=gradient_checkpointing,
            batch="packed",
        )  # fmt: skip
        for attention in (Attention.SDPA, Attention.FLEX)
    }
    measured = measured_beyond_states(records[Attention.SDPA]) - measured_beyond_states(records[Attention.FLEX])
    predicted = activation_estimate(records[Attention.SDPA]).peak - activation_estimate(records[Attention.FLEX]).peak
    assert measured > 0
    assert abs(measured - predicted) <= 256, (measured, predicted)
