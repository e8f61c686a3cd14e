"""QLoRA's model as the trainer builds it (memfit_trainer.model.prepare_adapter_base, not peft's
``prepare_model_for_kbit_training``): 4-bit base linears, everything else in bf16 from loading on (no fp32
upcast), the base frozen, the adapters trainable in bf16, and it learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit_trainer.model import build_model
from tests.trainer.runs import SEQUENCE_LENGTH, TINY_LLAMA, make_config

pytest.importorskip("bitsandbytes")


def qlora_model(tmp_path: Path, gradient_checkpointing: bool) -> torch.nn.Module:
    config = make_config(tmp_path, method="qlora", stage=0, offload=False, optimizer="adamw8bit")
    training = config.training.model_copy(update={"gradient_checkpointing": gradient_checkpointing})
    return build_model(config.model_copy(update={"training": training})).model


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_no_parameter_is_upcast_to_fp32(tmp_path: Path, gradient_checkpointing: bool) -> None:
    """Every parameter is 4-bit (the decoder's linears, frozen) or bf16: the embedding, LM head and norms
    (frozen) and the adapters (trained). The only fp32 tensors are buffers, the rotary embedding's inverse
    frequencies, which transformers keeps in fp32 on purpose."""
    model = qlora_model(tmp_path, gradient_checkpointing)
    kinds = {(type(p).__name__, p.dtype, p.requires_grad) for p in model.parameters()}
    assert kinds == {
        ("Params4bit", torch.uint8, False),
        ("Parameter", torch.bfloat16, False),
        ("Parameter", torch.bfloat16, True),
    }
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    frozen_16bit = {name.rsplit(".", 2)[-2] for name, p in model.named_parameters()
                    if p.dtype == torch.bfloat16 and not p.requires_grad}  # fmt: skip
    assert {"embed_tokens", "lm_head", "norm", "input_layernorm", "post_attention_layernorm"} <= frozen_16bit
    assert {n.rsplit(".", 1)[-1] for n, b in model.named_buffers() if b.dtype == torch.float32} <= {
        "inv_freq",
        "original_inv_freq",
    }
    base = model.get_base_model()
    assert base.is_gradient_checkpointing == gradient_checkpointing
    embedded = base.get_input_embeddings()(torch.zeros(1, 4, dtype=torch.long))
    assert embedded.dtype == torch.bfloat16 and embedded.requires_grad == gradient_checkpointing


@pytest.mark.slow
def test_the_tiny_qlora_model_learns(tmp_path: Path) -> None:
    """A few AdamW steps on the adapters (one process, no DeepSpeed: the trainer's own runs are in
    test_training.py) lower the loss on a repeated batch, through the 4-bit base and checkpointed layers."""
    model = qlora_model(tmp_path, gradient_checkpointing=True)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    batch = torch.randint(0, TINY_LLAMA.vocab_size, (2, SEQUENCE_LENGTH))
    losses = []
    for _ in range(12):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
