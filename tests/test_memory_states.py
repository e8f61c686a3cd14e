"""Model-state memory against the published anchors: the ZeRO paper and DeepSpeed's own estimators."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from memfit.api.plan import Strategy
from memfit.catalog.models import MODEL_PRESETS
from memfit.memory.engines.deepspeed import zero3_working_set
from memfit.memory.estimate import model_states
from memfit.memory.setup import NO_ADAPTERS, Adapters
from memfit.memory.sizes import NF4_BYTES_PER_PARAMETER
from memfit.memory.states import (
    EIGHT_BIT_MIN_SIZE,
    PAGED_MIN_SIZE,
    QUANTILE_MAP_BYTES,
    trainable_split,
    trainable_tensors,
)
from memfit.model_shape import ModelFamily, ModelShape

ANCHORS = json.loads((Path(__file__).parent / "data" / "reference_anchors.json").read_text())
BEFORE = json.loads((Path(__file__).parent / "data" / "model_states_before_bf16_masters.json").read_text())["states"]
"""model_states as it was before bf16 masters existed (computed then, by that commit's code)."""
SHAPE = MODEL_PRESETS["llama-2-7b"]
P = SHAPE.parameter_count
PAPER_KEYS = {1: "p_os", 2: "p_os_g", 3: "p_os_g_p"}


def strategy(
    stage: int, gpus: int, offload_optimizer: str = "none", offload_parameters: str = "none", **kw
) -> Strategy:
    fields = dict(method="full", pool="p", nodes=1, gpus_per_node=gpus, zero_stage=stage,
                  offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                  gradient_checkpointing=False, micro_batch_size=1, gradient_accumulation_steps=1,
                  precision="bf16", optimizer="adamw", attention="sdpa")  # fmt: skip
    fields.update(kw)
    return Strategy(**fields)


def paper_bytes_per_parameter(stage: int, gpus: int) -> float:
    """Our weights + 16-bit gradients + optimizer states per parameter, without what the paper leaves
    out: the fp32 gradient partition of the step and ZeRO-3's gathered working set."""
    states = model_states(SHAPE, strategy(stage, gpus), NO_ADAPTERS)
    extra = (zero3_working_set(SHAPE) + SHAPE.largest_layer_parameters) * 2 if stage == 3 else 0
    return (states.parameters + states.gradients + states.optimizer_states - extra) / P


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_paper_figure_1(stage: int) -> None:
    figure = ANCHORS["zero_paper"]["figure1"]
    key = PAPER_KEYS.get(stage, "baseline")
    predicted_gb = paper_bytes_per_parameter(stage, figure["nd"]) * figure["psi"] / 1e9
    assert predicted_gb == pytest.approx(figure["exact_gb"][key], rel=1e-3)
    assert round(predicted_gb, 1) == pytest.approx(figure["printed_gb"][key], abs=0.051)


@pytest.mark.parametrize("model", ["7.5B", "128B", "1T"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_paper_table_1(model: str, stage: int) -> None:
    table = ANCHORS["zero_paper"]["table1"]
    psi = table["models"][model]["psi"]
    printed = table["models"][model]["printed_gb"][PAPER_KEYS[stage]]
    for gpus, value in zip(table["nd"], printed, strict=True):
        predicted = paper_bytes_per_parameter(stage if gpus > 1 else 0, gpus) * psi / 1e9
        # The paper rounds half-up in the 7.5B columns and truncates in the others.
        assert predicted == pytest.approx(value, rel=0.01, abs=0.006), (model, stage, gpus)


def test_qlora_keeps_the_base_in_4_bits_and_the_rest_in_the_compute_dtype() -> None:
    shape = MODEL_PRESETS["llama-3.1-8b"]
    states = model_states(shape, strategy(0, 1, method="qlora"), Adapters(16, ("all-linear",)))
    adapters = shape.lora_parameters(16, ("all-linear",))
    unquantized = shape.parameter_count - shape.quantizable_parameters  # embeddings, LM head, norms
    expected = shape.quantizable_parameters * NF4_BYTES_PER_PARAMETER + (unquantized + adapters) * 2
    assert states.parameters == pytest.approx(expected, abs=1)
    assert states.optimizer_states == adapters * 12  # fp32 masters and Adam moments of the adapters
    assert 4.12 < NF4_BYTES_PER_PARAMETER * 8 < 4.13  # 4-bit codes + double-quantized absmax


def test_lora_trains_only_adapters() -> None:
    states = model_states(SHAPE, strategy(0, 1, method="lora"), Adapters(8, ("q_proj", "v_proj")))
    adapters = SHAPE.num_layers * 8 * (2 * (4096 + 4096))
    assert states.gradients == adapters * 2
    assert states.optimizer_states == adapters * 12
    assert states.parameters == (P + adapters) * 2


# --- bf16 master weights and the optimizers' real states ------------------------------------------------

LLAMA3 = MODEL_PRESETS["llama-3.1-8b"]


@pytest.mark.parametrize(
    ("stage", "weights", "gradients", "step", "optimizer"),
    [
        # bytes per parameter on 8 GPUs: weights, 16-bit gradients, step transient, masters + Adam moments
        (0, 2, 2, None, 2 * 2),  # the weights are the masters; ZeRO-0's step transient: see below
        (1, 2, 2, 2 / 8, (2 + 2 * 2) / 8),
        (2, 2, 2 / 8, 2 / 8, (2 + 2 * 2) / 8),
    ],
)
def test_bf16_masters_bytes_per_parameter(
    stage: int, weights: float, gradients: float, step: float | None, optimizer: float
) -> None:
    s = model_states(SHAPE, strategy(stage, 8, master_weights="bf16"), NO_ADAPTERS)
    assert s.parameters == P * weights
    assert s.gradients == int(P * gradients)
    assert s.optimizer_states == int(P * optimizer)
    if step is not None:  # llama-2-7b's 131M-element embedding is smaller than a 842M-element partition / 4
        assert s.step_gradients == int(P * step)


def test_bf16_masters_halve_masters_moments_and_the_step_gradient_against_fp32() -> None:
    for stage in (1, 2, 3):
        fp32 = model_states(SHAPE, strategy(stage, 8), NO_ADAPTERS)
        bf16 = model_states(SHAPE, strategy(stage, 8, master_weights="bf16"), NO_ADAPTERS)
        assert bf16.optimizer_states == pytest.approx(fp32.optimizer_states / 2, abs=1)
        assert (bf16.parameters, bf16.gradients) == (fp32.parameters, fp32.gradients)
        lion = [
            model_states(SHAPE, strategy(stage, 8, optimizer="lion", master_weights=m), NO_ADAPTERS) for m in MASTERS
        ]
        assert lion[1].optimizer_states == pytest.approx(lion[0].optimizer_states / 2, abs=1)


MASTERS = ("fp32", "bf16")


def test_bf16_masters_zero0_steps_the_weights_themselves() -> None:
    """No master copy and no gradient partition at ZeRO-0; DeepSpeed's clipping copies one gradient to fp32
    at a time (the largest: the embedding)."""
    s = model_states(SHAPE, strategy(0, 8, master_weights="bf16"), NO_ADAPTERS)
    assert s.optimizer_states == 4 * P  # two bf16 moments
    assert s.step_gradients == 4 * SHAPE.embedding_parameters
    adafactor = model_states(SHAPE, strategy(0, 8, optimizer="adafactor", master_weights="bf16"), NO_ADAPTERS)
    assert adafactor.step_gradients == 8 * SHAPE.embedding_parameters  # grad.float() and p.float()


def test_bf16_masters_step_transient_is_the_larger_of_partition_and_fp64_norm_piece() -> None:
    """Llama 3.1 8B on 8 GPUs, ZeRO-2: the 525M-element embedding's fp64 copy for the gradient norm (4.2 GB)
    outgrows the bf16 partition (2 GB); under ZeRO-3 the piece is the embedding's partition."""
    p = LLAMA3.parameter_count
    zero2 = model_states(LLAMA3, strategy(2, 8, master_weights="bf16"), NO_ADAPTERS)
    assert zero2.step_gradients == 8 * LLAMA3.embedding_parameters > 2 * p / 8
    zero3 = model_states(LLAMA3, strategy(3, 8, master_weights="bf16"), NO_ADAPTERS)
    assert zero3.step_gradients == int(max(2 * p / 8, 8 * LLAMA3.embedding_parameters / 8))


def test_bf16_masters_need_bf16_precision_to_change_anything() -> None:
    """A conflicting strategy (refused by the rule table) is still counted as fp32 masters, never as less."""
    fp16 = model_states(SHAPE, strategy(2, 8, precision="fp16", master_weights="bf16"), NO_ADAPTERS)
    assert fp16 == model_states(SHAPE, strategy(2, 8, precision="fp16"), NO_ADAPTERS)


def test_trainable_tensors_add_up_to_the_trainable_parameters() -> None:
    for shape in MODEL_PRESETS.values():
        for method in ("full", "lora", "qlora"):
            tensors = trainable_tensors(shape, method, Adapters(16, ("all-linear",)))
            total = sum(math.prod(t) * n for t, n in tensors)
            assert total == trainable_split(shape, method, Adapters(16, ("all-linear",))).trainable
    mixtral = dict(trainable_tensors(MODEL_PRESETS["mixtral-8x7b"], "full", NO_ADAPTERS))
    assert mixtral[(8, 2 * 14336, 4096)] == mixtral[(8, 4096, 14336)] == 32  # transformers' fused experts, per layer


TINY = ModelShape(ModelFamily.QWEN2, 64, 160, 2, 4, 2, 258, tie_word_embeddings=True)


def test_8bit_adam_keeps_32_bit_states_below_min_8bit_size() -> None:
    """bitsandbytes: a tensor under 4096 elements gets two fp32 states; larger ones two uint8 states and an
    fp32 absmax per 256-element block each, plus the two 256-value quantization maps. ZeRO-0 steps each
    tensor; ZeRO-1/2/3 one flat partition."""
    tensors = [math.prod(t) for t, n in trainable_tensors(TINY, "full", NO_ADAPTERS) for _ in range(n)]
    small = sum(numel for numel in tensors if numel < EIGHT_BIT_MIN_SIZE)
    large = [numel for numel in tensors if numel >= EIGHT_BIT_MIN_SIZE]
    expected = 8 * small + sum(2 * n + 8 * math.ceil(n / 256) for n in large) + QUANTILE_MAP_BYTES
    s = model_states(TINY, strategy(0, 2, optimizer="adamw8bit", master_weights="bf16"), NO_ADAPTERS)
    assert s.optimizer_states == expected
    flat = TINY.parameter_count / 2
    zero2 = model_states(TINY, strategy(2, 2, optimizer="adamw8bit", master_weights="bf16"), NO_ADAPTERS)
    assert zero2.optimizer_states == int(2 * flat + 2 * flat + 8 * math.ceil(flat / 256) + QUANTILE_MAP_BYTES)


def test_paged_states_are_host_memory_and_only_for_tensors_of_1e5_elements() -> None:
    """paged_adamw8bit: state1/state2 of tensors of at least 1e5 elements are CUDA managed memory (counted in
    cpu_per_rank, not on the GPU); their absmaxes and every smaller tensor's states stay on the GPU."""
    adapters = Adapters(16, ("all-linear",))
    paged = model_states(LLAMA3, strategy(0, 1, method="lora", optimizer="paged_adamw8bit"), adapters)
    plain = model_states(LLAMA3, strategy(0, 1, method="lora", optimizer="adamw8bit"), adapters)
    tensors = [math.prod(t) for t, n in trainable_tensors(LLAMA3, "lora", adapters) for _ in range(n)]
    managed = sum(2 * n for n in tensors if n >= PAGED_MIN_SIZE)
    # rank 16 on hidden 4096: A and B of q/k/v/o (65536, 16384 elements) stay; the MLP's (229376) are paged
    assert 0 < managed < sum(2 * n for n in tensors)
    assert paged.cpu_per_rank == managed
    assert paged.optimizer_states == plain.optimizer_states - managed
    zero2 = model_states(LLAMA3, strategy(2, 8, optimizer="paged_adamw8bit"), NO_ADAPTERS)
    assert zero2.cpu_per_rank == int(2 * LLAMA3.parameter_count / 8)  # one flat partition: all paged
    assert (
        zero2.optimizer_states
        == int(4 * LLAMA3.parameter_count / 8) + 8 * math.ceil(LLAMA3.parameter_count / 8 / 256) + QUANTILE_MAP_BYTES
    )


def test_adafactor_factors_only_what_it_sees_as_matrices() -> None:
    """ZeRO-0: row and column means of each matrix, a full second moment of each vector, an RMS per tensor.
    ZeRO-1/2/3 hand it a flat 1-d partition: a full fp32 second moment, as big as Lion's momentum."""
    zero0 = model_states(SHAPE, strategy(0, 8, optimizer="adafactor"), NO_ADAPTERS)
    assert zero0.optimizer_states < 4.01 * P  # fp32 masters + a factored second moment
    zero2 = model_states(SHAPE, strategy(2, 8, optimizer="adafactor"), NO_ADAPTERS)
    assert zero2.optimizer_states == int(4 * P / 8 + 4 * P / 8 + 4)


GRID = list(
    itertools.product(
        ("llama-2-7b", "llama-3.1-8b", "qwen2.5-0.5b", "mixtral-8x7b", "gemma-2-2b", "phi-3-mini"),
        ("full", "lora", "qlora"),
        (0, 1, 2, 3),
        (1, 8),
        ("none", "cpu", "nvme"),
        ("bf16", "fp16", "fp32"),
        ("adamw", "lion"),
    )
)


CORRECTED_SINCE = {("mixtral-8x7b", "lora"), ("mixtral-8x7b", "qlora")}
"""Recorded numbers that were wrong by the model's own code: transformers 5 fuses Mixtral's experts into 3-D
parameters, which bitsandbytes leaves in 16 bits and peft adapts with stacked, gate_up_proj-doubled ranks (and
all-linear adapts the router); tests/test_presets_vs_profiles.py checks the corrected counts."""


def test_fp32_masters_reproduce_the_previous_model_exactly() -> None:
    """Adam and Lion with fp32 masters (and fp32 training): every term as before bf16 masters existed. The
    8-bit optimizers and Adafactor changed on purpose (per-tensor states, paging, flat ZeRO partitions)."""
    for preset, method, stage, gpus, offload, precision, optimizer in GRID:
        if stage == 0 and offload != "none" or (preset, method) in CORRECTED_SINCE:
            continue
        shape = MODEL_PRESETS[preset]
        s = strategy(stage, gpus, offload, method=method, precision=precision, optimizer=optimizer)
        before = BEFORE["/".join(map(str, (preset, method, stage, gpus, offload, precision, optimizer)))]
        states = model_states(shape, s, Adapters(16, ("all-linear",)))
        if offload != "none":  # the host now holds what DeepSpeed pins, rounded (test_pinned_vs_deepspeed.py)
            host_before = before[[f.name for f in dataclasses.fields(states)].index("cpu_per_rank")]
            assert states.cpu_per_rank >= host_before, s.summary()
            states = dataclasses.replace(states, cpu_per_rank=host_before)
        assert list(dataclasses.astuple(states)) == before, s.summary()


def test_8bit_states_moved_not_lost_against_the_previous_model() -> None:
    """adamw8bit: the previous flat 2 + 8/256 bytes per parameter, now with the quantization maps (and, at
    ZeRO-0, 32-bit states of small tensors); paged: the same bytes, the paged ones in host memory."""
    for stage in (0, 2):
        for name in ("adamw8bit", "paged_adamw8bit"):
            s = strategy(stage, 8, optimizer=name)
            now, before = (
                model_states(SHAPE, s, NO_ADAPTERS),
                BEFORE[f"llama-2-7b/full/{stage}/8/none/bf16/{name}/rank0"],
            )
            assert now.optimizer_states + now.cpu_per_rank - before[3] == pytest.approx(QUANTILE_MAP_BYTES, abs=8)
