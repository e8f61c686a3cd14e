"""MemTracker traces of FSDP2 (``fully_shard``) training steps on fake tensors and a fake process group.

One rank (rank 0) of a ``world_size``-rank job runs the genuine ``transformers`` model wrapped as the
trainer's FSDP2 engine wraps it (``fully_shard`` on every decoder layer, then on the root, whose group holds
the embedding, the final norm and the LM head), under :class:`FakeTensorMode` with PyTorch's ``fake``
process group (``torch.testing._internal.distributed.fake_pg``): collectives allocate their outputs as on a
GPU and move no data. MemTracker counts every storage FSDP2 allocates (all-gather and reduce-scatter
buffers, unsharded parameters and gradients, sharded gradients and optimizer states).

Limits of the stand-in, said rather than hidden:

* the fake tensors live on the CPU device, so ``CPUOffloadPolicy`` has no host to move to: offload is not
  traced (its accounting is checked by ``tests/test_fsdp2_memory.py``);
* with ``optimizer_in_backward`` each parameter's AdamW is stepped by the trainer's own hooks
  (``memfit_trainer.optimizer_in_backward.step_in_backward``) inside FSDP2's reduce, so the traced
  backward holds the steps' temporaries and each group's reduce output until its parameters have stepped;
* there are no streams, so the order of allocations and frees is the program order, as the caching
  allocator sees it on one stream; FSDP2 keeps its cross-stream buffers alive by references
  (``all_gather_state``, ``reduce_scatter_states``), which the trace follows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Literal, cast
from unittest import mock

import torch
import torch.distributed as dist

from calibration.memtrace import _build_model, _optimizer, distributed_record, lora_settings, tracked_training_steps
from memfit.api.vocabulary import Attention, MasterWeights, Method, Precision
from memfit.contract.engines import Fsdp2EngineSection
from memfit.model_shape import ModelShape
from memfit_trainer.fake_trace import fake_run, fake_weights

Trainable = Literal[Method.FULL, Method.LORA]


def _init_fake_group(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def wrap_fsdp2(
    model: torch.nn.Module, mesh: Any, masters: MasterWeights, reshard_after_forward: bool, method: Trainable
) -> None:
    """Shard ``model`` exactly as the trainer does (``memfit_trainer.fsdp2_engine.shard_model``): ``fully_shard``
    every decoder layer, then the root; fp32 masters cast the trained parameters to fp32 (LoRA's frozen base
    stays bf16) and gather bf16 copies, reducing in fp32; bf16 masters cast nothing and reduce in bf16."""
    from memfit_trainer.fsdp2_engine import shard_model

    fsdp2 = Fsdp2EngineSection(
        reshard_after_forward=reshard_after_forward,
        reduce_dtype=Precision.FP32 if masters == MasterWeights.FP32 else Precision.BF16,
    )
    # shard_model reads these fields of the trainer config, and makes its mesh (which reads a tensor's
    # values, impossible under FakeTensorMode: it gets the one made outside).
    training = SimpleNamespace(precision=Precision.BF16, master_weights=masters, method=method)
    config = SimpleNamespace(engine=fsdp2, training=training)
    with mock.patch("torch.distributed.device_mesh.init_device_mesh", lambda *_, **__: mesh):
        shard_model(cast(Any, config), model, torch.device("cpu"))


def trace_fsdp2_step(
    shape: ModelShape,
    *,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    masters: MasterWeights = MasterWeights.FP32,
    reshard_after_forward: bool = True,
    gradient_checkpointing: bool = False,
    trainable: Trainable = Method.FULL,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("all-linear",),
    lora_dropout: float = 0.05,
    optimizer_in_backward: bool = False,
    steps: int = 2,
) -> dict[str, Any]:
    """Run ``steps`` FSDP2 training steps of rank 0 on fake tensors; measure the last with MemTracker.

    Returns the settings, ``peak_total`` (bytes), ``peak_phase`` and per phase (``forward`` with the loss,
    ``backward``, ``optimizer``) the breakdown at its peak and at its end, as ``trace_training_step`` does."""
    settings: dict[str, Any] = {
        "world_size": world_size,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "masters": masters,
        "reshard_after_forward": reshard_after_forward,
        "gradient_checkpointing": gradient_checkpointing,
        "trainable": trainable,
        **lora_settings(trainable, lora_rank, lora_targets, lora_dropout),
        "optimizer_in_backward": optimizer_in_backward,
    }
    from torch.distributed.device_mesh import init_device_mesh

    _init_fake_group(world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: it reads a tensor's values
        start, phases = _traced_step(shape, mesh, settings, steps, micro_batch, seq_len)
    finally:
        dist.destroy_process_group()  # the fake group must not outlive the trace (other tests start their own)
    return distributed_record(shape, settings, start, phases)


def _traced_step(
    shape: ModelShape, mesh: Any, settings: dict[str, Any], steps: int, micro_batch: int, seq_len: int
) -> tuple[dict[str, int], dict[str, dict[str, dict[str, int]]]]:
    trainable, masters = settings["trainable"], settings["masters"]
    lora_rank, lora_targets = settings["lora_rank"], tuple(settings["lora_targets"] or ())
    model = _build_model(
        shape, Precision.BF16, Attention.SDPA, settings["gradient_checkpointing"], trainable, lora_rank or 0,
        lora_targets, settings["lora_dropout"] or 0.0,
    )  # fmt: skip
    with fake_run("implicit"):
        fake_weights(model)
        if trainable == Method.LORA:  # the trainer casts adapters to the compute dtype
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.bfloat16()
        wrap_fsdp2(model, mesh, masters, settings["reshard_after_forward"], trainable)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params, "foreach") if not settings["optimizer_in_backward"] else _SteppedInBackward(params)
        input_ids = torch.randint(0, shape.vocab_size, (micro_batch, seq_len))

        def forward() -> torch.Tensor:
            return cast(torch.Tensor, model(input_ids=input_ids, labels=input_ids).loss)

        return tracked_training_steps(model, opt, forward, steps)


class _SteppedInBackward(torch.optim.Optimizer):
    """The trainer's per-parameter AdamW optimizers, stepped by their hooks in the backward pass, as the one
    optimizer ``tracked_training_steps`` takes: MemTracker tracks their states; its ``step`` and
    ``zero_grad`` have nothing left to do."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:  # no super().__init__: it owns no parameter
        from memfit_trainer.optimizer_in_backward import step_in_backward

        self.optimizers = step_in_backward(params, lambda group: _optimizer(group, "foreach"))

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]  # a view of the per-parameter states, as they fill
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def step(self, closure: None = None) -> None:  # type: ignore[override]  # never given a closure
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None
