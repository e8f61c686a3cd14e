"""Flex attention in the planner: chosen for a packed job where the pool runs it and it holds less than SDPA
(a model described by its sizes), refused where pinned and no pool runs it, never planned from a profile that
traced another kernel."""

from __future__ import annotations

from typing import Any

import pytest

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.vocabulary import Attention
from memfit.planner.attention import holds_less
from memfit.planner.search import PlanningError, plan_job
from tests.planning_fixtures import A100_NODE, DECLARED_LLAMA, V100_NODE, WITH_FLASH_ATTN, job, pool

CPU_POOL = pool("cpu", "cpu", 4, 1, 256)
LLAMA_8B_SIZES = {
    "family": "llama", "hiddenSize": 4096, "intermediateSize": 14336, "numLayers": 32, "numAttentionHeads": 32,
    "numKeyValueHeads": 8, "vocabSize": 128256,
}  # fmt: skip
"""Llama 3.1 8B typed as sizes: planned by the family's formulas, which count flex attention."""


def typed_job(sequence: int = 4096, **strategy: Any) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate(
        {
            "model": {"name": "llama-8b", "architecture": LLAMA_8B_SIZES},
            "dataset": {"source": {"pvc": "data"}},
            "method": "full",
            "training": {"globalBatchSize": 16, "sequenceLength": sequence},
            "strategy": strategy,
            "output": {"pvc": "out"},
        }
    )


def test_a_packed_job_of_typed_sizes_plans_flex_on_ampere_and_sdpa_before_it() -> None:
    on_a100 = plan_job(typed_job(), [A100_NODE]).chosen
    on_v100 = plan_job(typed_job(), [V100_NODE]).chosen
    assert on_a100 is not None and on_a100.strategy.attention == Attention.FLEX
    assert on_v100 is not None and on_v100.strategy.attention == Attention.SDPA


def test_flex_fits_a_micro_batch_that_sdpa_does_not_at_the_same_knobs() -> None:
    """What the choice buys on 8 A100s at 4096 tokens: the dense mask, its per-layer copies and keys and values
    repeated to 32 heads leave SDPA one sequence per micro-batch; flex fits two, and the plan is faster."""
    chosen = plan_job(typed_job(), [A100_NODE]).chosen
    assert chosen is not None and chosen.strategy.micro_batch_size == 2
    knobs = chosen.strategy
    pins = {
        "zeroStage": knobs.zero_stage, "gradientCheckpointing": knobs.gradient_checkpointing,
        "microBatchSize": knobs.micro_batch_size, "engine": knobs.engine, "masterWeights": knobs.master_weights,
        "offloadOptimizer": knobs.offload_optimizer, "offloadParameters": knobs.offload_parameters,
        "chunkedLoss": knobs.chunked_loss, "activationOffloading": knobs.activation_offloading,
        "sequenceParallel": knobs.sequence_parallel, "tiledMlp": knobs.tiled_mlp,
    }  # fmt: skip
    same_knobs_sdpa = plan_job(typed_job(**pins, attention="sdpa"), [A100_NODE])
    assert same_knobs_sdpa.chosen is None
    assert same_knobs_sdpa.rejected[0].reason.startswith("GPU memory")
    best_sdpa = plan_job(typed_job(attention="sdpa"), [A100_NODE]).chosen
    assert best_sdpa is not None and best_sdpa.strategy.micro_batch_size == 1
    assert chosen.throughput.tokens_per_second > best_sdpa.throughput.tokens_per_second


def test_flex_holds_less_for_typed_models_and_a_profile_plans_flash_from_its_unmasked_terms() -> None:
    """Where the trainer has flash-attn; without it (memfit's image) the profile plans its traced SDPA."""
    assert holds_less(DECLARED_LLAMA, Attention.FLEX, 2048)
    spec = job("llama-3.1-8b", "full", batch=16, sequence=4096)
    chosen = plan_job(spec, [A100_NODE], runtime=WITH_FLASH_ATTN).chosen
    assert chosen is not None and chosen.strategy.attention == Attention.FLASH
    default = plan_job(spec, [A100_NODE]).chosen
    assert default is not None and default.strategy.attention == Attention.SDPA


@pytest.mark.parametrize("pools", [[V100_NODE], [CPU_POOL]], ids=["v100", "cpu"])
def test_flex_pinned_where_no_pool_runs_it_is_refused(pools: list[Any]) -> None:
    with pytest.raises(PlanningError, match="strategy.attention flex: flex attention is planned only on Ampere"):
        plan_job(typed_job(attention="flex"), pools)


def test_flex_pinned_plans_only_on_the_pool_that_runs_it() -> None:
    result = plan_job(typed_job(attention="flex"), [V100_NODE, A100_NODE])
    assert result.chosen is not None and result.chosen.strategy.attention == Attention.FLEX
    assert all(candidate.strategy.pool == "a100" for candidate in result.candidates)
