"""Compare the memory model with MemTracker records of real training steps (``calibration.memtrace``).

A record is what ``trace_training_step`` returns: the settings, the shape, and per phase the bytes of
each MemTracker category at that phase's peak. Model states are exact sizes (checked against the ZeRO
paper and DeepSpeed elsewhere), so the comparison is of what the structure of the model decides: the
peak of the forward and backward passes beyond weights, buffers and optimizer states (activations,
loss buffers and the gradients alive with them).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from memfit.api.vocabulary import Attention, Method, Precision
from memfit.memory.activations import (
    ActivationEstimate,
    ActivationSetup,
    estimate_activations,
    tiled_mlp_gradients,
)
from memfit.memory.engines.deepspeed import forward_backward_moments, gradient_timeline
from memfit.model_shape import ModelFamily, ModelShape

SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape) if f.name != "family")


def record_shape(record: dict[str, Any]) -> ModelShape:
    fields = {name: record["shape"][name] for name in SHAPE_FIELDS}
    return ModelShape(family=ModelFamily(record["shape"]["family"]), **fields)


def _states(record: dict[str, Any]) -> int:
    start = record["start"]
    return cast(int, start["PARAM"] + start["OPT"] + start["BUFFER"])


def measured_beyond_states(record: dict[str, Any]) -> int:
    """Peak of the forward and backward passes less weights, buffers and optimizer states: the
    activations and the gradients alive with them."""
    peak = max(record["phases"][phase]["peak"]["total"] for phase in ("forward", "backward"))
    return cast(int, peak - _states(record))


def predicted_beyond_states(record: dict[str, Any]) -> int:
    """The memory model's forward/backward moments for the traced plain-PyTorch step: gradients set to
    None between steps, the trace's own gradient bytes (plain peft keeps adapters in fp32)."""
    shape, setup = record_shape(record), record_setup(record)
    timeline = gradient_timeline(
        shape,
        setup.method,
        setup.precision,
        tiled_mlp_gradients(shape, setup.method, setup.tiled_mlp, setup.element_bytes),
    )
    gradients = record["phases"]["backward"]["end"]["GRAD"]
    return sum(forward_backward_moments(estimate_activations(shape, setup), gradients, False, timeline))


def activation_estimate(record: dict[str, Any]) -> ActivationEstimate:
    return estimate_activations(record_shape(record), record_setup(record))


def record_setup(record: dict[str, Any]) -> ActivationSetup:
    """The activation knobs of the traced step."""
    settings, shape = record["settings"], record_shape(record)
    lora = settings["trainable"] == Method.LORA
    targets = shape.resolve_lora_targets(tuple(settings["lora_targets"] or ())) if lora else frozenset()
    return ActivationSetup(
        method=Method.LORA if lora else Method.FULL,
        precision=Precision(settings["dtype"]),
        gradient_checkpointing=settings["gradient_checkpointing"],
        micro_batch_size=settings["micro_batch"],
        sequence_length=settings["seq_len"],
        attention=Attention(settings["attention"]),
        lora_rank=settings["lora_rank"] or 0,
        lora_targets=targets,
        lora_dropout=bool(settings["lora_dropout"]),
        adapter_bytes=4,  # traced with plain peft, which keeps adapters in fp32
        chunked_loss=settings.get("chunked_loss", False),
        activation_offloading=settings.get("activation_offloading", False),
        masked_batches=settings.get("causal_mask") == "explicit",
        sequence_parallel=settings.get("sequence_parallel", 1),
        tiled_mlp=settings.get("tiled_mlp", False),
    )


def relative_error(record: dict[str, Any]) -> float:
    """predicted / measured - 1 (positive: the model is conservative)."""
    return predicted_beyond_states(record) / measured_beyond_states(record) - 1
