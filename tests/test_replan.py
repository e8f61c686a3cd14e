"""Re-planning after an out-of-memory failure (memfit.planner.replan): leaner, layout-keeping first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.loading import load_documents
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import MasterWeights, Method, Precision
from memfit.contract.layout import CheckpointLayout
from memfit.planner.replan import (
    LEANER_BY,
    MAX_HEADROOM_PERCENT,
    checkpoint_layout,
    leaner_headroom_percent,
    replan_after_oom,
)
from memfit.planner.search import plan_job

ROOT = Path(__file__).parent.parent
POOLS: list[GPUPool] = load_documents(ROOT / "examples" / "inventory.yaml").pools


def spec(preset: str | None = None, **changes: Any) -> FineTuneJobSpec:
    document = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-lora.yaml").read_text())["spec"]
    if preset is not None:
        document["model"]["architecture"] = {"preset": preset}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    return FineTuneJobSpec.model_validate(document)


def first_plan(job: FineTuneJobSpec, pools: list[GPUPool] | None = None) -> PlanCandidate:
    chosen = plan_job(job, POOLS if pools is None else pools).chosen
    assert chosen is not None
    return chosen


def usable(plan: PlanCandidate, headroom_percent: float) -> int:
    """The planner's per-GPU limit under ``headroom_percent``."""
    return int(plan.gpu_memory_bytes * (1 - headroom_percent / 100))


def with_total(plan: PlanCandidate, total: int) -> PlanCandidate:
    """The same plan estimated at ``total`` bytes per GPU."""
    per_gpu = replace(plan.memory.per_gpu, total=total)
    return plan.model_copy(update={"memory": replace(plan.memory, per_gpu=per_gpu)})


def global_batch(plan: PlanCandidate) -> int:
    s = plan.strategy
    return s.micro_batch_size * s.gradient_accumulation_steps * s.gpus // s.sequence_parallel


# ------------------------------------------------------------------------------------------------
# checkpoint_layout
# ------------------------------------------------------------------------------------------------


def test_checkpoint_layout_is_method_precision_zero_stage_gpu_count_and_masters() -> None:
    plan = first_plan(spec(strategy={"chunkedLoss": False}))  # the plan of the zero-2 layout
    s = plan.strategy
    assert checkpoint_layout(plan) == (s.method, s.precision, s.zero_stage, s.gpus, s.master_weights, s.engine)
    assert checkpoint_layout(plan) == ("full", "bf16", 2, 8, "fp32", "deepspeed")


def test_checkpoint_layout_ignores_knobs_that_do_not_change_the_checkpoint() -> None:
    plan = first_plan(spec())
    strategy = replace(
        plan.strategy,
        **{
            "gradient_checkpointing": True,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "offload_optimizer": "cpu",
            "attention": "eager",
            "nodes": 2,
            "gpus_per_node": 4,
        },  # fmt: skip
    )
    assert checkpoint_layout(plan.model_copy(update={"strategy": strategy})) == checkpoint_layout(plan)


@pytest.mark.parametrize("update", [{"method": "lora"}, {"precision": "fp16"}, {"zero_stage": 3}, {"gpus_per_node": 4}])
@pytest.mark.slow
def test_checkpoint_layout_changes_with_each_of_its_parts(update: dict[str, Any]) -> None:
    plan = first_plan(spec())
    changed = plan.model_copy(update={"strategy": replace(plan.strategy, **update)})
    assert checkpoint_layout(changed) != checkpoint_layout(plan)


# ------------------------------------------------------------------------------------------------
# leaner_headroom_percent
# ------------------------------------------------------------------------------------------------


def test_leaner_headroom_is_the_failed_share_less_leaner_by() -> None:
    job = spec()
    plan = first_plan(job)
    used = plan.memory.per_gpu.total / plan.gpu_memory_bytes
    assert leaner_headroom_percent(job, plan) == pytest.approx(100 * (1 - used * (1 - LEANER_BY)))
    assert leaner_headroom_percent(job, plan) > job.resources.memory_headroom_percent


