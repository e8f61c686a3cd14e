"""The families users fine-tune beyond the first six, trained for real from model directories.

Each tiny family (tests.trainer.new_families) trains once, on 2 CPU ranks for 3 optimizer steps, the engines
and methods spread across them so that the file stays within a few minutes:

=============  ==========  ==========================  =================================================
family         method      engine                      also covers
=============  ==========  ==========================  =================================================
qwen3          full        deepspeed ZeRO-3            loading partitioned (zero.Init) from a directory
qwen3_moe      LoRA        fsdp2                       fused 3-D experts under ``all-linear`` adapters
gemma3_text    full        deepspeed ZeRO-2            sliding/full layers, chunked loss with soft-capping
gpt_oss        QLoRA       deepspeed ZeRO-2            eager attention (no SDPA), 16-bit fused experts
qwen3_5_text   full        fsdp2                       Gated DeltaNet layers (unpacked), activation offload
gemma4_text    QLoRA       fsdp2                       sliding/global layers with their own heads, per-layer
                                                       inputs, 4-bit linears under ``all-linear`` adapters
llama4_text    LoRA        fsdp2                       chunked attention, dense and routed layers (its router
                                                       left out of ``all-linear``), the chunked loss
ministral3     full        fsdp2                       Ministral 3's decoder from its own model type
=============  ==========  ==========================  =================================================

Without a distributed run: the chunked loss equals the model's own (soft-capped) loss, and an attention
kernel the model class does not implement is one line at preflight (exit 2), not a traceback at load.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from memfit.api.vocabulary import Attention
from memfit.contract.reader import ConfigError
from memfit.contract.termination import config_error_message
from memfit_trainer.chunked_loss import causal_lm_loss, chunked_cross_entropy
from memfit_trainer.preflight import check
from tests.trainer.chat_families import VOCAB_SIZE
from tests.trainer.new_families import NEW_FAMILIES, from_directory, tiny_config, write_model_directory
from tests.trainer.runs import logged_losses, make_config, run_single_process, run_trainer, write_config

STEPS = 3
RUNS: dict[str, dict[str, Any]] = {
    "qwen3": {"method": "full", "engine": "deepspeed", "stage": 3, "offload": False},
    "qwen3_moe": {"method": "lora", "engine": "fsdp2", "stage": 2, "offload": False, "learning_rate": 1e-2},
    "gemma3_text": {"method": "full", "engine": "deepspeed", "stage": 2, "offload": False, "chunked_loss": True},
    "gpt_oss": {"method": "qlora", "engine": "deepspeed", "stage": 2, "offload": False, "learning_rate": 1e-2},
    "qwen3_5_text": {"method": "full", "engine": "fsdp2", "stage": 3, "offload": False, "activation_offloading": True},
    "gemma4_text": {"method": "qlora", "engine": "fsdp2", "stage": 2, "offload": False, "learning_rate": 1e-2},
    "llama4_text": {"method": "lora", "engine": "fsdp2", "stage": 2, "offload": False, "chunked_loss": True},
    "ministral3": {"method": "full", "engine": "fsdp2", "stage": 2, "offload": False},
}
ATTENTION = {"gpt_oss": Attention.EAGER}
"""gpt-oss has no SDPA attention in transformers; the others train with SDPA."""
UNPACKED = {"qwen3_5_text"}
"""Without flash-linear-attention, Gated DeltaNet layers cannot keep packed documents apart."""


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", list(RUNS))
def test_new_family_trains_from_its_model_directory(tmp_path: Path, model_type: str) -> None:
    options = RUNS[model_type]
    directory = write_model_directory(model_type, tmp_path / "model")
    config = from_directory(
        make_config(tmp_path, max_steps=STEPS, checkpoint_every=STEPS, name=model_type, **options),
        directory,
        ATTENTION.get(model_type, Attention.SDPA),
        packing=model_type not in UNPACKED,
    )
    result = run_trainer(write_config(config, tmp_path / "config.json"))
    assert result.returncode == 0, result.stderr[-6000:]
    losses = logged_losses(result.stdout)
    assert set(losses) >= {1, STEPS} and all(math.isfinite(loss) for loss in losses.values()), result.stdout
    final = Path(config.output_dir) / "final"
    if options["method"] == "full":
        weights = load_file(final / "model.safetensors")
        assert weights.keys() >= {name for name in load_file(directory / "model.safetensors")}
    else:
        adapter = load_file(final / "adapter_model.safetensors")
        assert adapter and all("lora_" in name for name in adapter)
        assert not (final / "model.safetensors").exists()
        if model_type == "qwen3_moe":  # the experts' fused weights get adapters too
            assert any("experts" in name for name in adapter), sorted(adapter)
    assert (final / "tokenizer.json").is_file()


def test_chunked_loss_is_the_models_own_soft_capped_loss() -> None:
    """Gemma 3 caps its logits (``final_logit_softcapping``) before the loss: the chunked loss must too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("gemma3_text", final_logit_softcapping=2.0)  # low: the cap changes the loss a lot
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100)  # logits far beyond the cap
    ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    own = model(**batch).loss.detach()
    chunked = causal_lm_loss(model, model, batch, lambda *a, **k: chunked_cross_entropy(*a, **k, chunk_tokens=7))
    torch.testing.assert_close(chunked.detach(), own, rtol=1e-5, atol=1e-5)
    uncapped = causal_lm_loss(model, model, batch, lambda *a, **k: chunked_cross_entropy(*a, **{**k, "softcap": None}))
    assert abs(float(uncapped.detach()) - float(own)) > 0.5  # the cap matters: the comparison above means something


