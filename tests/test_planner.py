"""Planner decisions on realistic scenarios, and the rules every plan must keep."""

from __future__ import annotations

import pytest

from memfit.api.plan import current_identity
from memfit.planner.search import PlanningError, plan_job
from memfit.units import GIB
from tests.planning_fixtures import (
    A100_4_NODES,
    A100_NODE,
    ONE_A100,
    RTX_4090,
    RTX_4090_BIG_HOST,
    V100_NODE,
    job,
    pool,
)


def test_7b_full_on_8_a100_80gb_shards_states_over_all_gpus() -> None:
    result = plan_job(job("llama-2-7b", "full"), [A100_NODE])
    chosen = result.chosen
    assert chosen is not None and chosen.fits
    assert chosen.strategy.method == "full" and chosen.strategy.gpus == 8
    assert chosen.strategy.zero_stage >= 1  # 16 bytes x 6.7B parameters cannot sit on one GPU unsharded
    assert chosen.memory.per_gpu.total <= 0.9 * 80 * GIB
    assert chosen.strategy.master_weights == "fp32"  # fp32 masters fit: the planner keeps them
    unsharded = plan_job(job("llama-2-7b", "full", strategy={"zeroStage": 0, "masterWeights": "fp32"}), [A100_NODE])
    assert unsharded.chosen is None
    assert unsharded.rejected[0].reason.startswith("GPU memory: needs 1")  # over 100 GiB
    # Unpinned, nothing fits unsharded with fp32 masters, so the planner takes pure bf16 (8 bytes a parameter)
    # and says why.
    pure = plan_job(job("llama-2-7b", "full", strategy={"zeroStage": 0}), [A100_NODE]).chosen
    assert pure is not None and pure.strategy.master_weights == "bf16" and pure.strategy.zero_stage == 0
    assert pure.techniques is not None
    assert pure.techniques.endswith("bf16 master weights: nothing fits with fp32 masters")


def test_duplicate_options_are_not_enumerated() -> None:
    """ZeRO-0 only on one GPU (with several, ZeRO-1 holds less for the same traffic); ZeRO-1/3 on one
    GPU only when they offload (nothing is partitioned)."""
    result = plan_job(job("qwen2.5-0.5b", "full", batch=8), [A100_NODE])
    for candidate in result.candidates:
        s = candidate.strategy
        if s.engine != "deepspeed":
            assert s.zero_stage in (2, 3)  # FSDP2 always shards; on one GPU resharding still frees the gathered copy
        elif s.gpus > 1:
            assert s.zero_stage != 0
        else:
            assert s.zero_stage != 2
            assert s.zero_stage != 1 or s.offload_optimizer != "none"


def test_7b_on_one_24gb_card_with_a_small_host_trains_adapters() -> None:
    chosen = plan_job(job("llama-2-7b"), [RTX_4090]).chosen
    assert chosen is not None
    assert chosen.strategy.method in ("lora", "qlora")
    assert chosen.memory.per_gpu.total <= 0.9 * chosen.gpu_memory_bytes


def test_7b_full_on_one_24gb_card_offloads_the_optimizer_when_the_host_is_big() -> None:
    """ZeRO-Offload's headline case: full fine-tuning of a 7B model on one consumer GPU."""
    chosen = plan_job(job("llama-2-7b"), [RTX_4090_BIG_HOST]).chosen
    assert chosen is not None
    assert chosen.strategy.method == "full"
    assert chosen.strategy.offload_optimizer == "cpu"
    assert chosen.memory.per_gpu.optimizer_states == 0
    assert chosen.memory.per_node.cpu > 16 * chosen.parameter_count * 0.9  # fp32 master, states, gradients


def test_70b_on_one_80gb_card_needs_qlora() -> None:
    chosen = plan_job(job("llama-2-70b"), [ONE_A100]).chosen
    assert chosen is not None
    assert chosen.strategy.method == "qlora"
    assert chosen.strategy.zero_stage <= 2
    # 4-bit base: about half a byte per parameter, plus fp32 embeddings, LM head and norms.
    assert 0.5 * chosen.parameter_count < chosen.memory.per_gpu.parameters < 0.6 * chosen.parameter_count


def test_70b_full_on_4x8_a100_uses_zero3_across_nodes() -> None:
    chosen = plan_job(job("llama-2-70b", "full"), [A100_4_NODES]).chosen
    assert chosen is not None
    assert chosen.strategy.method == "full" and chosen.strategy.zero_stage == 3
    assert chosen.strategy.nodes >= 2


def test_nothing_fits_says_why_and_how_close() -> None:
    result = plan_job(job("llama-2-70b", "full"), [RTX_4090])
    assert result.chosen is None and result.candidates == []
    assert result.rejected and all(not r.fits for r in result.rejected)
    assert result.advice[0].startswith("nearest miss: ")
    assert result.rejected[0].reason in result.advice[0]


