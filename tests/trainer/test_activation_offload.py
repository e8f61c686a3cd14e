"""Activation offloading (``memfit_trainer.activation_offload``): the checkpointed layers' saved inputs really
leave the device between forward and backward, come back for it, and change nothing in the numbers; a
2-rank run with ``training.activationOffloading`` learns, and resumes from its checkpoint exactly."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer.activation_offload import CHECKPOINT_FUNCTION, ActivationOffload, offload_activations
from memfit_trainer.chunked_loss import causal_lm_loss, unwrap_causal_lm
from memfit_trainer.hf_config import transformers_config
from tests.trainer.runs import assert_same_final_weights, logged_losses, make_config, uninterrupted_and_resumed

LAYERS = 4
TINY = {
    "llama": ModelShape(ModelFamily.LLAMA, 32, 64, LAYERS, 4, 2, 97),
    "qwen2 tied": ModelShape(ModelFamily.QWEN2, 32, 64, LAYERS, 4, 2, 97, tie_word_embeddings=True),
    "gemma2": ModelShape(ModelFamily.GEMMA2, 32, 64, LAYERS, 4, 2, 97, head_dim=8, tie_word_embeddings=True),
}
BATCH, SEQUENCE = 2, 19  # a layer input of 2 x 19 x 32 values: above MIN_OFFLOAD_BYTES in fp32 and bf16


def _model(name: str, lora: bool, dtype: torch.dtype = torch.float32) -> Any:
    """The trainer's setup of a tiny random model: non-reentrant checkpointing, LoRA adapters on top."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        transformers_config(TINY[name], use_cache=False), dtype=dtype, attn_implementation="eager"
    )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.1))
    return model.train()


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (BATCH, SEQUENCE), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100
    return {"input_ids": input_ids, "labels": labels}


