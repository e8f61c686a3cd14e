"""Activation offloading's memory (``memfit.memory.activations``, ``activation_offloading``) against MemTracker
traces of training steps that run the trainer's own offload hooks (``memfit_trainer.activation_offload``),
which in a trace copy the layers' inputs off the traced device (``calibration.memtrace.HOST``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from calibration.compare import measured_beyond_states, relative_error
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import (
    ActivationSetup,
    estimate_activations,
    offloaded_layers,
    pinned_host_bytes,
)
from memfit.model_shape import ModelFamily, ModelShape

WORST = 0.05
"""The estimate within 5% of the trace, either way (these settings trace at -0.3% to +1.4%: with LoRA and the
chunked loss the estimate counts every adapter gradient beside the middle layers' inputs)."""

SHAPES = {
    "llama": ModelShape(ModelFamily.LLAMA, 512, 1408, 12, 8, 2, 8192),
    "qwen2 tied": ModelShape(ModelFamily.QWEN2, 512, 1376, 12, 8, 2, 8192, tie_word_embeddings=True),
    "mistral": ModelShape(ModelFamily.MISTRAL, 640, 1792, 10, 10, 2, 8192),
}
"""Deep and narrow, with a small vocabulary: the layers' inputs are a large part of the peak, so that
offloading them shows. (Mistral's sequences stay under its 4096-token sliding window.)"""
SETTINGS = [
    dict(micro_batch=1, seq_len=2048, trainable="full"),
    dict(micro_batch=2, seq_len=2048, trainable="lora", lora_rank=8),
]
ALL_LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@functools.cache
def _checkpointed_trace(name: str, setting: int, offloading: bool, chunked_loss: bool = False) -> dict[str, Any]:
    """The traced step of ``SHAPES[name]`` with ``SETTINGS[setting]``, checkpointed: each traced once in this
    module (Llama's offloaded step with the model's loss is read by two tests). Read only."""
    from calibration.memtrace import trace_training_step

    return trace_training_step(
        SHAPES[name],
        gradient_checkpointing=True,
        activation_offloading=offloading,
        chunked_loss=chunked_loss,
        **SETTINGS[setting],
    )


def _setup(method: Method, layers_offloaded: bool = True, checkpointing: bool = True) -> ActivationSetup:
    return ActivationSetup(
        method=method,
        precision=Precision.BF16,
        gradient_checkpointing=checkpointing,
        micro_batch_size=1,
        sequence_length=4096,
        attention=Attention.SDPA,
        lora_rank=16 if method != Method.FULL else 0,
        lora_targets=ALL_LINEAR if method != Method.FULL else frozenset(),
        activation_offloading=layers_offloaded,
    )


def test_pinned_host_blocks_are_powers_of_two() -> None:
    assert [pinned_host_bytes(n) for n in (0, 1, 1024, 1025, 3 << 20, 4 << 20)] == [0, 1, 1024, 2048, 4 << 20, 4 << 20]


@pytest.mark.parametrize("method", [Method.FULL, Method.LORA])
def test_the_gpu_holds_a_few_layer_inputs_whatever_the_depth(method: Method) -> None:
    """Offloaded, a deeper model costs host memory, not GPU memory: its moments do not grow with the
    layers; the host holds every offloaded input, in the pinned allocator's blocks."""
    shallow, deep = (dataclasses.replace(SHAPES["llama"], num_layers=n) for n in (8, 80))
    setup = _setup(method)
    a, b = estimate_activations(shallow, setup), estimate_activations(deep, setup)
    assert (a.loss_moment, a.layer_moment, a.first_layer_moment) == (
        b.loss_moment,
        b.layer_moment,
        b.first_layer_moment,
    )
    between = 4096 * deep.hidden_size * 2
    assert b.host_bytes == offloaded_layers(setup, 80) * pinned_host_bytes(between)
    assert offloaded_layers(setup, 80) == (80 if method == Method.FULL else 79)  # LoRA's first input stays
    kept = estimate_activations(deep, _setup(method, layers_offloaded=False))
    assert kept.host_bytes == 0
    assert b.loss_moment == kept.loss_moment - offloaded_layers(setup, 80) * between


def test_offloading_needs_checkpointing_to_change_anything() -> None:
    shape = SHAPES["llama"]
    plain = estimate_activations(shape, _setup(Method.FULL, layers_offloaded=False, checkpointing=False))
    assert estimate_activations(shape, _setup(Method.FULL, checkpointing=False)) == plain


def test_the_trace_refuses_offloading_without_checkpointing() -> None:
    pytest.importorskip("transformers")
    from calibration.memtrace import trace_training_step

    with pytest.raises(ValueError, match="gradient_checkpointing"):
        trace_training_step(SHAPES["llama"], micro_batch=1, seq_len=8, activation_offloading=True)


@pytest.mark.slow
@pytest.mark.parametrize("chunked_loss", [False, True], ids=["plain-loss", "chunked-loss"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_activation_offloading_estimate_matches_the_trace(name: str, settings: dict, chunked_loss: bool) -> None:
    pytest.importorskip("transformers")

    shape = SHAPES[name]
    record = _checkpointed_trace(name, SETTINGS.index(settings), True, chunked_loss)
    error = relative_error(record)
    assert -WORST <= error <= WORST, f"{name} {settings} chunked={chunked_loss}: {error:+.1%}"
    # The host holds every offloaded input at once (the trace has no pinned allocator to round them).
    between = settings["micro_batch"] * settings["seq_len"] * shape.hidden_size * 2
    method = Method(settings["trainable"])
    assert record["host_peak_bytes"] == offloaded_layers(_setup(method), shape.num_layers) * between


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_offloading_takes_the_layer_inputs_off_the_traced_device(settings: dict) -> None:
    """With the plain loss the peak is the loss's: offloading lowers it by exactly the inputs it moves."""
    pytest.importorskip("transformers")

    shape = SHAPES["llama"]
    kept, moved = (_checkpointed_trace("llama", SETTINGS.index(settings), offload) for offload in (False, True))
    between = settings["micro_batch"] * settings["seq_len"] * shape.hidden_size * 2
    method = Method(settings["trainable"])
    assert kept["host_peak_bytes"] == 0
    saved = measured_beyond_states(kept) - measured_beyond_states(moved)
    assert saved == offloaded_layers(_setup(method), shape.num_layers) * between