@pytest.mark.parametrize("model_type", sorted(NEW_FAMILIES))
def test_the_chunked_loss_and_its_gradients_are_the_models_own(model_type: str) -> None:
    """The planner chooses the chunked loss for any profiled model (its terms are traced): on every family it
    is the model's own loss, and the gradients of every parameter agree (fused experts, Gated DeltaNet and
    per-layer inputs included)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager", dtype=torch.float32)
    ids = torch.randint(0, VOCAB_SIZE, (2, 24))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}

    def gradients(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    own = model(**batch).loss
    own_gradients = gradients(own)
    chunked = causal_lm_loss(model, model, batch, lambda *a, **k: chunked_cross_entropy(*a, **k, chunk_tokens=7))
    torch.testing.assert_close(chunked.detach(), own.detach(), rtol=1e-5, atol=1e-5)
    chunked_gradients = gradients(chunked)
    assert chunked_gradients.keys() == own_gradients.keys()
    for name, gradient in own_gradients.items():
        torch.testing.assert_close(chunked_gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_preflight_refuses_an_attention_kernel_the_model_does_not_implement(tmp_path: Path) -> None:
    directory = write_model_directory("gpt_oss", tmp_path / "model")
    config = from_directory(make_config(tmp_path, max_steps=STEPS), directory, Attention.SDPA)
    with pytest.raises(ConfigError) as refused:
        check(config, {"WORLD_SIZE": "2"})
    message = str(refused.value)
    assert "\n" not in message
    assert "GptOssForCausalLM" in message and "sdpa" in message and "eager" in message, message
    check(from_directory(config, directory, Attention.EAGER), {"WORLD_SIZE": "2"})


def test_preflight_refuses_packing_that_linear_attention_layers_would_leak_across(tmp_path: Path) -> None:
    """Qwen3.5's Gated DeltaNet layers carry their state along the row: packed documents would see one
    another (transformers keeps them apart only with flash-linear-attention)."""
    directory = write_model_directory("qwen3_5_text", tmp_path / "model")
    config = from_directory(make_config(tmp_path, max_steps=STEPS), directory)
    with pytest.raises(ConfigError, match=r"^data.packing: .*Qwen3_5ForCausalLM.*set data.packing false$"):
        check(config, {"WORLD_SIZE": "2"})
    check(from_directory(config, directory, packing=False), {"WORLD_SIZE": "2"})


@pytest.mark.slow
def test_trainer_exits_2_with_one_line_for_an_unimplemented_attention_kernel(tmp_path: Path) -> None:
    directory = write_model_directory("gpt_oss", tmp_path / "model")
    config = from_directory(make_config(tmp_path, max_steps=STEPS, world_size=1), directory, Attention.SDPA)
    result = run_single_process(write_config(config, tmp_path / "config.json"))
    assert result.returncode == 2, result.stderr[-4000:]
    message = config_error_message(config.termination_log)
    assert message is not None and "GptOssForCausalLM" in message and "\n" not in message, message
    assert "Traceback" not in result.stderr, result.stderr[-4000:]


@pytest.mark.parametrize("model_type", list(RUNS))
def test_the_no_split_layers_are_the_checkpointed_layers(model_type: str) -> None:
    """fsdp2 shards the modules of ``_no_split_modules``; checkpointing and activation offloading act on
    ``GradientCheckpointingLayer``s: for every family they are the same decoder layers, one per layer."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from memfit_trainer.fsdp2_engine import decoder_layers

    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    checkpointed = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert decoder_layers(model) == checkpointed and len(checkpointed) == config.num_hidden_layers
