"""The memory model against MemTracker traces of real ``transformers`` training steps.

Two checks: the committed grid (tests/data/memtrace/traces.json, 6 families, written by
bench/memtrace_grid.py), and fresh traces of architectures that are in no table or preset, so a model
tuned to the grid would fail them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from calibration.compare import relative_error
from memfit.model_shape import ModelFamily, ModelShape

TRACES = json.loads((Path(__file__).parent / "data" / "memtrace" / "traces.json").read_text())
WORST_UNDER, WORST_OVER, MEAN = -0.05, 0.10, 0.02
"""Never more than 5% under (a plan that does not fit), at most 10% over (a wasted GPU), 2% on average."""


def test_grid_covers_the_families_and_settings() -> None:
    families = {r["shape"]["family"] for r in TRACES}
    assert families >= {"llama", "mistral", "qwen2", "gemma2", "phi3"}
    assert {r["settings"]["trainable"] for r in TRACES} == {"full", "lora"}
    assert {r["settings"]["gradient_checkpointing"] for r in TRACES} == {True, False}
    assert any(r["shape"]["num_layers"] >= 24 for r in TRACES)  # full-depth anchors, not just 2-4 layers


@pytest.mark.parametrize("family", sorted({r["shape"]["family"] for r in TRACES}))
def test_grid_errors_per_family(family: str) -> None:
    errors = [relative_error(r) for r in TRACES if r["shape"]["family"] == family]
    assert min(errors) >= WORST_UNDER, f"{family}: underestimates by {min(errors):.1%}"
    assert max(errors) <= WORST_OVER, f"{family}: overestimates by {max(errors):.1%}"
    assert statistics.mean(map(abs, errors)) <= MEAN


UNSEEN = {
    # widths, GQA ratio, vocabulary and depth no preset has
    "llama-like": ModelShape(ModelFamily.LLAMA, 1536, 4352, 3, 12, 4, 50_000),
    "qwen2-like tied": ModelShape(ModelFamily.QWEN2, 1280, 3456, 3, 10, 2, 64_000, tie_word_embeddings=True),
}
SETTINGS = [
    dict(micro_batch=2, seq_len=384, dtype="bf16", gradient_checkpointing=False, attention="sdpa", trainable="full"),
    dict(micro_batch=1, seq_len=768, dtype="bf16", gradient_checkpointing=True, attention="sdpa", trainable="full"),
    dict(micro_batch=1, seq_len=512, dtype="bf16", gradient_checkpointing=False, attention="eager", trainable="full"),
    dict(micro_batch=1, seq_len=512, dtype="bf16", gradient_checkpointing=True, attention="sdpa", trainable="lora"),
]


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_fresh_traces_of_unseen_architectures(name: str, settings: dict) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from calibration.memtrace import trace_training_step

    record = trace_training_step(UNSEEN[name], **settings)
    error = relative_error(record)
    assert WORST_UNDER <= error <= WORST_OVER, f"{name} {settings}: {error:+.1%}"
