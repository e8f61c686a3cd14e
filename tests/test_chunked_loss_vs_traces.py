"""The chunked loss's memory (``memfit.memory.activations.chunked_loss_buffers``) against MemTracker traces
of training steps that run the trainer's own loss path (``memfit_trainer.chunked_loss.causal_lm_loss``)."""

from __future__ import annotations

import pytest

from calibration.compare import relative_error
from memfit.memory.activations import loss_chunk_tokens
from memfit.model_shape import ModelFamily, ModelShape

WORST = 0.05
"""The estimate within 5% of the trace, either way."""

SHAPES = {
    "llama": ModelShape(ModelFamily.LLAMA, 1536, 4352, 3, 12, 4, 128_256),
    "qwen2 tied": ModelShape(ModelFamily.QWEN2, 1280, 3456, 3, 10, 2, 152_000, tie_word_embeddings=True),
    "mistral": ModelShape(ModelFamily.MISTRAL, 1024, 3584, 2, 8, 2, 131_072),
    "gemma2 soft-capped": ModelShape(ModelFamily.GEMMA2, 1152, 4608, 2, 8, 4, 256_000, head_dim=128,
                                     tie_word_embeddings=True),
}  # fmt: skip
SETTINGS = [
    dict(micro_batch=2, seq_len=384, dtype="bf16", gradient_checkpointing=False, trainable="full"),
    dict(micro_batch=1, seq_len=1024, dtype="bf16", gradient_checkpointing=True, trainable="full"),
    dict(micro_batch=1, seq_len=512, dtype="fp32", gradient_checkpointing=False, trainable="full"),
    dict(micro_batch=1, seq_len=512, dtype="bf16", gradient_checkpointing=True, trainable="lora"),
]


def test_the_traced_steps_span_several_chunks() -> None:
    for shape in SHAPES.values():
        for settings in SETTINGS:
            tokens = settings["micro_batch"] * settings["seq_len"]
            assert loss_chunk_tokens(tokens, shape.vocab_size) < tokens


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_chunked_loss_estimate_matches_the_trace(name: str, settings: dict) -> None:
    pytest.importorskip("transformers")
    from calibration.memtrace import trace_training_step

    shape = SHAPES[name]
    attention = "eager" if shape.family is ModelFamily.GEMMA2 else "sdpa"
    record = trace_training_step(shape, attention=attention, chunked_loss=True, **settings)
    error = relative_error(record)
    assert -WORST <= error <= WORST, f"{name} {settings}: {error:+.1%}"
