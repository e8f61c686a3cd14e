"""Model profiles: the inventory is exactly what transformers builds, and bitsandbytes, peft and the CLI agree.

Tiny configs of each new family keep their layer-type pattern and experts (2-4 layers, small widths); the
stored full-size configs are built on the meta device and their totals pinned (a drift fails here).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memfit.catalog.model_configs import stored_config_names, stored_config_path
from memfit.cli.main import main
from memfit.profile import ModelProfile, Role
from memfit_trainer.profile import attention_widths, build_meta_model, profile, read_config
from tests.stored_models import STORED_TOTALS

SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", "intermediate_size": 128, "num_hidden_layers": 2},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_5_text": {
        "model_type": "qwen3_5_text",
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "global_head_dim": 32,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 8,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 32,
    },
    "llama4_text": {
        "model_type": "llama4_text",
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
    },
    "ministral3": {"model_type": "ministral3", "intermediate_size": 128, "num_hidden_layers": 2},
}
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "llama4_text")
STORED_WIDTHS = {"qwen3-8b": (32, 8, 128), "qwen3.5-27b": (24, 4, 256), "gemma-4-31b": (32, 4, 512)}
"""Attention heads, key-value heads and head width of some stored configs (their text configs)."""


def tiny(family: str) -> dict[str, Any]:
    return {**SMALL, **TINY_CONFIGS[family]}


@pytest.fixture(scope="module")
def profiles() -> dict[str, ModelProfile]:
    return {family: profile(tiny(family), [("q_proj", "v_proj")]) for family in TINY_CONFIGS}


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_inventory_sums_to_what_transformers_builds(family: str, profiles: dict[str, ModelProfile]) -> None:
    built = build_meta_model(tiny(family))
    assert profiles[family].total_parameters == sum(parameter.numel() for parameter in built.parameters())
    assert len(profiles[family].layer_types) == built.config.num_hidden_layers


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_profiles_name_their_experts_and_keep_fused_experts_16_bit(
    family: str, profiles: dict[str, ModelProfile]
) -> None:
    result = profiles[family]
    assert result.experts is not None and result.experts.num_experts == TINY_CONFIGS[family].get(
        "num_experts", TINY_CONFIGS[family].get("num_local_experts")
    )
    experts = [group for group in result.tensors if group.role is Role.EXPERTS]
    assert experts and not any(group.quantizable for group in experts)
    assert all(len(group.shape) >= 2 and group.shape[0] == result.experts.num_experts for group in experts)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_quantizable_tensors_are_what_bitsandbytes_replaces(family: str, profiles: dict[str, ModelProfile]) -> None:
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    model = build_meta_model(tiny(family))
    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    replace_with_bnb_linear(
        model, modules_to_not_convert=skip, quantization_config=BitsAndBytesConfig(load_in_4bit=True)
    )
    replaced = {f"{name}.weight" for name, module in model.named_modules() if "4bit" in type(module).__name__}
    assert replaced and expand(profiles[family], quantizable=True) == replaced


def expand(result: ModelProfile, *, quantizable: bool) -> set[str]:
    """The parameter names of the profile's (non-)quantizable groups, the layer index written out."""
    return {
        group.name.replace("*", str(layer), 1) if group.layers else group.name
        for group in result.tensors
        if group.quantizable is quantizable
        for layer in (group.layers or (0,))
    }


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_lora_targets_are_what_peft_wraps(family: str, profiles: dict[str, ModelProfile]) -> None:
    """The adapters the trainer builds (its peft config) on a real model, module for module."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.contract.sections import LoraConfig
    from memfit_trainer.model import peft_lora_config

    torch.manual_seed(0)
    for resolution in profiles[family].lora:
        targets = resolution.target_modules
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny(family)))
        lora = LoraConfig(target_modules=[targets] if isinstance(targets, str) else list(targets), dropout=0.0)
        wrapped = get_peft_model(model, peft_lora_config(lora, model))
        names = {
            name.removeprefix("base_model.model.")
            for name, module in wrapped.named_modules()
            if isinstance(module, BaseTunerLayer)
        }
        assert resolution.names() == sorted(names)


def test_profile_json_round_trips(profiles: dict[str, ModelProfile]) -> None:
    for result in profiles.values():
        assert ModelProfile.model_validate_json(result.model_dump_json()) == result


def test_a_profile_of_another_version_is_refused(profiles: dict[str, ModelProfile]) -> None:
    data = json.loads(profiles["qwen3"].model_dump_json())
    with pytest.raises(ValueError, match="profile version"):
        ModelProfile.model_validate({**data, "version": 0})


def test_layer_types_and_windows_come_from_the_config(profiles: dict[str, ModelProfile]) -> None:
    assert profiles["qwen3_5_text"].layer_types.count("linear_attention") == 3
    assert profiles["gemma4_text"].sliding_window == 32
    gemma4_other = {group.name for group in profiles["gemma4_text"].tensors if group.role is Role.OTHER}
    assert "model.embed_tokens_per_layer.weight" in gemma4_other
    assert profiles["qwen3"].sliding_window is None


def test_tied_embeddings_have_no_lm_head(profiles: dict[str, ModelProfile]) -> None:
    result = profiles["gemma3_text"]
    assert result.tie_word_embeddings
    assert not [group for group in result.tensors if group.role is Role.LM_HEAD]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "no config.json"),
        ('{"model_type": "no_such_model"}', "unknown model_type"),
    ],
)
@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "model"
    if content is not None:
        path.mkdir()
        if content:
            (path / "config.json").write_text(content, encoding="utf-8")
    assert main(["profile", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error


@pytest.mark.slow
def test_cli_prints_the_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "gpt-oss-20b"]) == 0
    text = capsys.readouterr().out
    assert "GptOssForCausalLM" in text and "experts: 32, 4 per token, in 24 layers" in text
    assert main(["profile", "qwen3-8b", "-o", "json"]) == 0
    assert ModelProfile.model_validate_json(capsys.readouterr().out).total_parameters == STORED_TOTALS["qwen3-8b"]


def test_every_stored_config_has_a_golden_total() -> None:
    assert stored_config_names() == sorted(STORED_TOTALS)


@pytest.mark.parametrize("name", list(STORED_TOTALS))
@pytest.mark.slow  # each builds a real-size model on the meta device
def test_stored_configs_build_to_their_golden_totals(name: str) -> None:
    path = stored_config_path(name)
    assert path is not None
    result = profile(read_config(path))
    assert result.total_parameters == STORED_TOTALS[name]
    quantized = sum(group.numel for group in result.tensors if group.quantizable)
    assert 0 < quantized == result.quantizable_parameters < result.total_parameters
    assert all(not group.quantizable for group in result.tensors if group.role is Role.EXPERTS)
    widths = (result.num_attention_heads, result.num_key_value_heads, result.head_dim)
    assert widths == STORED_WIDTHS.get(name, widths) and result.num_attention_heads % result.num_key_value_heads == 0


def test_attention_widths_are_the_full_attention_layers(profiles: dict[str, ModelProfile]) -> None:
    """Gemma 4's full-attention layers are wider (``global_head_dim``) than its sliding ones."""
    for family, result in profiles.items():
        head_dim = TINY_CONFIGS[family].get("global_head_dim", SMALL["head_dim"])
        assert (result.num_attention_heads, result.num_key_value_heads, result.head_dim) == (4, 2, head_dim)


