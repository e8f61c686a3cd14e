"""Tiny random models of the families added after the first six, saved as model directories (config.json,
safetensors, a locally trained tokenizer) the way users point the trainer at them: no typed architecture.

Each keeps its family's layer pattern in 2 layers (sliding and full attention, linear and full attention)
and its experts (fused 3-D expert weights in transformers 5), at widths that train in well under a second
per step on two CPU ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.api.vocabulary import Attention
from memfit.contract.sections import ModelConfig
from memfit.contract.trainer_config import TrainerConfig
from tests.trainer.chat_families import FAMILIES, VOCAB_SIZE, write_tokenizer

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 256,
}
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
NEW_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "gemma3_text": {
        "sliding_window": 16,
        "layer_types": SLIDING_THEN_FULL,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": SLIDING_THEN_FULL,
        "max_position_embeddings": 131072,  # its YaRN rope's own context (4096 x 32)
    },
    "gemma4_text": {
        "sliding_window": 16,
        "layer_types": SLIDING_THEN_FULL,
        "global_head_dim": 32,  # its full-attention layers have their own, wider heads
        "hidden_size_per_layer_input": 8,  # and a per-layer embedding input
        "vocab_size_per_layer_input": VOCAB_SIZE,
    },
    "llama4_text": {
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size": 32,  # the experts'; the dense layers' is intermediate_size_mlp
        "intermediate_size_mlp": 128,
        "interleave_moe_layer_step": 2,  # a dense layer, then a routed one
        "layer_types": ["chunked_attention", "full_attention"],  # chunked local attention, then global
        "attention_chunk_size": 16,
        "no_rope_layers": [1, 0],
    },
    "ministral3": {},
    "qwen3_5_text": {
        "layer_types": ["linear_attention", "full_attention"],  # Gated DeltaNet, then softmax attention
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
}
"""model_type -> the config fields of its tiny model beyond COMMON."""
CHAT_FAMILY = {"gemma3_text": "gemma3", "gemma4_text": "gemma3"}
"""The chat family of each model's tokenizer (qwen2.5's by default)."""


def tiny_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, **NEW_FAMILIES[model_type], **overrides})


def write_model_directory(model_type: str, directory: Path, seed: int = 0) -> Path:
    """A random model of the family saved with ``save_pretrained`` beside its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager")
    model.save_pretrained(str(directory))
    write_tokenizer(FAMILIES[CHAT_FAMILY.get(model_type, "qwen2.5")], directory)
    return directory


def from_directory(
    config: TrainerConfig, directory: Path, attention: Attention = Attention.SDPA, packing: bool = True
) -> TrainerConfig:
    """``config`` (of tests.trainer.runs.make_config) training the model in ``directory``: its own tokenizer,
    no typed architecture, the attention kernel ``attention``, documents packed or one per row."""
    return config.model_copy(
        update={
            "model": ModelConfig(name_or_path=str(directory)),
            "data": config.data.model_copy(update={"packing": packing}),
            "training": config.training.model_copy(update={"attention": attention}),
        }
    )
