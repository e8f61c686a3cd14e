"""The planner's memory-saving techniques: chosen only where they buy something, said so, and pinned off they
reproduce the plans memfit made before they existed."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
from rich.console import Console

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import GPUPool, pool_capacity
from memfit.api.loading import load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Attention, MasterWeights
from memfit.cli.plan_table import print_plan_table
from memfit.memory.estimate import activation_setup, peak_memory, static_memory
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import StaticSetup
from memfit.planner.report import MIN_TECHNIQUE_GAIN
from memfit.planner.search import lora_settings, plan_job
from tests.planning_fixtures import A100_4_NODES, A100_NODE, ONE_A100, RTX_4090, V100_NODE, job, pool

POOLS: dict[str, list[GPUPool]] = {
    "llama-3.1-8b/auto": [A100_NODE, RTX_4090],
    "llama-3.1-8b/qlora": [RTX_4090],
    "llama-3.2-3b/full": [ONE_A100],
    "qwen2.5-7b/lora": [V100_NODE, ONE_A100],
    "llama-2-70b/full": [A100_4_NODES],
    "gemma-2-9b/auto": [A100_NODE],
    "mistral-7b-v0.3/auto": [A100_NODE, ONE_A100],
}
BEFORE_THE_TECHNIQUES = [
    # preset, method, batch, sequence, chosen plan, per-GPU total, per-node CPU: planned by memfit before
    # chunked loss, activation offloading and bf16 masters existed (commit 34641d0, chunkedLoss false); the
    # totals since grew by the attention mask SDPA gets from packed (or padded) batches, and nothing else.
    ("llama-3.1-8b", "auto", 64, 4096, "full zero2 mb1x8 bf16 adamw on 1x8 a100", 69541301964, 154253983744),
    ("llama-3.1-8b", "qlora", 2, 2048, "qlora zero0 ckpt mb2x1 bf16 adamw on 1x1 rtx", 14790740377, 3221225472),
    ("llama-3.2-3b", "full", 2, 4096, "full zero0 mb1x2 bf16 adamw on 1x1 a100", 76890844672, 9646725120),
    ("qwen2.5-7b", "lora", 16, 8192, "lora zero3 ckpt mb1x2 fp16 adamw on 1x8 v100", 22417119001, 25769803776),
    ("llama-2-70b", "full", 64, 2048, "full zero3 ckpt mb2x1 bf16 adamw on 4x8 a100", 47978277504, 25769803776),
    ("gemma-2-9b", "auto", 32, 4096, "full zero2 ckpt mb2x2 bf16 adamw on 1x8 a100", 70676356064, 173637099520),
    ("mistral-7b-v0.3", "auto", 8, 32768, "full zero1 ckpt mb1x1 bf16 adamw on 1x8 a100", 56062712883, 141738180608),
]
OLD_BEHAVIOUR = {
    "chunkedLoss": False, "activationOffloading": False, "masterWeights": "fp32", "engine": "deepspeed",
    "attention": "sdpa",  # typed sizes plan flex attention on Ampere now, where it holds less
    "tiledMlp": False, "sequenceParallel": 1,
}  # fmt: skip


@pytest.mark.parametrize("row", BEFORE_THE_TECHNIQUES, ids=[f"{r[0]}/{r[1]}" for r in BEFORE_THE_TECHNIQUES])
def test_pinning_the_old_behaviour_reproduces_the_old_plans_exactly(row: tuple[object, ...]) -> None:
    preset, method, batch, sequence, summary, total, cpu = row
    spec = job(str(preset), str(method), batch=int(str(batch)), sequence=int(str(sequence)), strategy=OLD_BEHAVIOUR)
    # Counted as they were then: by the family's formulas from the preset's typed sizes (presets are now
    # planned from their profiles, whose activation terms are traced).
    chosen = plan_job(spec, POOLS[f"{preset}/{method}"], model=spec.model.architecture.shape()).chosen
    assert chosen is not None
    assert (chosen.strategy.summary(), chosen.memory.per_gpu.total, chosen.memory.per_node.cpu) == (summary, total, cpu)
    assert chosen.techniques is None


TECHNIQUE_JOBS = [
    ("llama-3.1-8b", "auto", 64, 4096),
    ("llama-3.1-8b", "qlora", 2, 2048),
    ("qwen2.5-7b", "lora", 16, 8192),
    ("mistral-7b-v0.3", "auto", 8, 32768),
]


def _without_techniques_fits(spec: FineTuneJobSpec, candidate: PlanCandidate, pools: list[GPUPool]) -> bool:
    """Whether the candidate's exact knobs, micro-batch included, fit without the techniques the planner added."""
    plain = dataclasses.replace(candidate.strategy, chunked_loss=False, activation_offloading=False,
                                master_weights=MasterWeights.FP32)  # fmt: skip
    shape = spec.planned_model()
    lora = lora_settings(spec, shape)
    setup = activation_setup(shape, plain, spec.training.sequence_length, lora)
    memory = peak_memory(static_memory(shape, StaticSetup.of(plain), lora), model_activations(shape, setup),
                         plain.gradient_accumulation_steps)  # fmt: skip
    capacity = next(pool_capacity(p) for p in pools if p.metadata.name == plain.pool)
    limit = capacity.gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100)
    return memory.per_gpu.total <= limit


