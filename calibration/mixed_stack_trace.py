"""Whole-model traces of every stored model whose decoder layers are not all alike, cut to two periods of its pattern.

A profile traces one decoder layer of each type, and the planner composes a stack of any depth from them
(``memfit.memory.profiled_activations``). For a stack of mixed layers (sliding and global attention, linear and
full attention, chunked attention beside NoPE layers, MoE and dense blocks) the composition is checked against the
step itself: the model's own config cut to its first layers, twice as many as hold every type (:func:`cut_layers`:
each type at several depths, as the model builds it there), one packed row of
:data:`TOKENS` tokens trained through it on fake tensors by the profiler's own tracer
(``memfit_trainer.activation_profile.trace``), full fine-tuning and LoRA, without and with gradient checkpointing.

At real widths the traces take minutes, so their results are stored (``tests/data/memtrace/mixed_stacks.json``,
rewritten by ``python -m calibration.mixed_stack_trace [NAME...]``, about 10 minutes for all on 2 shared cores)
with the sha256 of the config each was traced from; ``tests/test_mixed_stacks_vs_traces.py`` composes each from
the stored profile and traces one afresh.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.catalog.model_configs import CONFIGS_DIR, stored_profile, stored_profile_names
from memfit.profile import ActivationProfile, canonical_config_sha256
from memfit_trainer.activation_profile import DEFAULT_LORA, Setup, text_config, trace

TOKENS = 2048
"""One packed row: past gpt-oss's and Gemma 3's sliding windows, within Llama 4's attention chunk."""
MIN_LAYERS = 4
"""At least this deep: the first layer's backward, a middle one's and the last one's are then apart."""
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "memtrace" / "mixed_stacks.json"
SETUPS = ((False, False), (False, True), (True, False), (True, True))
"""(LoRA, gradient checkpointing): full fine-tuning and LoRA, each without and with checkpointing."""


def activations_of(name: str) -> ActivationProfile:
    """The traced activation terms of a stored profile."""
    profile = stored_profile(name)
    assert profile is not None and profile.activations is not None, name
    return profile.activations


def layer_types_of(name: str) -> tuple[str, ...]:
    profile = stored_profile(name)
    assert profile is not None, name
    return profile.layer_types


def mixed_stack_names() -> list[str]:
    """The stored profiles whose layers are of more than one type."""
    return [name for name in stored_profile_names() if len(set(layer_types_of(name))) > 1]


def traced_setups(name: str) -> list[tuple[bool, bool]]:
    """The (LoRA, checkpointing) setups of :data:`SETUPS` the model trains in (no LoRA where its profile says a
    step with adapters fails)."""
    trains_lora = activations_of(name).lora is not None
    return [(lora, checkpointing) for lora, checkpointing in SETUPS if trains_lora or not lora]


def cut_layers(layer_types: Sequence[str]) -> tuple[str, ...]:
    """The model's first layers: twice as many as hold every type (Gemma 3's five sliding ones and its global one,
    twice), at least :data:`MIN_LAYERS`."""
    period = max(list(layer_types).index(kind) for kind in set(layer_types)) + 1
    return tuple(layer_types[: max(2 * period, MIN_LAYERS)])


def setup_of(name: str, lora: bool, checkpointing: bool) -> Setup:
    """The traced setup: for LoRA the adapters the profile traced (rank, dropout); a packed row, the model's loss."""
    activations = activations_of(name)
    update = {"rank": activations.lora_rank, "dropout": activations.lora_dropout}
    return Setup(lora=DEFAULT_LORA.model_copy(update=update) if lora else None, checkpointing=checkpointing)


def trace_case(name: str, lora: bool, checkpointing: bool) -> dict[str, Any]:
    """One step of the cut model: its peak beyond the model's state, and the moments the composition sums."""
    config = json.loads((CONFIGS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    layers = cut_layers(layer_types_of(name))
    setup = setup_of(name, lora, checkpointing)
    traced = trace(text_config(config), layers, TOKENS, activations_of(name).attention, setup)
    return {
        "model": name,
        "config_sha256": canonical_config_sha256(config),
        "layer_types": list(layers),
        "tokens": TOKENS,
        "lora": lora,
        "gradient_checkpointing": checkpointing,
        "peak": traced.peak,
        "forward_end": traced.forward_end,
        "loss_backward": traced.loss_backward,
        "outside_backward": traced.outside_backward,
        "layers": [[layer.saved, layer.backward_peak] for layer in traced.layers],
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Trace the named models (default: every mixed stack) and write their records over the stored ones."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("names", nargs="*", help="stored models to trace again (default: every mixed stack)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    names = args.names or mixed_stack_names()
    unknown = sorted(set(names) - set(mixed_stack_names()))
    if unknown:
        parser.error(f"not a stored model of mixed layers: {', '.join(unknown)}")
    stored: list[dict[str, Any]] = json.loads(args.out.read_text()) if args.out.is_file() else []
    records = [record for record in stored if record["model"] not in names]
    for name in names:
        for lora, checkpointing in traced_setups(name):
            records.append(trace_case(name, lora, checkpointing))
            print(f"{name} lora={lora} checkpointed={checkpointing}: peak {records[-1]['peak']} bytes", flush=True)
    records.sort(key=lambda record: (record["model"], record["lora"], record["gradient_checkpointing"]))
    args.out.write_text("[\n" + ",\n".join(json.dumps(record, sort_keys=True) for record in records) + "\n]\n")
    print(f"wrote {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
