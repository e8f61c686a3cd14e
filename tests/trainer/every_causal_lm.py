"""A tiny config.json of every causal-LM model type the installed ``transformers`` registers, from the type's own
defaults: what a model directory of that type could hold, at widths that build and trace in moments.

The defaults are shrunk generically, walking the config's integer fields (sub-configs and per-layer entries too):
every width (a field whose name says size, dim, rank...) that the shrink factor divides is divided by it, the
factor being the power of two that brings a head to :data:`HEAD_WIDTH` (so that ``heads x head_dim = hidden``,
``mamba heads x mamba head_dim = expand x hidden`` and the like still hold); counts are kept (heads, experts and
their top-k, groups), and so is anything naming a layer but the depth itself. Vocabularies are cut to
:data:`VOCAB` (token ids beyond it moved inside), the depth to the first layers that hold every layer type twice
(per-layer lists and per-layer dicts cut alike), and floats JSON cannot hold are written as ``save_pretrained``
writes them. Only a type whose defaults do not build or train at all gets fields of its own
(:data:`BUILDING_FIELDS`, each saying why).
"""

from __future__ import annotations

from typing import Any

WIDTH = 64
"""The hidden size the shrink aims at, for a model without attention heads."""
HEAD_WIDTH = 32
"""The head width the shrink aims at: no less, so that rotary halves of partial rotary factors stay whole."""
VOCAB = 512
MIN_DEPTH = 2
WIDTH_WORDS = ("size", "dim", "rank", "d_model", "d_ff", "embd", "inner", "ffn", "d_head", "ssm", "window", "state")
"""An integer field whose name holds one of these is a width (or a span of tokens): divided by the factor.
Anything naming a layer (indices, periods, per-layer input widths tied to other fields) is kept."""
BUILDING_FIELDS: dict[str, dict[str, Any]] = {
    # Defaults the model's code cannot build or train with: None where it reads a number, or what the config's own
    # validation refuses. The values are the released checkpoints' where there is one.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_theta": 1e4, "rope_type": "default"}}},
    "dbrx": {"attn_config": {"rope_theta": 5e5, "clip_qkv": 8}},  # both None: no rotary base, a clamp to nothing
    "deepseek_v2": {"num_experts_per_tok": 6, "moe_intermediate_size": 1408},  # top-k None; 1407: see nemotron_h
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1},  # all None
    "gemma3n_text": {"num_kv_shared_layers": 0},  # its last 15 of 35 layers reuse the keys of layers the cut drops
    # Its validation wants no per-layer inputs, which its text config's defaults (Gemma 4's) have:
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "hunyuan_v1_dense": {"head_dim": 128},  # None, where the attention's scale is read
    "hunyuan_v1_moe": {"head_dim": 128},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * 12, "num_hidden_layers": 24},  # None, read per layer
    "ministral": {"head_dim": 128},
    "nemotron": {"num_key_value_heads": 8},  # None, divided by
    # 7688 / 8 would leave expert rows of 961 bf16 elements, where grouped matmuls need rows of whole 16 bytes:
    "nemotron_h": {"moe_intermediate_size": 7680, "moe_shared_expert_intermediate_size": 7680},
    "qwen4_exp_text": {  # the indexed-attention layers' indexer sizes, all None
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 256,  # no less than the rotary dimension
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
    },
}
BUILDING_FIELDS["qwen4_exp"] = {"text_config": BUILDING_FIELDS["qwen4_exp_text"]}


def causal_lm_types() -> list[str]:
    """Every model type ``AutoModelForCausalLM`` maps, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> dict[str, Any]:
    """The type's default config shrunk (module docstring), as the JSON object of a config.json."""
    from transformers import AutoConfig, PretrainedConfig

    default = AutoConfig.for_model(model_type, **BUILDING_FIELDS.get(model_type, {}))
    try:
        text = default.get_text_config()
    except ValueError:  # several text configs (an encoder-decoder's): shrink by the top one
        text = default
    hidden = int(_field(text, "hidden_size") or WIDTH)
    heads = _field(text, "num_attention_heads")
    width, least = (hidden // heads, HEAD_WIDTH) if heads else (hidden, WIDTH)
    factor = 1
    while width % (2 * factor) == 0 and width // (2 * factor) >= least:
        factor *= 2
    depth = int(_field(text, "num_hidden_layers") or MIN_DEPTH)
    kinds = list(_field(text, "layer_types") or [])
    seconds = [[index for index, kind in enumerate(kinds) if kind == one][:2][-1] + 1 for one in set(kinds)]
    cut = min(depth, max([MIN_DEPTH, *seconds]))
    shrunk = _shrunk(default.to_dict(), factor, depth, cut)
    encoded: dict[str, Any] = PretrainedConfig._encode_special_floats(shrunk)  # as save_pretrained writes them
    return encoded


def _field(config: Any, name: str) -> Any:
    """A config field as its class reads it (``attribute_map`` included); a per-layer one's global value."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers refusing to read a field that varies per layer (Dots 3's heads) globally
        return config.to_dict().get(name)


def _shrunk(fields: dict[str, Any], factor: int, depth: int, cut: int) -> dict[str, Any]:
    return {key: _value(key, value, factor, depth, cut) for key, value in fields.items()}


def _value(key: str, value: Any, factor: int, depth: int, cut: int) -> Any:
    if isinstance(value, dict):
        if value and all(str(index).isdigit() for index in value):  # per layer, by index
            return {index: _value(key, entry, factor, depth, cut) for index, entry in value.items() if int(index) < cut}
        return _shrunk(value, factor, depth, cut)
    if isinstance(value, list):
        return [_value(key, entry, factor, depth, cut) for entry in (value[:cut] if len(value) == depth else value)]
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if "vocab_size" in key:
        return min(value, VOCAB)
    if key.endswith(("token_id", "token_index")):
        return min(value, VOCAB - 1)
    if "layer" in key or key.endswith("blocks"):
        return cut if value == depth else value
    if not any(word in key for word in WIDTH_WORDS) or value < factor or value % factor:
        return value
    return value // factor