@pytest.mark.parametrize("case", TECHNIQUE_JOBS, ids=[f"{c[0]}/{c[1]}" for c in TECHNIQUE_JOBS])
def test_a_technique_is_in_a_plan_only_where_the_plan_would_not_fit_without_it(case: tuple[str, str, int, int]) -> None:
    preset, method, batch, sequence = case
    spec, pools = job(preset, method, batch=batch, sequence=sequence), POOLS[f"{preset}/{method}"]
    result = plan_job(spec, pools)
    with_techniques = [c for c in result.candidates if c.techniques]
    if preset == "qwen2.5-7b":  # V100s: the chunked loss makes LoRA at 8k tokens fit (the check is not vacuous)
        assert with_techniques
    for candidate in with_techniques:
        assert not _without_techniques_fits(spec, candidate, pools), candidate.strategy.summary()
        assert candidate.strategy.chunked_loss or candidate.strategy.activation_offloading
        assert "makes it fit" in candidate.techniques or "without)" in candidate.techniques  # type: ignore[operator]
    for candidate in result.candidates:
        if not candidate.techniques:
            assert not candidate.strategy.chunked_loss and not candidate.strategy.activation_offloading


@pytest.mark.parametrize("case", TECHNIQUE_JOBS, ids=[f"{c[0]}/{c[1]}" for c in TECHNIQUE_JOBS])
def test_a_technique_that_costs_speed_must_buy_a_clearly_faster_plan(case: tuple[str, str, int, int]) -> None:
    preset, method, batch, sequence = case
    result = plan_job(job(preset, method, batch=batch, sequence=sequence), POOLS[f"{preset}/{method}"])
    plain: dict[str, float] = {}
    for candidate in result.candidates:
        if not candidate.techniques:
            speed = candidate.throughput.tokens_per_second
            plain[candidate.strategy.method] = max(plain.get(candidate.strategy.method, 0.0), speed)
    for candidate in result.candidates:
        if candidate.techniques and candidate.strategy.method in plain:
            assert candidate.throughput.tokens_per_second >= MIN_TECHNIQUE_GAIN * plain[candidate.strategy.method]


def test_the_chosen_plan_and_the_runner_ups_say_what_the_techniques_bought() -> None:
    spec = job("llama-3.1-8b", "qlora", batch=2, sequence=2048, resources={"memoryHeadroomPercent": 0})
    small = pool("small", "NVIDIA-GeForce-RTX-4090", 1, 1, 64)
    small = small.model_copy(update={"spec": small.spec.model_copy(update={"gpu_memory_gib": 8.0})})
    result = plan_job(spec, [small])
    assert result.chosen is not None and result.chosen.techniques is not None
    assert result.why_chosen is not None and f"it uses {result.chosen.techniques}." in result.why_chosen
    out = io.StringIO()
    print_plan_table(FineTuneJob.model_validate({"metadata": {"name": "q"}, "spec": spec.model_dump(by_alias=True)}),
                     result, Console(file=out, width=250))  # fmt: skip
    assert result.chosen.techniques in out.getvalue()


def test_the_example_and_a_lion_job_plan_as_before_with_the_old_behaviour_pinned() -> None:
    examples = Path(__file__).parent.parent / "examples"
    spec = load_documents(examples / "llama-3.1-8b-lora.yaml").jobs[0].spec
    spec = spec.model_copy(update={"strategy": spec.strategy.model_copy(update={
        "chunked_loss": False, "activation_offloading": False, "master_weights": MasterWeights.FP32,
        "attention": Attention.SDPA})})  # fmt: skip
    formulas = spec.model.architecture.shape()  # counted as then (see above)
    chosen = plan_job(spec, load_documents(examples / "inventory.yaml").pools, model=formulas).chosen
    assert chosen is not None
    # commit 34641d0, plus the attention mask of packed batches (as BEFORE_THE_TECHNIQUES)
    before = ("full zero2 mb1x8 bf16 adamw on 1x8 a100-80gb", 69541301964, 154253983744)
    assert (chosen.strategy.summary(), chosen.memory.per_gpu.total, chosen.memory.per_node.cpu) == before
    lion = job("llama-2-13b", "full", batch=16, training={"globalBatchSize": 16, "optimizer": "lion"},
               strategy=OLD_BEHAVIOUR)  # fmt: skip
    chosen = plan_job(lion, [A100_NODE, V100_NODE, ONE_A100, RTX_4090], model=lion.model.architecture.shape()).chosen
    assert chosen is not None
    before = ("full zero3 mb2x1 bf16 lion on 1x8 a100", 65032179059, 25769803776)  # commit 34641d0, plus the mask
    assert (chosen.strategy.summary(), chosen.memory.per_gpu.total, chosen.memory.per_node.cpu) == before