def _loss_and_gradients(model: Any, chunked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(2)  # the same dropout masks in both runs
    batch = _batch()
    loss = causal_lm_loss(model, unwrap_causal_lm(model), batch) if chunked else model(**batch).loss
    loss.backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


@pytest.mark.parametrize("chunked", [False, True], ids=["model-loss", "chunked-loss"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.slow
def test_loss_and_gradients_equal_those_without_offloading(name: str, lora: bool, chunked: bool) -> None:
    """The inputs make a round trip through separate host tensors: the step computes exactly the same."""
    model = _model(name, lora)
    expected_loss, expected = _loss_and_gradients(model, chunked)
    with offload_activations(model) as offload:
        loss, gradients = _loss_and_gradients(model, chunked)
    assert torch.equal(loss, expected_loss)
    assert gradients.keys() == expected.keys() and gradients
    for parameter, gradient in gradients.items():
        assert torch.equal(gradient, expected[parameter]), parameter
    # One saved input per checkpointed layer and forward pass; LoRA's first (a leaf that requires grad) stays.
    offloaded = LAYERS - 1 if lora else LAYERS
    assert offload.stats.packed == LAYERS
    assert offload.stats.offloaded == offload.stats.fetched == offloaded
    # The last layer's input (the first backward needs) and the first one offloaded come back when asked for.
    assert offload.stats.prefetched == offloaded - 2


def test_bf16_inputs_are_offloaded_too() -> None:
    model = _model("llama", lora=False, dtype=torch.bfloat16)
    expected_loss, expected = _loss_and_gradients(model, chunked=False)
    with offload_activations(model) as offload:
        loss, gradients = _loss_and_gradients(model, chunked=False)
    assert offload.stats.offloaded == LAYERS
    assert offload.stats.offloaded_bytes == LAYERS * BATCH * SEQUENCE * 32 * 2
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(gradients[n], expected[n]) for n in expected)


def _inputs_alive_after_forward(model: Any) -> list[bool]:
    """Whether each checkpointed layer's input still exists when the forward pass has ended."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    storages: list[weakref.ref[torch.UntypedStorage]] = []

    def remember(module: Any, args: tuple[Any, ...]) -> None:
        storages.append(weakref.ref(args[0].untyped_storage()))

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    handles = [layer.register_forward_pre_hook(remember) for layer in layers]
    try:
        loss = model(**_batch()).loss
        gc.collect()
        alive = [ref() is not None for ref in storages]
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return alive


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.slow
def test_the_layer_inputs_are_freed_between_forward_and_backward(lora: bool) -> None:
    """Checkpointing alone keeps every layer's input until the backward pass; offloaded, only the host
    copies remain (with LoRA, the first layer's input stays: autograd keeps that leaf anyway)."""
    model = _model("llama", lora)
    assert _inputs_alive_after_forward(model) == [True] * LAYERS
    with offload_activations(model):
        assert _inputs_alive_after_forward(model) == [lora] + [False] * (LAYERS - 1)


def test_a_retained_graph_is_back_propagated_twice() -> None:
    """Each backward pass brings the inputs back again: the host copies live as long as the graph."""
    model = _model("llama", lora=False)
    with offload_activations(model) as offload:
        loss = model(**_batch()).loss
        first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert offload.stats.fetched == 2 * LAYERS


def test_remove_gives_the_layers_their_checkpoint_function_back() -> None:
    model = _model("llama", lora=False)
    originals = [getattr(layer, CHECKPOINT_FUNCTION) for layer in model.model.layers]
    offload = ActivationOffload(model)
    assert offload.layers == list(model.model.layers)
    assert all(getattr(layer, CHECKPOINT_FUNCTION) is not f for layer, f in zip(offload.layers, originals, strict=True))
    assert "4 checkpointed layers" in offload.describe()
    offload.remove()
    assert all(getattr(layer, CHECKPOINT_FUNCTION) is f for layer, f in zip(offload.layers, originals, strict=True))
    model(**_batch()).loss.backward()
    assert offload.stats.packed == 0


def test_a_model_without_checkpointed_layers_is_refused() -> None:
    from transformers import AutoModelForCausalLM

    from memfit.contract.reader import ConfigError

    model = AutoModelForCausalLM.from_config(transformers_config(TINY["llama"], use_cache=False))
    with pytest.raises(ConfigError, match="activationOffloading"):
        offload_activations(model)


def test_the_config_needs_gradient_checkpointing(tmp_path: Path) -> None:
    document = make_config(tmp_path).model_dump(by_alias=True)
    document["training"].update(activationOffloading=True, gradientCheckpointing=False)
    with pytest.raises(ValueError, match="activationOffloading"):
        TrainerConfig.model_validate(document)
    document["training"]["gradientCheckpointing"] = True
    assert TrainerConfig.model_validate(document).training.activation_offloading


def offloading_config(tmp_path: Path, **options: Any) -> TrainerConfig:
    """``make_config`` with checkpointing and offloading, on a 4-layer tiny llama (so that inputs are
    prefetched: the first one offloaded never is)."""
    document = make_config(tmp_path, **options).model_dump(by_alias=True)
    document["training"].update(activationOffloading=True, gradientCheckpointing=True)
    document["model"]["architecture"]["numLayers"] = LAYERS
    return TrainerConfig.model_validate(document)


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["full", "lora"])
def test_offloading_run_learns_and_resumes_from_its_checkpoint(tmp_path: Path, method: str) -> None:
    from tests.trainer.test_training import RESUME_EVERY, assert_learned

    steps = 16
    options: dict[str, Any] = dict(
        method=method, stage=2, offload=False, max_steps=steps, checkpoint_every=RESUME_EVERY
    )
    if method == "lora":
        options["learning_rate"] = 1e-2
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference, config = (offloading_config(tmp_path / name, **options) for name in ("reference", "killed"))
    done, resumed = uninterrupted_and_resumed(reference, config, RESUME_EVERY)
    assert f"activation offloading: the saved inputs of {LAYERS} checkpointed layers wait in cpu memory" in done.stdout
    offloaded = LAYERS if method == "full" else LAYERS - 1  # LoRA's first input stays (a leaf autograd keeps)
    moved, back = steps * offloaded, steps * (offloaded - 2)  # per rank; see the unit test for the prefetches
    assert f"activation offloading: {moved} layer inputs " in done.stdout
    assert f"came back {moved} times ({back} prefetched)" in done.stdout
    reference_losses = logged_losses(done.stdout)
    assert_learned(reference_losses, steps, margin=1.0 if method == "full" else 0.3)
    assert logged_losses(resumed.stdout)[steps] == reference_losses[steps]
    weights = "model.safetensors" if method == "full" else "adapter_model.safetensors"
    assert_same_final_weights(config.output_dir, reference.output_dir, weights)
