"""MemTracker traces of rank 0 of a Ulysses sequence-parallel training step, on fake tensors.

Rank 0 of a ``sequence_parallel``-rank group runs the genuine ``transformers`` model through the trainer's own
code path (``memfit_trainer.sequence_parallel``: its attention kernel, ``prepare`` (DeepSpeed's
``UlyssesSPAttentionHF`` around the kernel), ``shard`` and ``sequence_mean``; ``memfit_trainer.tiled_mlp``;
the chunked loss; activation offloading), on its ``s / P`` tokens of each row, under :class:`FakeTensorMode`
with torch's ``fake`` process group wrapped by ``deepspeed.comm`` (DeepSpeed's all-to-all is a custom op with a
fake implementation: it allocates its output and moves no data). MemTracker counts what one GPU of the group
would hold.

Two attention paths, as a GPU run gets them:

* ``flash``: a causal stand-in with no mask, wrapped by Ulysses as the trainer wraps ``flash_attention_2``
  (SDPA's ``is_causal`` path on the CPU keeps what flash attention keeps: the output and one fp32 log-sum-exp
  per row and head);
* ``sdpa``: the trainer's SP kernel (``SP_SDPA``) on a packed batch: a causal same-document mask over the
  whole gathered sequence, built from the gathered ``position_ids`` once per forward.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast
from unittest import mock

import torch
import torch.distributed as dist

from calibration.memtrace import (
    _build_model,
    _optimizer,
    _real_batch,
    distributed_record,
    lora_settings,
    tracked_training_steps,
)
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer import sequence_parallel as sp_trainer
from memfit_trainer.activation_offload import offload_activations
from memfit_trainer.chunked_loss import causal_lm_loss, unwrap_causal_lm
from memfit_trainer.fake_trace import HOST, fake_run, fake_weights
from memfit_trainer.tiled_mlp import tile_mlps

SpAttention = Literal[Attention.FLASH, Attention.SDPA]
Trainable = Literal[Method.FULL, Method.LORA]

CAUSAL_STAND_IN = "memfit_causal_standin"
"""The flash stand-in's ``transformers`` attention key (no "flash" in it: such keys are loaded as hub kernels)."""


def _causal_no_mask(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, **kw: Any) -> Any:
    """Flash-like: causal attention over the gathered sequence, no mask tensor."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kw.pop("position_ids", None)  # Ulysses passes the gathered ones; a causal kernel needs none
    return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kw)


@contextlib.contextmanager
def fake_sequence_group(sequence_parallel: int) -> Iterator[None]:
    """Rank 0 of a fake process group of ``sequence_parallel`` ranks, seen through ``deepspeed.comm``; released
    afterwards with DeepSpeed's sequence-parallel groups (other traces start their own)."""
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sequence_parallel)
    try:
        deepspeed.init_distributed(dist_backend="fake")
        yield
    finally:
        groups._release_sequence_parallel_groups()
        dist.destroy_process_group()