def test_head_width_defaults_to_the_hidden_size_over_the_heads() -> None:
    text = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=None, head_dim=None)
    assert attention_widths(text) == {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16}
    assert attention_widths(SimpleNamespace(hidden_size=64, num_attention_heads=4))["head_dim"] == 16


@pytest.mark.slow
def test_activations_are_traced_for_full_and_lora_when_asked() -> None:
    result = profile(tiny("qwen3"), activations=True)
    assert result.activations is not None
    full, lora = result.activations.full, result.activations.lora
    assert [layer.layer_type for layer in full.layers] == [layer.layer_type for layer in lora.layers]
    assert (result.activations.lora_rank, result.activations.lora_dropout) == (16, 0.05)
    assert full != lora and ModelProfile.model_validate_json(result.model_dump_json()) == result


def test_the_lm_head_stays_16_bit(profiles: dict[str, ModelProfile]) -> None:
    lm_head = [group for group in profiles["qwen3"].tensors if group.role is Role.LM_HEAD]
    assert [group.name for group in lm_head] == ["lm_head.weight"] and not lm_head[0].quantizable


@pytest.mark.slow
def test_all_linear_leaves_out_linears_with_a_forward_of_their_own_and_llama4_lora_trains() -> None:
    """Llama 4's router is an ``nn.Linear`` whose forward returns a tuple: peft's adapter on it would fail in
    the first step, so ``all-linear`` leaves it out, and the traced LoRA step of the model succeeds."""
    result = profile(tiny("llama4_text"), activations=True)
    (all_linear,) = [resolution for resolution in result.lora if resolution.target_modules == "all-linear"]
    assert all_linear.modules and not any("router" in group.name for group in all_linear.modules)
    assert result.activations is not None
    assert result.activations.lora is not None and result.activations.lora_failure is None


def test_profiling_leaves_the_config_as_the_file_has_it_and_names_its_sha256() -> None:
    """transformers edits a config's nested dicts as it reads them (Llama 3.1's ``rope_scaling``): the profiler reads
    a copy, so the profile's ``config_sha256`` is the file's own, the one ``memfit plan`` looks a model up by."""
    from memfit.profile import canonical_config_sha256
    from memfit_trainer.activation_profile import TracedModel

    path = stored_config_path("llama-3.1-8b")
    assert path is not None
    config = read_config(path)
    as_read = json.loads(json.dumps(config))
    TracedModel.of(config)
    assert profile(config).config_sha256 == canonical_config_sha256(as_read)
    assert config == as_read