def test_every_candidate_keeps_the_global_batch_exact_and_fits_with_headroom() -> None:
    spec = job("llama-3.1-8b", batch=48, resources={"memoryHeadroomPercent": 15})
    result = plan_job(spec, [A100_NODE, V100_NODE, RTX_4090])
    assert result.candidates
    for candidate in result.candidates:
        s = candidate.strategy
        assert s.micro_batch_size * s.gradient_accumulation_steps * s.gpus // s.sequence_parallel == 48
        assert candidate.memory.per_gpu.total <= 0.85 * candidate.gpu_memory_bytes
        memory = candidate.memory
        assert memory.phases is not None and memory.binding is not None
        for phase in (memory.phases.forward_backward, memory.phases.optimizer_step):
            assert phase.total == phase.parameters + phase.gradients + phase.optimizer_states + phase.activations + (
                phase.overhead
            )
        assert memory.per_gpu.total == memory.phases.at(memory.binding).total
    # The planner's order: the method that changes the model least first (auto's preference), then the fastest.
    order = [(("full", "lora", "qlora").index(c.strategy.method), -c.throughput.tokens_per_second)
             for c in result.candidates]  # fmt: skip
    assert order == sorted(order)
    assert result.candidates[0] == result.chosen


def test_pinned_knobs_are_kept() -> None:
    spec = job("llama-2-7b", "full", strategy={"zeroStage": 2, "gradientCheckpointing": True, "microBatchSize": 2})
    result = plan_job(spec, [A100_NODE])
    assert result.candidates
    for candidate in result.candidates:
        s = candidate.strategy
        assert (s.zero_stage, s.gradient_checkpointing, s.micro_batch_size) == (2, True, 2)


def test_bf16_only_where_the_gpu_has_it() -> None:
    result = plan_job(job("qwen2.5-1.5b", "full"), [V100_NODE, A100_NODE])
    precisions = {c.strategy.pool: c.strategy.precision for c in result.candidates}
    assert precisions == {"v100": "fp16", "a100": "bf16"}


def test_max_gpus_and_pool_restriction() -> None:
    spec = job("llama-2-7b", "full", resources={"maxGPUs": 4, "pool": "a100"})
    result = plan_job(spec, [A100_NODE, pool("other", "NVIDIA-H100-80GB-HBM3", 8, 2, 2000)])
    assert result.candidates
    assert all(c.strategy.gpus <= 4 and c.strategy.pool == "a100" for c in result.candidates)


def test_unknown_pool_is_a_planning_error() -> None:
    with pytest.raises(PlanningError, match="'nope' is not a declared GPUPool; declared pools: a100"):
        plan_job(job("llama-2-7b", resources={"pool": "nope"}), [A100_NODE])


def test_excluding_a_strategy_that_ran_out_of_memory_picks_another() -> None:
    spec = job("llama-2-7b", "full")
    first = plan_job(spec, [A100_NODE]).chosen
    assert first is not None
    second = plan_job(spec, [A100_NODE], exclude={first.strategy.identity()}).chosen
    assert second is not None and second.strategy != first.strategy


def test_a_strategy_excluded_before_a_knob_existed_stays_excluded() -> None:
    """``status.excludedStrategies`` written before sequenceParallel and tiledMlp existed (their identities lack
    them) still exclude the strategy, which had them at their defaults; an identity naming an unknown knob
    excludes nothing."""
    spec = job("llama-2-7b", "full")
    first = plan_job(spec, [A100_NODE]).chosen
    assert first is not None and first.strategy.sequence_parallel == 1 and not first.strategy.tiled_mlp
    older = ",".join(p for p in first.strategy.identity().split(",") if not p.startswith(("sequence_", "tiled_")))
    assert current_identity(older) == first.strategy.identity() != older
    second = plan_job(spec, [A100_NODE], exclude={older}).chosen
    assert second is not None and second.strategy != first.strategy
    unknown = first.strategy.identity() + ",warp_drive=True"
    assert current_identity(unknown) == unknown
    assert plan_job(spec, [A100_NODE], exclude={unknown}).chosen == first


def test_longer_sequences_need_more_memory_and_checkpointing_saves_it() -> None:
    def total(sequence: int, checkpointing: bool) -> int:
        spec = job("llama-3.1-8b", "full", batch=8, sequence=sequence,
                   strategy={"zeroStage": 3, "gradientCheckpointing": checkpointing, "microBatchSize": 1})  # fmt: skip
        result = plan_job(spec, [A100_NODE])
        candidate = result.chosen or result.rejected[0]
        return candidate.memory.per_gpu.total

    assert total(1024, False) < total(2048, False) < total(4096, False)
    assert total(4096, True) < total(4096, False)


def test_auto_prefers_full_fine_tuning_when_it_fits() -> None:
    result = plan_job(job("qwen2.5-0.5b"), [A100_NODE])
    assert result.chosen is not None and result.chosen.strategy.method == "full"


def test_advice_for_a_host_memory_shortfall_points_at_the_host_and_the_method() -> None:
    result = plan_job(job("llama-3.1-70b", "full"), [pool("l4", "NVIDIA-L4", 1, 4, 60)])
    assert result.chosen is None and result.rejected[0].reason.startswith("CPU memory")
    assert any("cpuMemoryGiBPerNode" in line and "nvmeGiBPerNode" in line for line in result.advice)
    assert any(line.startswith("method lora (adapters on a frozen base) would fit: lora ") for line in result.advice)


def test_advice_for_a_gpu_shortfall_names_the_gpu_size_that_would_fit() -> None:
    result = plan_job(job("llama-2-13b", "full", strategy={"zeroStage": 0}), [pool("l4", "NVIDIA-L4", 1, 1, 1000)])
    assert result.chosen is None
    assert any("would fit it" in line for line in result.advice)