def _prepare(model: torch.nn.Module, attention: SpAttention, sequence_parallel: int, micro_batch: int) -> None:
    """Route ``model``'s attention through Ulysses as the trainer does (``sequence_parallel.prepare``); for flash,
    around the causal stand-in (flash-attn does not run on the CPU)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = cast(Any, model).config
    if attention == Attention.SDPA:
        config._attn_implementation = sp_trainer.attn_implementation(attention, sequence_parallel)
        training = SimpleNamespace(
            sequence_parallel=sequence_parallel, attention=attention, micro_batch_size=micro_batch
        )
        sp_trainer.prepare(cast(Any, SimpleNamespace(training=training)), model)
        return
    ALL_ATTENTION_FUNCTIONS[CAUSAL_STAND_IN] = _causal_no_mask  # afresh: Ulysses replaced it with its wrapper
    config._attn_implementation = CAUSAL_STAND_IN
    UlyssesSPAttentionHF.register_with_transformers(
        model, CAUSAL_STAND_IN, sequence_parallel, micro_batch, seq_length_is_variable=True
    )


@contextlib.contextmanager
def _fresh_document_mask() -> Iterator[None]:
    """The trainer's SP kernel caches one document mask per forward, reused while the gathered positions are
    equal, which it checks by value; fake tensors have none. Within one traced step every attention call (and
    recomputation) gathers the same positions, as in a real run, so equal shapes stand for equal values; the
    cache starts empty and is dropped afterwards."""
    with (
        mock.patch.object(sp_trainer, "_document_mask", sp_trainer._DocumentMask()),
        mock.patch.object(sp_trainer, "_same", lambda a, b: a.shape == b.shape),
    ):
        yield


def trace_sp_step(
    shape: ModelShape,
    *,
    sequence_parallel: int,
    micro_batch: int,
    seq_len: int,
    attention: SpAttention = Attention.FLASH,
    gradient_checkpointing: bool = False,
    trainable: Trainable = Method.FULL,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("all-linear",),
    lora_dropout: float = 0.05,
    tiled_mlp: bool = False,
    chunked_loss: bool = False,
    activation_offloading: bool = False,
    steps: int = 1,
) -> dict[str, Any]:
    """Trace rank 0 of one sequence-parallel training step (``seq_len`` tokens per row before the split) and
    return a record shaped as ``calibration.memtrace.trace_training_step``'s, which ``calibration.compare`` reads
    (its settings also carry ``sequence_parallel`` and ``tiled_mlp``). One step suffices: gradients start as
    None, as in every later step, and the optimizer's states are model states."""
    settings: dict[str, Any] = {
        "micro_batch": micro_batch, "seq_len": seq_len, "dtype": Precision.BF16,
        "gradient_checkpointing": gradient_checkpointing, "attention": attention, "trainable": trainable,
        **lora_settings(trainable, lora_rank, lora_targets, lora_dropout),
        "causal_mask": "explicit" if attention == Attention.SDPA else "implicit", "steps": steps,
        "chunked_loss": chunked_loss, "activation_offloading": activation_offloading,
        "sequence_parallel": sequence_parallel, "tiled_mlp": tiled_mlp,
    }  # fmt: skip
    whole = _real_batch("packed" if attention == Attention.SDPA else "plain", micro_batch, seq_len, shape.vocab_size)
    with fake_sequence_group(sequence_parallel), _fresh_document_mask():
        model = _build_model(
            shape, Precision.BF16, Attention.SDPA, gradient_checkpointing, trainable, lora_rank, lora_targets,
            lora_dropout,
        )  # fmt: skip
        _prepare(model, attention, sequence_parallel, micro_batch)
        if tiled_mlp:
            tile_mlps(model)
        if activation_offloading:
            offload_activations(model, host=HOST)
        start, phases = _traced(model, sp_trainer.shard(whole, 0, sequence_parallel), chunked_loss, steps)
    return distributed_record(shape, settings, start, phases)


