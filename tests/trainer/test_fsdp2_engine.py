"""The fsdp2 engine's pieces in one process (a gloo world of one): what ``shard_model`` makes of the tiny
llama (which modules are sharded, the sharded parameters' dtypes), the optimizer step at accumulation
boundaries only, and the data position carried to another world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from memfit_trainer.data import DataPosition, carry_position
from memfit_trainer.fsdp2_engine import build_fsdp2_engine, decoder_layers
from memfit_trainer.model import build_model
from tests.trainer.runs import TINY_LLAMA, make_config


def test_position_carries_over_to_fewer_ranks_exactly() -> None:
    # 2 ranks x micro-batch 2 took 4 blocks a step: 5 steps are 20 blocks, 10 steps of 1 rank x 2.
    assert carry_position(DataPosition(1, 5), 4, 2) == (DataPosition(1, 10), 0)
    assert carry_position(DataPosition(0, 3), 2, 2) == (DataPosition(0, 3), 0)
    assert carry_position(DataPosition(2, 0), 4, 8) == (DataPosition(2, 0), 0)


def test_position_rounds_up_to_a_whole_step_of_more_ranks() -> None:
    # 3 steps of 2 blocks are 6 blocks: 2 steps of 4 blocks (8), skipping 2 blocks rather than training twice.
    assert carry_position(DataPosition(0, 3), 2, 4) == (DataPosition(0, 2), 2)


def _sharded(tmp_path: Path, **options: object):  # type: ignore[no-untyped-def]
    config = make_config(tmp_path, engine="fsdp2", max_steps=4, **options)  # type: ignore[arg-type]
    built = build_model(config)
    return config, build_fsdp2_engine(config, built.model, total_steps=4)


@pytest.mark.usefixtures("world_of_one")
def test_full_model_sharded_per_layer_and_root_with_fp32_masters(tmp_path: Path) -> None:
    from torch.distributed.fsdp import FSDPModule

    _, engine = _sharded(tmp_path, stage=3, offload=False)
    sharded = [m for m in engine.module.modules() if isinstance(m, FSDPModule)]
    assert len(sharded) == TINY_LLAMA.num_layers + 1 and sharded[0] is engine.module
    assert len(decoder_layers(engine.module)) == TINY_LLAMA.num_layers
    params = list(engine.module.parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
    policy = engine.module._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.usefixtures("world_of_one")
def test_bf16_masters_shard_the_bf16_weights_themselves(tmp_path: Path) -> None:
    _, engine = _sharded(tmp_path, stage=2, offload=False, master_weights="bf16")
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    policy = engine.module._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.bfloat16)


@pytest.mark.usefixtures("world_of_one")
def test_lora_keeps_the_frozen_base_in_bf16_and_fp32_adapter_masters(tmp_path: Path) -> None:
    _, engine = _sharded(tmp_path, method="lora", stage=3, offload=False)
    trainable = {p.dtype for p in engine.module.parameters() if p.requires_grad}
    frozen = {p.dtype for p in engine.module.parameters() if not p.requires_grad}
    assert (trainable, frozen) == ({torch.float32}, {torch.bfloat16})
    assert all(isinstance(p, DTensor) for p in engine.module.parameters())


@pytest.mark.usefixtures("world_of_one")
def test_optimizer_steps_at_accumulation_boundaries_only(tmp_path: Path) -> None:
    _, engine = _sharded(tmp_path, stage=2, offload=False, world_size=1, accumulation=2)
    before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    batch = {"input_ids": torch.randint(0, 258, (2, 16)), "labels": torch.randint(0, 258, (2, 16))}
    engine.backward(engine(**batch).loss)
    engine.step()
    assert engine.lr_scheduler.last_epoch == 0 and engine.last_grad_norm is None
    assert all(torch.equal(p.full_tensor(), before[n]) for n, p in engine.module.named_parameters())
    engine.backward(engine(**batch).loss)
    engine.step()
    assert engine.lr_scheduler.last_epoch == 1 and engine.last_grad_norm is not None
    assert all(p.grad is None for p in engine.module.parameters())
    assert not all(torch.equal(p.full_tensor(), before[n]) for n, p in engine.module.named_parameters())


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "cpu-offload"])
def test_optimizer_in_backward_steps_each_parameter_during_the_backward(tmp_path: Path, offload: bool) -> None:
    """Every trainable parameter has its own optimizer, stepped by FSDP2's post-accumulate-grad hook (also under
    CPUOffloadPolicy): after the backward alone the weights have moved and no gradient is left; ``step`` only
    advances every schedule, and nothing is clipped."""
    _, engine = _sharded(tmp_path, stage=3, offload=offload, optimizer_in_backward=True, max_grad_norm=0.0)
    trainable = list(engine.trainable())
    assert len(engine.optimizers) == len(trainable)
    assert [group["params"] for o in engine.optimizers for group in o.param_groups] == [[p] for p in trainable]
    before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    batch = {"input_ids": torch.randint(0, 258, (2, 16)), "labels": torch.randint(0, 258, (2, 16))}
    engine.backward(engine(**batch).loss)
    assert all(p.grad is None for p in engine.module.parameters())
    assert all(not torch.equal(p.full_tensor(), before[n]) for n, p in engine.module.named_parameters())
    assert all(len(o.state) == 1 for o in engine.optimizers)
    first_lr = engine.lr_scheduler.get_last_lr()
    engine.step()
    assert engine.lr_scheduler.last_epoch == 1 and engine.last_grad_norm is None
    assert (
        {o.param_groups[0]["lr"] for o in engine.optimizers} == {engine.lr_scheduler.get_last_lr()[0]} != set(first_lr)
    )
