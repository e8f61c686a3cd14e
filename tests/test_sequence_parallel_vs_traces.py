"""Sequence parallelism's and the tiled MLP's memory (``memfit.memory.activations``) against MemTracker traces of
rank 0 of the trainer's own sequence-parallel step (``calibration.sp_trace``: Ulysses through
``memfit_trainer.sequence_parallel``, ``memfit_trainer.tiled_mlp``, the chunked loss, activation offloading).

The traces of ``calibration.sp_trace.GRID`` are stored (``tests/data/memtrace/sp_traces.json``, rewritten by
``python -m calibration.sp_trace``): importing DeepSpeed alone takes longer than CI can spare per case. One case
is traced afresh (``slow``) to catch the stored records drifting from the trainer's code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from calibration.compare import measured_beyond_states, record_setup, record_shape, relative_error
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import ActivationSetup, estimate_activations, mlp_tile_tokens
from memfit.model_shape import ModelFamily, ModelShape

TRACES: list[dict[str, Any]] = json.loads((Path(__file__).parent / "data" / "memtrace" / "sp_traces.json").read_text())
WORST = 0.05
"""The issue's bound: the planned memory of a sequence-parallel step within 5% of the trace, either way (the
stored cases trace at -1.9% to +2.2%)."""
LLAMA = ModelShape(ModelFamily.LLAMA, 512, 1408, 3, 8, 2, 8192)


def _name(record: dict[str, Any]) -> str:
    shape, settings = record["shape"], record["settings"]
    knobs = [f"sp{settings['sequence_parallel']}", settings["attention"], settings["trainable"]]
    knobs += [knob for knob in ("gradient_checkpointing", "tiled_mlp", "chunked_loss", "activation_offloading")
              if settings[knob]]  # fmt: skip
    return f"{shape['family']}-v{shape['vocab_size']}-kv{shape['num_key_value_heads']}-" + "-".join(knobs)


def test_the_stored_traces_cover_the_knobs() -> None:
    settings = [r["settings"] for r in TRACES]
    assert {s["sequence_parallel"] for s in settings} == {2, 4, 8}
    assert {s["attention"] for s in settings} == {Attention.FLASH, Attention.SDPA}
    for knob in ("trainable", "gradient_checkpointing", "tiled_mlp", "chunked_loss"):
        assert len({s[knob] for s in settings}) == 2, knob
    assert {r["shape"]["family"] for r in TRACES} == {"llama", "qwen2"}
    assert any(r["shape"]["tie_word_embeddings"] for r in TRACES)
    # more ranks than key/value heads: Ulysses replicates them
    assert any(r["settings"]["sequence_parallel"] > r["shape"]["num_key_value_heads"] for r in TRACES)


@pytest.mark.parametrize("record", TRACES, ids=_name)
def test_the_estimate_matches_the_stored_trace(record: dict[str, Any]) -> None:
    error = relative_error(record)
    assert -WORST <= error <= WORST, f"{_name(record)}: {error:+.1%}"


def _setup(**knobs: Any) -> ActivationSetup:
    fields: dict[str, Any] = dict(
        method=Method.FULL, precision=Precision.BF16, gradient_checkpointing=False, micro_batch_size=1,
        sequence_length=4096, attention=Attention.FLASH,
    )  # fmt: skip
    return ActivationSetup(**{**fields, **knobs})


def test_a_rank_holds_its_chunk_plus_the_attention_outputs_copy() -> None:
    """Against the unsplit step at s / P tokens, every layer keeps one more t x q tensor (o_proj's input, beside
    the kernel's output in the gathered layout) and, with more ranks than key/value heads, the replicated keys
    and values; the rest is per token."""
    split = estimate_activations(LLAMA, _setup(sequence_parallel=4))
    unsplit = estimate_activations(LLAMA, _setup(sequence_length=1024))
    t, q, w = 1024, LLAMA.q_size, 2
    replicated_kv = 2 * t * LLAMA.kv_size * w  # 4 ranks, 2 key/value heads: each repeated once more
    assert split.saved_per_layer - unsplit.saved_per_layer == t * q * w + replicated_kv


def test_the_unsplit_untiled_setup_is_unchanged() -> None:
    """The defaults are the model as it was (the stored grid's figures are checked in test_activations_vs_traces)."""
    setup = _setup()
    assert setup.tokens == setup.attended_length == 4096
    assert estimate_activations(LLAMA, setup) == estimate_activations(
        LLAMA, dataclasses.replace(setup, sequence_parallel=1, tiled_mlp=False)
    )


def test_an_odd_length_is_padded_to_the_ranks() -> None:
    setup = _setup(sequence_length=4097, sequence_parallel=4)
    assert (setup.tokens, setup.attended_length) == (1025, 4100)


def test_the_trainer_cuts_the_tiles_the_model_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile the trainer's tiled MLP hands its autograd Function for each input (meta tensors: no memory)."""
    torch = pytest.importorskip("torch")
    from memfit_trainer import tiled_mlp

    tiles: list[int] = []
    monkeypatch.setattr(tiled_mlp.TiledMlp, "apply", lambda forward, module, x, tile: tiles.append(tile) or x)
    tiled_forward = tiled_mlp._tiled(torch.nn.Identity(), lambda x: x)
    cases = [(tokens, width) for tokens in (1, 511, 512, 513, 4096, 131_071) for width in (512, 4096)]
    for tokens, width in cases:
        tiled_forward(torch.empty(1, tokens, width, device="meta"))
    assert tiles == [mlp_tile_tokens(tokens, width) for tokens, width in cases]


@pytest.mark.slow
def test_a_fresh_trace_matches_the_stored_one() -> None:
    """One stored case traced again through the trainer's code as it is now: the same bytes."""
    pytest.importorskip("deepspeed")
    from calibration.sp_trace import GRID, trace_case

    stored = next(r for r in TRACES if r["settings"]["tiled_mlp"] and r["settings"]["attention"] == Attention.SDPA)
    name, settings = next((n, s) for n, s in GRID if s.get("tiled_mlp") and s.get("attention") == Attention.SDPA)
    fresh = trace_case(name, settings)
    assert record_shape(fresh) == record_shape(stored) and record_setup(fresh) == record_setup(stored)
    assert measured_beyond_states(fresh) == measured_beyond_states(stored)
    assert -WORST <= relative_error(fresh) <= WORST