def _traced(
    model: torch.nn.Module, chunk: dict[str, torch.Tensor], chunked_loss: bool, steps: int
) -> tuple[dict[str, int], dict[str, dict[str, dict[str, int]]]]:
    """The traced steps on rank 0's ``chunk``, with the trainer's loss: the chunk's share of the sequence's
    mean (``sequence_parallel.sequence_mean``) of the model's own loss or the chunked one."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    group = parallel_state_sp.get_sequence_parallel_group()
    with fake_run("implicit") as mode:
        fake_weights(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params, "foreach")
        batch = {name: mode.from_tensor(tensor) for name, tensor in chunk.items()}

        def forward() -> torch.Tensor:
            if chunked_loss:  # the trainer's code path (memfit_trainer.chunked_loss.install)
                loss = causal_lm_loss(model, unwrap_causal_lm(model), batch)
            else:
                loss = cast(torch.Tensor, model(**batch).loss)
            return sp_trainer.sequence_mean(loss, group)

        return tracked_training_steps(model, opt, forward, steps)


SHAPES = {
    "llama": ModelShape(ModelFamily.LLAMA, 512, 1408, 3, 8, 2, 8192),
    "qwen2 tied": ModelShape(ModelFamily.QWEN2, 512, 1376, 3, 8, 4, 8192, tie_word_embeddings=True),
    "llama small vocabulary": ModelShape(ModelFamily.LLAMA, 512, 1408, 3, 8, 2, 1024),
}
"""Narrow and grouped-query (2 or 4 key/value heads: split over 2 or 4 ranks, replicated over 4 or 8), with a
small vocabulary, so that the layers are a visible part of the peak; the last one so small that the layers' own
backward binds (checkpointed, tiled MLP), not the loss."""
GRID: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama", {"sequence_parallel": 2}),
    ("llama", {"sequence_parallel": 4}),
    ("llama", {"sequence_parallel": 8}),
    ("llama", {"sequence_parallel": 4, "micro_batch": 2, "seq_len": 2048}),
    ("llama", {"sequence_parallel": 2, "gradient_checkpointing": True}),
    ("llama", {"sequence_parallel": 2, "attention": Attention.SDPA}),
    ("llama", {"sequence_parallel": 4, "attention": Attention.SDPA, "gradient_checkpointing": True}),
    ("llama", {"sequence_parallel": 2, "trainable": Method.LORA}),
    ("llama", {"sequence_parallel": 4, "trainable": Method.LORA, "gradient_checkpointing": True}),
    ("llama", {"sequence_parallel": 4, "trainable": Method.LORA, "attention": Attention.SDPA}),
    ("llama", {"sequence_parallel": 2, "tiled_mlp": True}),
    ("llama", {"sequence_parallel": 4, "tiled_mlp": True, "chunked_loss": True}),
    (
        "llama",
        {"sequence_parallel": 4, "gradient_checkpointing": True, "activation_offloading": True, "chunked_loss": True},
    ),  # fmt: skip
    ("qwen2 tied", {"sequence_parallel": 2}),
    ("qwen2 tied", {"sequence_parallel": 4, "gradient_checkpointing": True}),
    ("qwen2 tied", {"sequence_parallel": 8, "attention": Attention.SDPA}),
    ("qwen2 tied", {"sequence_parallel": 2, "trainable": Method.LORA, "tiled_mlp": True}),
    ("qwen2 tied", {"sequence_parallel": 4, "tiled_mlp": True, "gradient_checkpointing": True, "chunked_loss": True}),
    ("llama small vocabulary", {"sequence_parallel": 2, "gradient_checkpointing": True, "chunked_loss": True}),
    (
        "llama small vocabulary",
        {"sequence_parallel": 2, "tiled_mlp": True, "gradient_checkpointing": True, "chunked_loss": True},
    ),  # fmt: skip
    (
        "llama small vocabulary",
        {"sequence_parallel": 4, "tiled_mlp": True, "gradient_checkpointing": True, "chunked_loss": True},
    ),  # fmt: skip
    ("llama small vocabulary", {"sequence_parallel": 4, "tiled_mlp": True, "chunked_loss": True}),
    (
        "llama small vocabulary",
        {
            "sequence_parallel": 2,
            "tiled_mlp": True,
            "trainable": Method.LORA,
            "gradient_checkpointing": True,
            "chunked_loss": True,
        },
    ),  # fmt: skip
    (
        "llama small vocabulary",
        {
            "sequence_parallel": 2,
            "tiled_mlp": True,
            "attention": Attention.SDPA,
            "gradient_checkpointing": True,
            "chunked_loss": True,
        },
    ),  # fmt: skip
)
"""The stored traces (``tests/data/memtrace/sp_traces.json``): 4096 tokens a row unless said."""
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "memtrace" / "sp_traces.json"


def trace_case(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One case of :data:`GRID`, traced."""
    return trace_sp_step(SHAPES[name], **{"micro_batch": 1, "seq_len": 4096, **settings})


def main() -> None:
    """Trace :data:`GRID` and write the records (about a minute on one core, most of it importing DeepSpeed)."""
    records = [trace_case(name, settings) for name, settings in GRID]
    DEFAULT_OUT.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(records)} records to {DEFAULT_OUT}")


if __name__ == "__main__":
    main()
