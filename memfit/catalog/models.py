"""Built-in catalogue of common open models with their published shapes (from each ``config.json``).

A test builds each preset with ``transformers`` on the meta device and checks the parameter count, so a
typo here cannot survive.
"""

from __future__ import annotations

from memfit.model_shape import ModelFamily, ModelShape

_F = ModelFamily


def _shape(
    family: ModelFamily, h: int, i: int, layers: int, heads: int, kv: int, vocab: int, **kw: object
) -> ModelShape:
    return ModelShape(family, h, i, layers, heads, kv, vocab, **kw)  # type: ignore[arg-type]


MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-2-7b": _shape(_F.LLAMA, 4096, 11008, 32, 32, 32, 32000),
    "llama-2-13b": _shape(_F.LLAMA, 5120, 13824, 40, 40, 40, 32000),
    "llama-2-70b": _shape(_F.LLAMA, 8192, 28672, 80, 64, 8, 32000),
    "llama-3-8b": _shape(_F.LLAMA, 4096, 14336, 32, 32, 8, 128256),
    "llama-3-70b": _shape(_F.LLAMA, 8192, 28672, 80, 64, 8, 128256),
    "llama-3.1-8b": _shape(_F.LLAMA, 4096, 14336, 32, 32, 8, 128256),
    "llama-3.1-70b": _shape(_F.LLAMA, 8192, 28672, 80, 64, 8, 128256),
    "llama-3.2-1b": _shape(_F.LLAMA, 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True, head_dim=64),
    "llama-3.2-3b": _shape(_F.LLAMA, 3072, 8192, 28, 24, 8, 128256, tie_word_embeddings=True, head_dim=128),
    "mistral-7b-v0.1": _shape(_F.MISTRAL, 4096, 14336, 32, 32, 8, 32000),
    "mistral-7b-v0.3": _shape(_F.MISTRAL, 4096, 14336, 32, 32, 8, 32768),
    "mixtral-8x7b": _shape(_F.MIXTRAL, 4096, 14336, 32, 32, 8, 32000, num_experts=8, experts_per_token=2),
    "qwen2.5-0.5b": _shape(_F.QWEN2, 896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _shape(_F.QWEN2, 1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True),
    "qwen2.5-3b": _shape(_F.QWEN2, 2048, 11008, 36, 16, 2, 151936, tie_word_embeddings=True),
    "qwen2.5-7b": _shape(_F.QWEN2, 3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-14b": _shape(_F.QWEN2, 5120, 13824, 48, 40, 8, 152064),
    "qwen2.5-32b": _shape(_F.QWEN2, 5120, 27648, 64, 40, 8, 152064),
    "qwen2.5-72b": _shape(_F.QWEN2, 8192, 29568, 80, 64, 8, 152064),
    "gemma-2-2b": _shape(_F.GEMMA2, 2304, 9216, 26, 8, 4, 256000, tie_word_embeddings=True, head_dim=256),
    "gemma-2-9b": _shape(_F.GEMMA2, 3584, 14336, 42, 16, 8, 256000, tie_word_embeddings=True, head_dim=256),
    "gemma-2-27b": _shape(_F.GEMMA2, 4608, 36864, 46, 32, 16, 256000, tie_word_embeddings=True, head_dim=128),
    "phi-3-mini": _shape(_F.PHI3, 3072, 8192, 32, 32, 32, 32064),
    "phi-3-medium": _shape(_F.PHI3, 5120, 17920, 40, 40, 10, 32064),
}
"""Preset name -> shape. Names are lower-case, the size as the model card gives it."""


def model_preset(name: str) -> ModelShape:
    """The shape of a preset, or a ``KeyError`` whose message lists what exists."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(MODEL_PRESETS)}") from None