def test_under_the_leaner_headroom_the_failed_estimate_no_longer_fits_and_ten_percent_less_does() -> None:
    job = spec()
    plan = first_plan(job)
    limit = usable(plan, leaner_headroom_percent(job, plan))
    total = plan.memory.per_gpu.total
    assert total > limit
    assert int(total * (1 - LEANER_BY)) - 1 <= limit <= int(total * (1 - LEANER_BY)) + 1


@pytest.mark.parametrize("share", [0.5, 0.8, 0.95, 0.999])
@pytest.mark.slow
def test_leaner_headroom_for_several_failed_shares(share: float) -> None:
    job = spec()
    plan = first_plan(job)
    failed = with_total(plan, int(plan.gpu_memory_bytes * share))
    headroom = leaner_headroom_percent(job, failed)
    assert headroom == pytest.approx(100 * (1 - share * (1 - LEANER_BY)), abs=1e-6)
    assert usable(failed, headroom) < failed.memory.per_gpu.total


def test_leaner_headroom_never_drops_below_the_specs_headroom() -> None:
    job = spec(resources={"memoryHeadroomPercent": 60})
    plan = first_plan(spec())
    failed = with_total(plan, int(plan.gpu_memory_bytes * 0.3))  # would ask for 73%
    assert leaner_headroom_percent(job, failed) == pytest.approx(73.0, abs=1e-6)
    failed = with_total(plan, int(plan.gpu_memory_bytes * 0.9))  # would ask for 19%
    assert leaner_headroom_percent(job, failed) == 60


def test_leaner_headroom_is_capped_at_the_apis_bound() -> None:
    job = spec()
    plan = first_plan(job)
    tiny = with_total(plan, int(plan.gpu_memory_bytes * 0.05))
    assert leaner_headroom_percent(job, tiny) == MAX_HEADROOM_PERCENT
    assert MAX_HEADROOM_PERCENT < 90  # the API's bound: memoryHeadroomPercent < 90
    # The capped headroom is itself a valid spec.
    FineTuneJobSpec.model_validate(
        {**job.to_api(), "resources": {"memoryHeadroomPercent": leaner_headroom_percent(job, tiny)}}
    )


# ------------------------------------------------------------------------------------------------
# replan_after_oom
# ------------------------------------------------------------------------------------------------


def test_the_first_replan_of_the_example_keeps_the_layout_and_is_leaner() -> None:
    job = spec()
    failed = first_plan(job)
    result, kept = replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    chosen = result.chosen
    assert chosen is not None and kept is True
    assert checkpoint_layout(chosen) == checkpoint_layout(failed)
    assert chosen.strategy.pool == failed.strategy.pool
    assert chosen.memory.per_gpu.total <= failed.memory.per_gpu.total * (1 - LEANER_BY)
    assert chosen.strategy.summary() != failed.strategy.summary()
    assert global_batch(chosen) == job.training.global_batch_size


@pytest.mark.slow
def test_a_chain_of_replans_gets_strictly_leaner_and_honours_every_exclusion() -> None:
    job = spec()
    failed = first_plan(job)
    excluded = [failed.strategy.identity()]
    seen_change = False
    for _ in range(8):
        result, kept = replan_after_oom(job, POOLS, failed, excluded)
        chosen = result.chosen
        if chosen is None:
            break
        assert chosen.strategy.identity() not in excluded
        assert chosen.memory.per_gpu.total <= failed.memory.per_gpu.total * (1 - LEANER_BY) + 1
        assert kept == (checkpoint_layout(chosen) == checkpoint_layout(failed))
        assert chosen.strategy.gpus <= 8  # spec.resources.maxGPUs
        assert global_batch(chosen) == job.training.global_batch_size
        seen_change = seen_change or not kept
        failed = chosen
        excluded.append(chosen.strategy.identity())
    assert len(excluded) >= 4 and seen_change


