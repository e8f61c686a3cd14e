"""Exact parameter counts: published numbers, and the real ``transformers`` modules on the meta device."""

from __future__ import annotations

import pytest

from memfit.api.finetunejob import Architecture
from memfit.catalog.models import MODEL_PRESETS, model_preset
from memfit.model_shape import ModelFamily, Role

PUBLISHED = {  # sum(p.numel()) as the model cards and the Hub's safetensors metadata give them
    "llama-2-7b": 6_738_415_616,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.1": 7_241_732_096,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_parameter_counts(preset: str) -> None:
    assert MODEL_PRESETS[preset].parameter_count == PUBLISHED[preset]


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
@pytest.mark.slow
def test_counts_equal_the_transformers_model(preset: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memfit_trainer.hf_config import transformers_config

    shape = MODEL_PRESETS[preset]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers_config(shape))
    assert sum(p.numel() for p in model.parameters()) == shape.parameter_count
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not shape.is_moe:  # transformers 5 fuses MoE experts into 3-d parameters
        assert {m.name for m in shape.layer_linears} <= linear_names


def test_lora_parameters_on_all_linear() -> None:
    shape = MODEL_PRESETS["llama-2-7b"]
    per_layer = 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert shape.lora_parameters(16, ("all-linear",)) == 32 * per_layer


def test_unknown_lora_target_names_the_family_modules() -> None:
    with pytest.raises(ValueError, match="unknown LoRA target module.*qkv_proj"):
        MODEL_PRESETS["llama-2-7b"].lora_parameters(8, ("qkv_proj",))
    assert MODEL_PRESETS["phi-3-mini"].lora_parameters(8, ("qkv_proj",)) > 0


def test_explicit_architecture_equals_the_preset() -> None:
    explicit = Architecture.model_validate(
        {
            "family": "qwen2",
            "hiddenSize": 896,
            "intermediateSize": 4864,
            "numLayers": 24,
            "numAttentionHeads": 14,
            "numKeyValueHeads": 2,
            "vocabSize": 151936,
            "tieWordEmbeddings": True,
        }  # fmt: skip
    )
    assert explicit.shape() == MODEL_PRESETS["qwen2.5-0.5b"]
    assert explicit.shape().family is ModelFamily.QWEN2


@pytest.mark.parametrize(
    "document, message",
    [
        ({"preset": "llama-2-7b", "hiddenSize": 10}, "either `preset` or the explicit sizes"),
        ({"hiddenSize": 64}, "without a `preset`, these sizes are required: intermediateSize"),
        (
            {
                "hiddenSize": 64,
                "intermediateSize": 128,
                "numLayers": 2,
                "numAttentionHeads": 6,
                "numKeyValueHeads": 4,
                "vocabSize": 100,
            },
            "must be a multiple of numKeyValueHeads",
        ),  # fmt: skip
    ],
)
def test_architecture_errors(document: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Architecture.model_validate(document)


@pytest.mark.parametrize(
    ("preset", "mlp"),
    [
        ("phi-3-mini", ("gate_up_proj", "down_proj")),  # its last three linears include o_proj
        ("llama-3.1-8b", ("gate_proj", "up_proj", "down_proj")),
        ("mixtral-8x7b", ("gate_up_proj", "down_proj")),  # transformers 5's fused experts; not the router
    ],
)
def test_the_mlp_is_selected_by_role_not_position(preset: str, mlp: tuple[str, ...]) -> None:
    assert tuple(m.name for m in model_preset(preset).linears_of(Role.MLP, Role.EXPERTS)) == mlp
