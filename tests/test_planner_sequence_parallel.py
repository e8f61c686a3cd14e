"""Sequence parallelism (Ulysses) and the tiled MLP in the planner: the rules that refuse them, each with its
message; the model facts those rules read; pinned off they reproduce today's plans; the search splits a sequence
only where that buys a fit; the summary says so; and the throughput counts the all-to-alls and the tiled MLP's
extra forward."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from memfit.api.finetunejob import MAX_SEQUENCE_LENGTH, FineTuneJob
from memfit.api.gpupool import pool_capacity
from memfit.api.knobs import Knobs, conflicts
from memfit.api.loading import load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.catalog.model_configs import stored_profiled_model
from memfit.cli.plan_table import print_longest_table, why_lost
from memfit.contract.trainer_config import TrainerConfig
from memfit.memory.sizes import compute_bytes
from memfit.model_facts import dense_mlp_parameters, model_facts
from memfit.model_shape import ModelFamily, ModelShape
from memfit.planner import throughput
from memfit.planner.longest import LongestSequence
from memfit.planner.search import best_plan, plan_job
from memfit.render.trainer_config import render_trainer_config
from tests.planning_fixtures import A100_4_NODES, A100_NODE, WITH_FLASH_ATTN, job
from tests.test_planner_techniques import BEFORE_THE_TECHNIQUES, OLD_BEHAVIOUR, POOLS

EXAMPLES = Path(__file__).parent.parent / "examples"
RULES = [
    (Knobs(sequence_parallel=2, attention=Attention.EAGER), "needs sdpa or flash attention"),
    (Knobs(sequence_parallel=2, attention=Attention.FLEX), "cannot run flex attention"),
    (Knobs(sequence_parallel=2, optimizer_in_backward=True), "strategy.optimizerInBackward cannot run with"),
    (Knobs(sequence_parallel=2, method=Method.QLORA), "not supported with method qlora"),
    (Knobs(sequence_parallel=3, attention_heads=32, kv_heads=8), "must divide the model's 32 attention heads"),
    (Knobs(sequence_parallel=4, attention_heads=32, kv_heads=6), "divide or be a multiple of its 6 key/value"),
    (Knobs(sequence_parallel=2, linear_attention=True), "its linear-attention layers"),
    (Knobs(sequence_parallel=2, windowed_attention=True, attention=Attention.SDPA), "only with flash attention"),
    (Knobs(tiled_mlp=True, dense_mlp=False), "strategy.tiledMlp tiles dense MLPs"),
]


@pytest.mark.parametrize(("knobs", "message"), RULES, ids=[message for _, message in RULES])
def test_each_rule_refuses_its_combination_and_says_why(knobs: Knobs, message: str) -> None:
    (problem,) = conflicts(knobs)
    assert message in problem


ALLOWED = [
    Knobs(sequence_parallel=1, attention=Attention.EAGER, method=Method.QLORA, linear_attention=True),
    Knobs(sequence_parallel=8, attention=Attention.SDPA, attention_heads=32, kv_heads=8),
    Knobs(sequence_parallel=16, attention=Attention.FLASH, attention_heads=32, kv_heads=8),  # keys replicated
    Knobs(sequence_parallel=4, attention=Attention.FLASH, windowed_attention=True),
    Knobs(sequence_parallel=2),  # the model unknown: the rules that read its facts skip
    Knobs(tiled_mlp=True, dense_mlp=True),
]


@pytest.mark.parametrize("knobs", ALLOWED, ids=range(len(ALLOWED)))
def test_what_ulysses_and_the_tiled_mlp_run_is_allowed(knobs: Knobs) -> None:
    assert conflicts(knobs) == []


@pytest.mark.parametrize(
    ("preset", "facts"),
    [
        ("llama-3.1-8b", {"attention_heads": 32, "kv_heads": 8, "linear_attention": False, "dense_mlp": True}),
        ("qwen3.5-27b", {"linear_attention": True}),
        ("gemma-2-9b", {"windowed_attention": True}),  # sliding layers and soft-capped scores
        ("gemma-3-4b", {"windowed_attention": True}),
        ("llama-4-scout", {"windowed_attention": True, "dense_mlp": True}),  # chunked attention; shared experts
        ("qwen3-30b-a3b", {"dense_mlp": False, "windowed_attention": False}),  # every layer routes
    ],
)
def test_a_profile_states_the_facts_the_rules_read(preset: str, facts: dict[str, Any]) -> None:
    model = stored_profiled_model(preset)
    assert model is not None
    stated = model_facts(model)
    assert {name: stated[name] for name in facts} == facts


def test_typed_sizes_state_them_too() -> None:
    mixtral = ModelShape(ModelFamily.MIXTRAL, 4096, 14336, 32, 32, 8, 32000, num_experts=8, experts_per_token=2)
    gemma2 = ModelShape(ModelFamily.GEMMA2, 3584, 14336, 42, 16, 8, 256000)
    assert model_facts(mixtral) == {"attention_heads": 32, "kv_heads": 8, "dense_mlp": False,
                                    "linear_attention": False, "windowed_attention": False}  # fmt: skip
    assert model_facts(gemma2)["windowed_attention"] is True


def test_a_pinned_degree_the_heads_cannot_take_is_refused_with_the_rule() -> None:
    result = plan_job(job("llama-3.1-8b", "full", batch=8, strategy={"sequenceParallel": 3}), [A100_NODE])
    assert result.chosen is None
    assert any("must divide the model's 32 attention heads" in line for line in result.advice)


def test_the_api_refuses_qlora_with_sequence_parallelism() -> None:
    with pytest.raises(ValueError, match="not supported with method qlora"):
        job("llama-3.1-8b", "qlora", strategy={"sequenceParallel": 2})


def test_a_tiled_mlp_on_a_model_of_experts_only_is_refused() -> None:
    spec = job("mixtral-8x7b", "full", batch=8, strategy={"tiledMlp": True})
    result = plan_job(spec, [A100_NODE], model=spec.model.architecture.shape())
    assert result.chosen is None
    assert any("strategy.tiledMlp tiles dense MLPs" in line for line in result.advice)


NOT_SPLIT = {"sequenceParallel": 1, "tiledMlp": False}


@pytest.mark.parametrize("row", BEFORE_THE_TECHNIQUES, ids=[f"{r[0]}/{r[1]}" for r in BEFORE_THE_TECHNIQUES])
def test_pinning_them_off_reproduces_the_old_plans_exactly(row: tuple[object, ...]) -> None:
    preset, method, batch, sequence, summary, total, cpu = row
    spec = job(str(preset), str(method), batch=int(str(batch)), sequence=int(str(sequence)),
               strategy={**OLD_BEHAVIOUR, **NOT_SPLIT})  # fmt: skip
    chosen = plan_job(spec, POOLS[f"{preset}/{method}"], model=spec.model.architecture.shape()).chosen
    assert chosen is not None
    assert (chosen.strategy.summary(), chosen.memory.per_gpu.total, chosen.memory.per_node.cpu) == (summary, total, cpu)


ORDINARY = [("llama-3.1-8b", "auto", 64, 4096), ("qwen2.5-7b", "lora", 16, 8192), ("mistral-7b-v0.3", "full", 8, 32768)]


@pytest.mark.parametrize(("preset", "method", "batch", "sequence"), ORDINARY)
def test_a_split_is_chosen_only_over_slower_plans_that_keep_sequences_whole(
    preset: str, method: str, batch: int, sequence: int
) -> None:
    def chosen(**pins: Any) -> PlanCandidate:
        plan = plan_job(job(preset, method, batch=batch, sequence=sequence, strategy=pins), [A100_NODE]).chosen
        assert plan is not None
        return plan

    split, whole = chosen(), chosen(sequenceParallel=1)
    if split.strategy.sequence_parallel == 1:
        assert split == whole
    else:  # e.g. half a sequence per GPU fits without the recomputation a whole one needs
        assert split.throughput.tokens_per_second > whole.throughput.tokens_per_second


def test_a_short_sequence_that_fits_whole_without_recomputation_is_not_split() -> None:
    spec = job("llama-3.1-8b", "auto", batch=64, sequence=4096)
    plan = plan_job(spec, [A100_NODE]).chosen
    assert plan is not None and plan.strategy.sequence_parallel == 1 and not plan.strategy.gradient_checkpointing


LONG = {"preset": "llama-3.1-8b", "method": "full", "batch": 8, "strategy": {"attention": "flash"}}


def _long_job(sequence: int, **pins: Any) -> Any:
    return job(LONG["preset"], LONG["method"], batch=LONG["batch"], sequence=sequence,
               strategy={**LONG["strategy"], **pins})  # fmt: skip


def test_a_sequence_is_split_where_that_makes_it_fit_and_said_so() -> None:
    spec = _long_job(524_288)
    model = spec.model.architecture.shape()
    assert best_plan(_long_job(524_288, sequenceParallel=1), [A100_NODE], model=model, runtime=WITH_FLASH_ATTN) is None
    plan = best_plan(spec, [A100_NODE], model=model, runtime=WITH_FLASH_ATTN)
    assert plan is not None and plan.strategy.sequence_parallel > 1
    assert f"sp{plan.strategy.sequence_parallel}" in plan.strategy.summary().split()
    # no pinned degree finds a faster plan than the search's
    for degree in (2, 4, 8):
        pinned = best_plan(
            _long_job(524_288, sequenceParallel=degree), [A100_NODE], model=model, runtime=WITH_FLASH_ATTN
        )
        assert pinned is None or pinned.throughput.tokens_per_second <= plan.throughput.tokens_per_second


def test_a_split_is_not_chosen_where_whole_sequences_fit() -> None:
    spec = _long_job(8192)
    plan = best_plan(spec, [A100_NODE], model=spec.model.architecture.shape(), runtime=WITH_FLASH_ATTN)
    assert plan is not None and plan.strategy.sequence_parallel == 1


def test_a_pinned_degree_is_planned_as_pinned() -> None:
    spec = _long_job(8192, sequenceParallel=4)
    plan = best_plan(spec, [A100_NODE], model=spec.model.architecture.shape(), runtime=WITH_FLASH_ATTN)
    assert plan is not None and plan.strategy.sequence_parallel == 4
    # 8 sequences over 2 data-parallel groups of 4 GPUs: 4 sequences per group and step
    assert plan.strategy.micro_batch_size * plan.strategy.gradient_accumulation_steps == 4


def test_a_batch_smaller_than_the_gpus_runs_split() -> None:
    spec = job("llama-3.1-8b", "full", batch=1, sequence=8192, strategy={"attention": "flash"})
    plan = best_plan(spec, [A100_NODE], model=spec.model.architecture.shape(), runtime=WITH_FLASH_ATTN)
    assert plan is not None and plan.strategy.gpus // plan.strategy.sequence_parallel == 1


def _plan(sequence: int = 8192, pool: Any = A100_NODE) -> tuple[PlanCandidate, Any]:
    spec = job("llama-3.1-8b", "full", batch=8, sequence=sequence, strategy={"attention": "flash"})
    model = spec.model.architecture.shape()
    plan = best_plan(spec, [pool], model=model, runtime=WITH_FLASH_ATTN)
    assert plan is not None
    return plan, model


@pytest.mark.parametrize(("degree", "checkpointing"), [(2, False), (8, True), (16, True)])
def test_the_step_waits_for_the_all_to_alls(degree: int, checkpointing: bool) -> None:
    plan, model = _plan(pool=A100_4_NODES)
    capacity = pool_capacity(A100_4_NODES)
    sequence, trainable = 8192, plan.trainable_parameter_count
    whole = plan.strategy.replaced(nodes=4, gpus_per_node=8, micro_batch_size=1, gradient_accumulation_steps=1,
                                   gradient_checkpointing=checkpointing, zero_stage=1)  # fmt: skip
    split = whole.replaced(sequence_parallel=degree, micro_batch_size=degree)  # the same tokens per GPU
    tokens = sequence  # per GPU and micro-batch in both
    q, kv = model.q_size, model.num_key_value_heads * model.dim_head
    replicated = max(model.num_key_value_heads, degree) / model.num_key_value_heads
    sent = model.num_layers * (2 + checkpointing) * (degree - 1) / degree * tokens * (2 * q + 2 * kv * replicated)
    bandwidth = capacity.intra_node_bytes_per_second
    if degree > 8:  # the group spans nodes
        bandwidth = min(bandwidth, capacity.inter_node_bytes_per_second / 8)
    expected = sent * compute_bytes(Precision.BF16) / bandwidth
    step = throughput.step_seconds(model, split, capacity, sequence, trainable)
    assert step - throughput.step_seconds(model, whole, capacity, sequence, trainable) == pytest.approx(expected)
    assert throughput.tokens_per_step(split, sequence) == throughput.tokens_per_step(whole, sequence)


def test_the_tiled_mlp_costs_one_more_mlp_forward_per_token() -> None:
    plan, model = _plan()
    flops = throughput._training_flops_per_token  # noqa: SLF001 - the term itself is what is checked
    tiled = plan.strategy.replaced(tiled_mlp=True)
    extra = flops(model, tiled, 8192) - flops(model, plan.strategy.replaced(tiled_mlp=False), 8192)
    assert extra == 6 * model.hidden_size * model.intermediate_size * model.num_layers
    assert dense_mlp_parameters(model) == 3 * model.hidden_size * model.intermediate_size * model.num_layers


def test_the_summary_names_the_degree_only_when_it_splits() -> None:
    plan, _ = _plan()
    assert not any(part.startswith("sp") for part in plan.strategy.summary().split())
    summary = plan.strategy.replaced(sequence_parallel=4, tiled_mlp=True).summary().split()
    assert "sp4" in summary and "tiled-mlp" in summary


def test_the_longest_table_says_the_degree_and_when_the_api_maximum_is_reached() -> None:
    plan, _ = _plan()
    split = plan.model_copy(update={"strategy": plan.strategy.replaced(sequence_parallel=8)})
    rows = [LongestSequence("a100", MAX_SEQUENCE_LENGTH, split), LongestSequence("small", 65_536, plan)]
    assert [row.api_maximum for row in rows] == [True, False]
    document = FineTuneJob.model_validate({"apiVersion": "memfit.dev/v1alpha1", "kind": "FineTuneJob",
                                           "metadata": {"name": "long"},
                                           "spec": _long_job(8192).model_dump(by_alias=True, mode="json")})  # fmt: skip
    out = io.StringIO()
    print_longest_table(document, rows, Console(file=out, width=400))
    text = out.getvalue()
    assert f"{MAX_SEQUENCE_LENGTH:,} (the API maximum)" in text and "8 GPUs" in text
    assert "65,536 (the API maximum)" not in text and "65,536" in text and "1 GPU (not split)" in text


def test_the_trainer_config_checks_the_same_rules_against_its_typed_model() -> None:
    job = load_documents(EXAMPLES / "custom-architecture.yaml").jobs[0]
    plan = plan_job(job.spec, load_documents(EXAMPLES / "inventory.yaml").pools).chosen
    assert plan is not None
    document = render_trainer_config(job, plan).to_api()
    heads = document["model"]["architecture"]["numAttentionHeads"]
    document["training"]["sequenceParallel"] = heads + 1  # divides no head count
    with pytest.raises(ValueError, match=f"must divide the model's {heads} attention heads"):
        TrainerConfig.model_validate(document)


def test_a_runner_up_that_splits_its_sequences_says_so() -> None:
    plan, _ = _plan()
    split = plan.model_copy(update={"strategy": plan.strategy.replaced(sequence_parallel=2, micro_batch_size=2)})
    reason = why_lost(split, plan)
    assert "each sequence split over 2 GPUs" in reason and "micro-batch" not in reason  # the same share per GPU
