"""The optimizer step in backward (``strategy.optimizerInBackward``): the API's rules and their messages, the
``maxGradNorm: 0`` (no clipping) it needs kept through serialisation, what is rendered for the trainer, its
memory terms (no sharded gradient outlives its group) and the planner's use of it (only where the job allows
it, and only where it buys a fit or a larger micro-batch)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import pool_capacity
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Attention, Engine, MasterWeights, Method, Offload, Optimizer, Precision
from memfit.catalog.models import MODEL_PRESETS
from memfit.contract.engines import DeepSpeedEngineSection, Fsdp2EngineSection
from memfit.contract.trainer_config import TrainerConfig
from memfit.memory.engines.fsdp2 import fsdp2_groups, fsdp2_step
from memfit.memory.estimate import activation_setup, model_states, peak_memory, static_memory
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import Adapters, LoraSettings, StaticSetup
from memfit.planner.search import plan_job
from memfit.render.deepspeed import deepspeed_config
from memfit.render.trainer_config import render_trainer_config
from tests.planning_fixtures import RTX_4090, job
from tests.trainer.runs import make_config

UNCLIPPED = {"globalBatchSize": 8, "sequenceLength": 2048, "maxGradNorm": 0.0}
SHAPE = MODEL_PRESETS["llama-2-7b"]
LORA = LoraSettings(Adapters(16, ("all-linear",)), True)


def _spec(training: dict[str, Any] | None = None, **strategy: Any) -> FineTuneJobSpec:
    return job("llama-3.2-1b", "full", training=training or UNCLIPPED, strategy=strategy)


# --- the API's rules ------------------------------------------------------------------------------------


def test_an_unclipped_fsdp2_job_may_pin_it_and_keeps_its_zero_norm_when_stored() -> None:
    spec = _spec(engine="fsdp2", optimizerInBackward=True)
    stored = spec.to_api()
    assert stored["training"]["maxGradNorm"] == 0
    assert FineTuneJobSpec.model_validate(stored).training.max_grad_norm == 0
    assert job("llama-3.2-1b").training.max_grad_norm == 1.0  # the default still clips


@pytest.mark.parametrize(
    ("training", "strategy", "message"),
    [
        (UNCLIPPED, {"engine": "deepspeed", "zeroStage": 1}, "on the deepspeed engine needs zeroStage 0"),
        (UNCLIPPED, {"engine": "deepspeed", "masterWeights": "fp32"}, "it needs strategy.masterWeights bf16"),
        ({"globalBatchSize": 8}, {"engine": "fsdp2"}, "set training.maxGradNorm: 0"),
        ({**UNCLIPPED, "maxGradNorm": 0.5}, {}, "cannot clip gradients"),
        (UNCLIPPED, {"microBatchSize": 2}, r"needs gradient accumulation 1 \(got 2\)"),
    ],
    ids=["deepspeed-zero1", "deepspeed-fp32-masters", "default-clipping", "clipping", "accumulating"],
)
def test_each_rule_refuses_with_its_own_message(
    training: dict[str, Any], strategy: dict[str, Any], message: str
) -> None:
    resources = {"maxGPUs": 2}  # 8 sequences of micro-batch 2 on at most 2 GPUs accumulate 2
    with pytest.raises(ValidationError, match=message):
        job("llama-3.2-1b", "full", training=training, resources=resources,
            strategy={**strategy, "optimizerInBackward": True})  # fmt: skip


def test_the_trainer_config_holds_the_same_rules(tmp_path: Path) -> None:
    def config(**options: Any) -> TrainerConfig:
        return make_config(tmp_path, engine="fsdp2", stage=3, offload=False, optimizer_in_backward=True, **options)

    assert config(max_grad_norm=0.0).engine.optimizer_in_backward
    with pytest.raises(ValidationError, match="set training.maxGradNorm: 0"):
        config()
    with pytest.raises(ValidationError, match="needs gradient accumulation 1"):
        config(max_grad_norm=0.0, accumulation=2)
    loaded = TrainerConfig.model_validate_json(config(max_grad_norm=0.0).to_json())
    assert (
        loaded.training.max_grad_norm == 0
        and isinstance(loaded.engine, Fsdp2EngineSection)
        and loaded.engine.optimizer_in_backward
    )


# --- planning and rendering -----------------------------------------------------------------------------


def _fits_without_it(spec: FineTuneJobSpec, strategy: Strategy) -> bool:
    plain = dataclasses.replace(strategy, optimizer_in_backward=False)
    shape = spec.planned_model()
    static = static_memory(shape, StaticSetup.of(plain), LORA)
    acts = model_activations(shape, activation_setup(shape, plain, spec.training.sequence_length, LORA))
    limit = pool_capacity(RTX_4090).gpu_memory_bytes * (1 - spec.resources.memory_headroom_percent / 100)
    return peak_memory(static, acts, plain.gradient_accumulation_steps).per_gpu.total <= limit


def test_the_planner_steps_in_backward_where_only_that_fits_the_micro_batch() -> None:
    """Full fine-tuning of a 1B model on one 24 GB GPU: its fp32 gradients (5 GB) are what stops a micro-batch
    of 8 from fitting; without clipping the step in backward frees them, and the plan says so."""
    spec = _spec(engine="fsdp2")
    result = plan_job(spec, [RTX_4090])
    assert result.chosen is not None
    chosen = result.chosen.strategy
    assert chosen.optimizer_in_backward and chosen.gradient_accumulation_steps == 1 and "opt-in-bwd" in chosen.summary()
    assert result.chosen.techniques is not None and "optimizer step in backward" in result.chosen.techniques
    assert not _fits_without_it(spec, chosen)
    for candidate in result.candidates:
        if candidate.strategy.optimizer_in_backward:
            assert candidate.strategy.engine == Engine.FSDP2 and candidate.strategy.gradient_accumulation_steps == 1
            assert "optimizer step in backward" in (candidate.techniques or "")


@pytest.mark.parametrize("strategy", [{"engine": "fsdp2"}, {}], ids=["fsdp2", "any-engine"])
def test_a_clipped_job_is_never_planned_with_it(strategy: dict[str, Any]) -> None:
    result = plan_job(_spec({**UNCLIPPED, "maxGradNorm": 1.0}, **strategy), [RTX_4090])
    assert result.candidates and not any(c.strategy.optimizer_in_backward for c in result.candidates)
    assert not any(r.strategy.optimizer_in_backward for r in result.rejected)


def test_pinned_it_plans_fsdp2_at_accumulation_one_only() -> None:
    result = plan_job(_spec(optimizerInBackward=True), [RTX_4090])
    assert result.candidates
    for candidate in result.candidates:
        s = candidate.strategy
        assert s.optimizer_in_backward and s.engine == Engine.FSDP2 and s.gradient_accumulation_steps == 1


def test_the_rendered_trainer_config_steps_in_backward_without_clipping() -> None:
    spec = _spec(engine="fsdp2")
    plan = plan_job(spec, [RTX_4090]).chosen
    assert plan is not None
    config = render_trainer_config(FineTuneJob.model_validate({"metadata": {"name": "j"}, "spec": spec.to_api()}), plan)
    assert isinstance(config.engine, Fsdp2EngineSection) and config.engine.optimizer_in_backward
    assert config.training.max_grad_norm == 0 and config.training.gradient_accumulation_steps == 1
    assert TrainerConfig.model_validate_json(config.to_json()) == config


def test_deepspeed_steps_in_backward_at_zero0_with_bf16_masters_and_builds_no_optimizer() -> None:
    """The trainer builds one optimizer per parameter (DeepSpeed none) and is told to step them in backward."""
    spec = _spec(engine="deepspeed", zeroStage=0, masterWeights="bf16", optimizerInBackward=True)
    plan = plan_job(spec, [RTX_4090]).chosen
    assert plan is not None and plan.strategy.optimizer_in_backward
    rendered = deepspeed_config(spec, plan.strategy)
    assert rendered["gradient_clipping"] == 0.0 and "optimizer" not in rendered and "bf16" not in rendered
    job = FineTuneJob.model_validate({"metadata": {"name": "j"}, "spec": spec.to_api()})
    config = render_trainer_config(job, plan)
    assert isinstance(config.engine, DeepSpeedEngineSection) and config.engine.optimizer_in_backward
    with pytest.raises(ValueError, match="on the deepspeed engine needs zeroStage 0"):
        deepspeed_config(spec, dataclasses.replace(plan.strategy, zero_stage=1))


def test_deepspeed_in_backward_keeps_one_gradient_and_no_buckets() -> None:
    """ZeRO-0: each whole gradient is all-reduced in place, stepped on and freed as soon as it is made, so
    the largest one (the embedding's) is what stays; DeepSpeed's all-reduce buckets are not allocated."""
    two = dict(engine=Engine.DEEPSPEED, zero_stage=0, gpus_per_node=2, master_weights=MasterWeights.BF16)
    after, within = (model_states(SHAPE, _fsdp2(**two, optimizer_in_backward=b), LORA.adapters) for b in (False, True))
    largest = SHAPE.vocab_size * SHAPE.hidden_size
    assert after.gradients == 2 * SHAPE.parameter_count and within.gradients == 2 * largest
    assert within.step_gradients == 0 < after.step_gradients
    buckets = [
        static_memory(SHAPE, StaticSetup.of(_fsdp2(**two, optimizer_in_backward=b)), LORA).communication_buffers
        for b in (False, True)
    ]
    assert buckets[1] == 0 < buckets[0]


# --- memory terms ---------------------------------------------------------------------------------------


def _fsdp2(**kw: Any) -> Strategy:
    fields: dict[str, Any] = dict(
        method=Method.FULL, pool="p", nodes=1, gpus_per_node=8, zero_stage=3, offload_optimizer=Offload.NONE,
        offload_parameters=Offload.NONE, gradient_checkpointing=False, micro_batch_size=1,
        gradient_accumulation_steps=1, precision=Precision.BF16, optimizer=Optimizer.ADAMW, attention=Attention.SDPA,
        engine=Engine.FSDP2,
    )  # fmt: skip
    return Strategy(**{**fields, **kw})


def test_only_one_groups_sharded_gradient_stays() -> None:
    groups = fsdp2_groups(SHAPE, Method.FULL, LORA.adapters)
    plain = model_states(SHAPE, _fsdp2(), LORA.adapters)
    stepped = model_states(SHAPE, _fsdp2(optimizer_in_backward=True), LORA.adapters)
    assert stepped.gradients == int(4 * max(groups.root_trained, groups.layer_trained) / 8) < plain.gradients
    assert (stepped.parameters, stepped.optimizer_states) == (plain.parameters, plain.optimizer_states)
    offloaded = model_states(SHAPE, _fsdp2(optimizer_in_backward=True, offload_optimizer=Offload.CPU,
                                           offload_parameters=Offload.CPU), LORA.adapters)  # fmt: skip
    assert offloaded.cpu_per_rank == plain.parameters + stepped.gradients + plain.optimizer_states


def test_no_sharded_gradient_outlives_its_groups_post_backward() -> None:
    strategy = _fsdp2(gradient_checkpointing=True)
    plain = fsdp2_step(SHAPE, StaticSetup.of(strategy), LORA.adapters)
    in_backward = StaticSetup.of(dataclasses.replace(strategy, optimizer_in_backward=True))
    stepped = fsdp2_step(SHAPE, in_backward, LORA.adapters)
    acts = model_activations(SHAPE, activation_setup(SHAPE, strategy, 2048, LORA))
    before, after = plain.moments(acts, False), stepped.moments(acts, False)
    first_layer, root_reduce = 4, 6
    assert before[first_layer].gradients - after[first_layer].gradients == (SHAPE.num_layers - 1) * (
        plain.layer_sharded_gradient
    )
    assert stepped.head_step_temporary == 4 * SHAPE.vocab_size * SHAPE.hidden_size // 8  # fp32 shard of the head
    assert after[root_reduce].gradients == (
        max(stepped.root_gradient, stepped.root_sharded_gradient) + stepped.head_step_temporary
        + stepped.root_reduce_input
    )  # fmt: skip
    assert all(a.gradients <= b.gradients + stepped.head_step_temporary for a, b in zip(after, before, strict=True))


def test_fsdp2_8bit_states_are_per_shard_and_paged_ones_on_the_host() -> None:
    """bitsandbytes steps each rank's shard: two 8-bit states and one fp32 absmax per 256 elements of it on the
    GPU, or (paged) only the absmaxes there and the 8-bit states in managed memory the host backs."""
    n = 8
    plain, paged = (
        model_states(SHAPE, _fsdp2(optimizer=o, master_weights=MasterWeights.BF16), LORA.adapters)
        for o in (Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT)
    )
    parameters = SHAPE.parameter_count
    assert plain.optimizer_states == pytest.approx(2 * parameters / n * (1 + 4 / 256), rel=0.01)
    assert plain.cpu_per_rank == 0
    assert paged.optimizer_states == pytest.approx(2 * parameters / n * 4 / 256, rel=0.02)  # + fp32 states of norms
    assert paged.cpu_per_rank == pytest.approx(2 * parameters / n, rel=0.01)
