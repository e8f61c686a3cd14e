"""Every preset's numbers against what its own ``transformers`` code builds and what peft really adapts.

``ModelShape`` is a per-family formula; the profiler builds the same model on the meta device, lets
transformers' bitsandbytes rule pick what 4-bit would quantize and lets peft inject LoRA into it. The two
must agree on the parameter count, the quantized weights and the adapters' size: in transformers 5 an MoE's
experts are fused 3-D parameters, which bitsandbytes leaves in 16 bits and peft adapts through
``ParamWrapper``, so a formula written for ``nn.Linear`` experts gets all three of QLoRA's numbers wrong. Where
a preset is planned from its stored profile with flash attention, the traced layer and the formula's agree.
"""

from __future__ import annotations

import math
import warnings

import pytest

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.catalog.model_configs import stored_profile
from memfit.catalog.models import MODEL_PRESETS
from memfit.memory.activations import ActivationSetup, saved_per_layer
from memfit.memory.setup import Adapters
from memfit.memory.states import trainable_tensors
from memfit.model_shape import ModelShape, Role
from memfit_trainer.hf_config import transformers_config
from memfit_trainer.profile import profile

RANK = 16


def explicit_targets(shape: ModelShape) -> list[tuple[str, ...]]:
    """Two explicit lists: two attention projections (Phi-3 fuses them: qkv_proj) and the MLP's or experts'."""
    attention = ("q_proj", "v_proj") if shape.family != "phi3" else ("qkv_proj",)
    mlp = tuple(name for m in shape.linears_of(Role.MLP, Role.EXPERTS) for name in m.target_names)
    return [attention, mlp]


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_preset_matches_its_profile(preset: str) -> None:
    shape = MODEL_PRESETS[preset]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's and transformers' notes on meta models
        built = profile(transformers_config(shape).to_dict(), explicit_targets(shape))
    assert shape.parameter_count == built.total_parameters
    assert shape.quantizable_parameters == built.quantizable_parameters
    for resolution in built.lora:
        named = resolution.target_modules
        targets = (named,) if isinstance(named, str) else named
        assert shape.lora_parameters(RANK, targets) == resolution.adapter_parameters(RANK), targets
        tensors = trainable_tensors(shape, "lora", Adapters(RANK, targets))
        assert sum(math.prod(tensor) * count for tensor, count in tensors) == resolution.adapter_parameters(RANK)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.2-1b"])
def test_a_layer_on_an_unmasked_row_is_the_family_formulas_flash_layer(preset: str) -> None:
    """What a stored profile's layer keeps on an unmasked row (flash attention's memory, planned from it) and what
    the family's formula counts for flash attention: within 10%, at a short and a long sequence (traced, a layer
    keeps about 4% more, the same gap as SDPA's on a packed row, ``tests/test_activation_profile.py``)."""
    stored = stored_profile(preset)
    assert stored is not None and stored.activations is not None and stored.activations.unmasked is not None
    traced = stored.activations.unmasked.full.layer("full_attention").saved
    for tokens in (4096, 131072):
        setup = ActivationSetup(Method.FULL, Precision.BF16, False, 1, tokens, Attention.FLASH)
        ratio = traced.bytes(tokens) / saved_per_layer(MODEL_PRESETS[preset], setup)
        assert ratio == pytest.approx(1.0, abs=0.10), ratio