@pytest.mark.slow
def test_layout_is_kept_whenever_some_same_layout_strategy_fits() -> None:
    """When kept is False, no strategy with the failed layout fits under the leaner headroom."""
    job = spec()
    failed = first_plan(job)
    excluded = [failed.strategy.identity()]
    for _ in range(8):
        result, kept = replan_after_oom(job, POOLS, failed, excluded)
        if result.chosen is None:
            break
        if not kept:
            headroom = leaner_headroom_percent(job, failed)
            tight = job.model_copy(
                update={"resources": job.resources.model_copy(update={"memory_headroom_percent": headroom})}
            )
            # Search wide (no method/precision pins) and look for any fitting same-layout candidate.
            every = plan_job(tight, POOLS, exclude=excluded)
            same = [c for c in every.candidates if checkpoint_layout(c) == checkpoint_layout(failed)]
            assert same == [], f"{same[0].strategy.summary()} keeps the layout and fits"
        failed = result.chosen
        excluded.append(failed.strategy.identity())


def test_a_pinned_method_is_never_lightened() -> None:
    job = spec(method="full")
    failed = first_plan(job)
    excluded = [failed.strategy.identity()]
    for _ in range(10):
        result, _ = replan_after_oom(job, POOLS, failed, excluded)
        if result.chosen is None:
            break
        assert result.chosen.strategy.method == "full"
        failed = result.chosen
        excluded.append(failed.strategy.identity())


def test_auto_may_move_to_a_lighter_method_once_full_is_spent() -> None:
    # Full fine-tuning of the 8B model on one L4 cannot fit at all: auto plans LoRA or QLoRA there.
    job = spec(resources={"pool": "l4", "maxGPUs": 1})
    failed = first_plan(job)
    assert failed.strategy.method in ("lora", "qlora")
    methods = {failed.strategy.method}
    excluded = [failed.strategy.identity()]
    for _ in range(10):
        result, _ = replan_after_oom(job, POOLS, failed, excluded)
        if result.chosen is None:
            break
        assert result.chosen.memory.per_gpu.total < failed.memory.per_gpu.total
        failed = result.chosen
        methods.add(failed.strategy.method)
        excluded.append(failed.strategy.identity())
    assert "full" not in methods


def test_the_failed_strategy_is_excluded_even_where_it_would_fit_again() -> None:
    job = spec()
    failed = first_plan(job)
    result, _ = replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    assert all(c.strategy.summary() != failed.strategy.summary() for c in result.candidates)


def test_replan_respects_the_specs_pool_restriction() -> None:
    job = spec(resources={"pool": "a100-80gb", "maxGPUs": 8})
    failed = first_plan(job)
    excluded = [failed.strategy.identity()]
    for _ in range(6):
        result, _ = replan_after_oom(job, POOLS, failed, excluded)
        if result.chosen is None:
            break
        assert result.chosen.strategy.pool == "a100-80gb" and result.chosen.strategy.gpus <= 8
        failed = result.chosen
        excluded.append(failed.strategy.identity())


def leanest_job() -> FineTuneJobSpec:
    """Llama 3.1 8B on at most 8 A100s, pinned to the leanest strategy there is: fsdp2 ZeRO-3, everything
    offloaded, recomputation, activations on the host, the chunked loss."""
    return spec(
        method="full",
        training={"globalBatchSize": 8, "precision": "bf16"},
        resources={"pool": "a100-80gb", "maxGPUs": 8},
        strategy={"engine": "fsdp2", "zeroStage": 3, "offloadOptimizer": "cpu", "offloadParameters": "cpu",
                  "gradientCheckpointing": True, "activationOffloading": True, "chunkedLoss": True},
    )  # fmt: skip


def test_nothing_leaner_gives_no_plan_advice_and_kept_false() -> None:
    job = leanest_job()
    failed = first_plan(job)
    result, kept = replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    assert result.chosen is None and kept is False and result.advice


