"""The chunked cross-entropy (``memfit_trainer.chunked_loss``) against the plain loss: same value and
gradients within floating-point tolerance, on its own and inside real ``transformers`` models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfit.contract.sections import TrainingConfig
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer.chunked_loss import (
    PYTORCH,
    as_forward_of,
    causal_lm_loss,
    chunked_cross_entropy,
    select_kernel,
    shift_labels,
    unwrap_causal_lm,
)
from memfit_trainer.hf_config import transformers_config
from tests.trainer.runs import make_config

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""Largest difference relative to the reference's largest magnitude (bf16 accumulates the head's gradient
chunk by chunk in bf16, as fused kernels do)."""


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = expected.float().abs().max().clamp(min=1e-12)
    return bool(((actual.float() - expected.float()).abs().max() / scale) <= TOLERANCE[dtype])


def plain_loss(hidden, weight, labels, bias=None, softcap=None):
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_tokens", [1, 7, 32, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_loss_and_gradients_equal_the_plain_cross_entropy(dtype, chunk_tokens, bias, softcap) -> None:
    torch.manual_seed(0)
    batch, sequence, hidden_size, vocab = 3, 23, 16, 61  # 66 tokens: chunks of 7 and 32 end mid-way
    hidden = torch.randn(batch, sequence, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * 0.3).to(dtype).requires_grad_()
    head_bias = (torch.randn(vocab) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (batch, sequence))
    labels[0, :9] = -100  # ignored tokens
    labels[2, 5] = -100
    shifted = shift_labels(labels)
    inputs = [hidden, weight] + ([head_bias] if bias else [])

    expected = plain_loss(hidden, weight, shifted, head_bias, softcap)
    expected_grads = torch.autograd.grad(expected, inputs)
    actual = chunked_cross_entropy(hidden, weight, shifted, bias=head_bias, softcap=softcap, chunk_tokens=chunk_tokens)
    actual_grads = torch.autograd.grad(actual, inputs)

    assert actual.dtype == torch.float32
    assert torch.allclose(actual, expected, rtol=1e-5 if dtype == torch.float32 else 1e-3)
    for got, want in zip(actual_grads, expected_grads, strict=True):
        assert got.dtype == want.dtype
        assert close(got, want, dtype)


def test_shift_labels_is_the_causal_lm_shift() -> None:
    labels = torch.tensor([[1, 2, 3], [4, 5, -100]])
    assert shift_labels(labels).tolist() == [[2, 3, -100], [5, -100, -100]]


def test_cpu_uses_the_pure_pytorch_function() -> None:
    assert select_kernel(torch.device("cpu"))[0] == PYTORCH


def _model(shape: ModelShape, dtype: torch.dtype, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = transformers_config(shape, use_cache=False, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").train()


TINY = {
    "llama": ModelShape(ModelFamily.LLAMA, 32, 64, 2, 4, 2, 97),
    "qwen2 tied": ModelShape(ModelFamily.QWEN2, 32, 64, 2, 4, 2, 97, tie_word_embeddings=True),
    "gemma2 soft-capped tied": ModelShape(ModelFamily.GEMMA2, 32, 64, 2, 4, 2, 97, head_dim=8,
                                          tie_word_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(TINY))
def test_model_loss_and_parameter_gradients_equal_the_models_own(name: str, dtype: torch.dtype) -> None:
    """The trainer's path (decoder without logits, the head inside the loss) against ``outputs.loss``:
    tied embeddings get both gradients, Gemma 2's logits are soft-capped."""
    model = _model(TINY[name], dtype)
    if name.startswith("gemma2"):
        assert model.config.final_logit_softcapping
    input_ids = torch.randint(0, 97, (2, 19))
    labels = input_ids.clone()
    labels[1, :4] = -100
    batch = {"input_ids": input_ids, "labels": labels}

    expected = model(**batch).loss
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    actual = causal_lm_loss(model, unwrap_causal_lm(model), batch, lambda *a, **k: chunked_cross_entropy(
        *a, **k, chunk_tokens=5))  # fmt: skip
    actual.backward()

    assert torch.allclose(actual, expected.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2)
    for n, p in model.named_parameters():
        assert close(p.grad, expected_grads[n], dtype), n


def test_lora_model_trains_only_the_adapters_through_the_chunked_loss() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(TINY["llama"], torch.float32), LoraConfig(r=4, target_modules="all-linear"))
    batch = {"input_ids": torch.randint(0, 97, (2, 11)), "labels": torch.randint(0, 97, (2, 11))}
    expected = model(**batch).loss
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    causal_lm_loss(model, unwrap_causal_lm(model), batch).backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, n
        if p.requires_grad:
            assert close(p.grad, expected_grads[n], torch.float32), n


def test_the_config_takes_the_chunked_loss_at_any_zero_stage(tmp_path) -> None:
    for stage in (0, 2, 3):
        assert make_config(tmp_path, stage=stage, offload=False, chunked_loss=True).training.chunked_loss
    assert TrainingConfig.model_fields["chunked_loss"].default is False


def test_a_computation_runs_as_a_modules_forward_through_its_hooks() -> None:
    """How ZeRO-3 gathers the LM head's weight for the loss (its hooks are the module's): the computation sees
    what the pre-forward hook set up, the post-forward hook sees its output, and the module's own forward comes
    back, also when the computation raises."""
    head = torch.nn.Linear(4, 3)
    seen: list[str] = []
    head.register_forward_pre_hook(lambda module, args: seen.append("gathered"))
    head.register_forward_hook(lambda module, args, output: seen.append(f"released after {output.tolist()}"))

    def loss(x: torch.Tensor) -> torch.Tensor:
        seen.append("loss")
        return x.sum()

    assert as_forward_of(head, loss, torch.ones(2, 4)).item() == 8.0
    assert seen == ["gathered", "loss", "released after 8.0"]
    assert "forward" not in head.__dict__ and head(torch.ones(1, 4)).shape == (1, 3)  # the class's forward

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory")

    own = head.forward = lambda x: x  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        as_forward_of(head, fails, torch.ones(1, 4))
    assert head.forward is own
