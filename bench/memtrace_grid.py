"""Trace a grid of fine-tuning settings with MemTracker and write ``tests/data/memtrace/traces.json``.

The records calibrate memfit's analytic memory model. Decoder stacks of 2 and 4 layers at the real
widths of each family separate the per-layer cost from the fixed cost (embeddings, final norm, logits
and loss); a few full-depth runs anchor the result end to end. Everything runs on fake tensors: about
eleven minutes on one CPU core (361 traces), no accelerator, nothing downloaded.

Run from the repository root: ``.venv/bin/python bench/memtrace_grid.py [--out PATH] [--no-anchors]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from memfit.api.vocabulary import Attention, Method, Precision  # noqa: E402
from memfit.catalog.models import model_preset  # noqa: E402
from memfit.model_shape import ModelFamily, ModelShape  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "memtrace" / "traces.json"

PRESETS = ("llama-2-7b", "llama-3-8b", "mistral-7b-v0.1", "qwen2.5-0.5b", "qwen2.5-1.5b", "gemma-2-2b", "phi-3-mini")
"""Architectures whose widths are traced; llama-3-8b adds GQA and a 128k vocabulary, Qwen tied embeddings."""

LAYERS = (2, 4)
TOKENS = ((1, 512), (1, 1024), (1, 2048), (2, 1024))
"""(micro_batch, seq_len): three lengths separate s from s^2 (eager), b=2 shows batch is linear."""

FEW_TOKENS = ((1, 512), (1, 1024), (2, 1024))

ANCHORS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama-2-7b", {"micro_batch": 1, "seq_len": 2048, "gradient_checkpointing": False}),
    ("llama-2-7b", {"micro_batch": 1, "seq_len": 2048, "gradient_checkpointing": True}),
    ("llama-3-8b", {"micro_batch": 1, "seq_len": 2048, "gradient_checkpointing": True}),
    ("qwen2.5-0.5b", {"micro_batch": 2, "seq_len": 1024, "gradient_checkpointing": False}),
    ("llama-2-7b", {"micro_batch": 1, "seq_len": 2048, "gradient_checkpointing": True, "trainable": Method.LORA}),
)
"""Full-depth runs (the presets' own layer counts)."""


def _attentions(shape: ModelShape) -> tuple[Attention, ...]:
    """Gemma 2 soft-caps attention logits, which ``transformers`` refuses to run through SDPA."""
    return (Attention.EAGER,) if shape.family is ModelFamily.GEMMA2 else (Attention.SDPA, Attention.EAGER)


def _default_attention(shape: ModelShape) -> Attention:
    return _attentions(shape)[0]


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with enumeration members as their values, for the progress lines."""
    return {key: value.value if isinstance(value, Enum) else value for key, value in kwargs.items()}


def grid(anchors: bool) -> Iterator[tuple[str, ModelShape, dict[str, Any]]]:
    """(preset, shape, keyword arguments of ``trace_training_step``) for every traced setting."""
    for name in PRESETS:
        preset = model_preset(name)
        for layers in LAYERS:
            shape = dataclasses.replace(preset, num_layers=layers)
            attention = _default_attention(shape)
            for ckpt in (False, True):
                for attn in _attentions(shape):
                    for b, s in TOKENS:
                        yield (
                            name,
                            shape,
                            {"micro_batch": b, "seq_len": s, "gradient_checkpointing": ckpt, "attention": attn},
                        )
                for b, s in FEW_TOKENS:
                    common = {"micro_batch": b, "seq_len": s, "gradient_checkpointing": ckpt, "attention": attention}
                    yield name, shape, {**common, "trainable": Method.LORA}
                    if (b, s) != (1, 1024):
                        yield name, shape, {**common, "dtype": Precision.FP32}
    llama2, llama3 = model_preset("llama-2-7b"), model_preset("llama-3-8b")
    for impl in ("for-loop", "fused"):
        yield (
            "llama-2-7b",
            dataclasses.replace(llama2, num_layers=2),
            {"micro_batch": 1, "seq_len": 512, "optimizer_impl": impl},
        )
    for name, preset in (("llama-2-7b", llama2), ("llama-3-8b", llama3)):
        for layers in LAYERS:
            yield (
                name,
                dataclasses.replace(preset, num_layers=layers),
                {"micro_batch": 1, "seq_len": 1024, "causal_mask": "explicit"},
            )
    for layers in LAYERS:
        yield (
            "llama-2-7b",
            dataclasses.replace(llama2, num_layers=layers),
            {"micro_batch": 1, "seq_len": 1024, "trainable": Method.LORA, "lora_dropout": 0.0},
        )
    if anchors:
        for name, kwargs in ANCHORS:
            yield name, model_preset(name), kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-anchors", action="store_true", help="skip the full-depth runs")
    args = parser.parse_args(argv)

    from calibration.memtrace import trace_training_step

    warnings.filterwarnings("ignore", category=FutureWarning)
    records = []
    started = time.perf_counter()
    for index, (name, shape, kwargs) in enumerate(grid(anchors=not args.no_anchors), 1):
        t0 = time.perf_counter()
        trace = trace_training_step(shape, **kwargs)
        seconds = time.perf_counter() - t0
        records.append({"preset": name, **trace, "seconds": round(seconds, 2)})
        print(
            f"{index:4d} {name} L={shape.num_layers} {_plain(kwargs)} peak={trace['peak_total'] / 2**30:.2f} GiB "
            f"({seconds:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in records) + "\n]\n")
    print(f"{len(records)} traces in {time.perf_counter() - started:.0f}s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