def test_a_plan_as_heavy_as_the_failed_one_is_no_replan_where_the_headroom_is_capped() -> None:
    """The failed plan used a tenth of an 80 GB GPU: the headroom that would leave no room for its estimate
    is above the API's bound, so the plan on half the GPUs, accumulating twice, fits the capped headroom with
    the failed plan's very estimate. It is not leaner, and the re-plan says so."""
    job = leanest_job()
    failed = first_plan(job)
    assert leaner_headroom_percent(job, failed) == MAX_HEADROOM_PERCENT
    unfiltered = plan_job(
        job.model_copy(
            update={"resources": job.resources.model_copy(update={"memory_headroom_percent": MAX_HEADROOM_PERCENT})}
        ),
        POOLS,
        exclude=[failed.strategy.identity()],
    )
    assert unfiltered.chosen is not None  # as heavy: the capped headroom alone lets it through
    assert unfiltered.chosen.memory.per_gpu.total >= failed.memory.per_gpu.total * (1 - LEANER_BY)
    result, _ = replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    assert result.chosen is None and "is not 10% below the failed plan's" in result.advice[0]


def test_replan_does_not_change_the_spec_it_is_given() -> None:
    job = spec()
    before = job.to_api()
    failed = first_plan(job)
    replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    assert job.to_api() == before


def test_a_user_pinned_micro_batch_still_gives_an_exact_global_batch() -> None:
    """The planner keeps training.globalBatchSize exact (micro-batch x accumulation x GPUs), pinned
    micro-batch or not; a re-plan inherits whatever the first plan does."""
    job = spec(strategy={"microBatchSize": 2})
    failed = first_plan(job)
    assert failed.strategy.micro_batch_size == 2
    assert global_batch(failed) == 64, f"{failed.strategy.summary()} trains {global_batch(failed)} sequences/step"
    result, _ = replan_after_oom(job, POOLS, failed, [failed.strategy.identity()])
    assert result.chosen is not None and global_batch(result.chosen) == 64


def test_master_weights_are_part_of_the_checkpoint_layout() -> None:
    fp32 = CheckpointLayout(Method.FULL, Precision.BF16, 2, 8)
    bf16 = fp32._replace(master_weights=MasterWeights.BF16)
    assert fp32.directory_name == "full-bf16-zero2-8ranks"  # the name fp32-master runs always had
    assert fp32.to_dict() == {"method": "full", "precision": "bf16", "zeroStage": 2, "worldSize": 8}
    assert bf16 != fp32 and bf16.directory_name == "full-bf16-zero2-8ranks-bf16masters"
    assert bf16.to_dict() == {**fp32.to_dict(), "masterWeights": "bf16"}


def test_a_replan_resumes_from_the_checkpoint_rather_than_start_over_faster() -> None:
    """The tiny example on two CPU ranks, out of memory under ZeRO-1 (the e2e OOM test): the fastest leaner
    plan, ZeRO-0, cannot load a ZeRO-1 checkpoint and would start from the weights; a leaner plan that
    resumes (converted) goes first, and only where the failed run left no checkpoint does speed decide."""
    document = yaml.safe_load((ROOT / "examples" / "tiny" / "job.yaml").read_text())["spec"]
    document["resources"] = {"pool": "cpu", "maxGPUs": 2}
    job = FineTuneJobSpec.model_validate(document)
    pools = load_documents(ROOT / "examples" / "cpu" / "pool.yaml").pools
    failed = first_plan(job, pools)
    assert (failed.strategy.zero_stage, failed.strategy.gpus) == (1, 2)
    excluded = [failed.strategy.identity()]
    fastest, _ = replan_after_oom(job, pools, failed, excluded, checkpointed=False)
    resuming, kept = replan_after_oom(job, pools, failed, excluded)
    assert fastest.chosen is not None and resuming.chosen is not None and not kept
    assert checkpoint_layout(failed).converts_to(checkpoint_layout(fastest.chosen)) is not None
    assert checkpoint_layout(failed).converts_to(checkpoint_layout(resuming.chosen)) is None
    assert resuming.why_chosen is not None and "resumes from the last checkpoint" in resuming.why_chosen
    assert resuming.chosen.memory.per_gpu.total <= failed.memory.per_gpu.total * (1 - LEANER_BY)
