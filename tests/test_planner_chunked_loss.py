"""strategy.chunkedLoss: the memory and speed it is modelled with, and the planner choosing it only where
it makes a plan fit or makes a faster plan fit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.api.knobs import Knobs, conflicts
from memfit.api.plan import Strategy
from memfit.api.vocabulary import Engine
from memfit.catalog.models import model_preset as preset_shape
from memfit.memory.activations import ActivationSetup, estimate_activations, head_and_loss
from memfit.planner.search import plan_job
from memfit.planner.throughput import _training_flops_per_token
from tests.planning_fixtures import A100_NODE, ONE_A100, RTX_4090, job

STRATEGY = Strategy(method="full", pool="a100", nodes=1, gpus_per_node=8, zero_stage=2, offload_optimizer="none",
                    offload_parameters="none", gradient_checkpointing=False, micro_batch_size=2,
                    gradient_accumulation_steps=2, precision="bf16", optimizer="adamw", attention="sdpa")  # fmt: skip


def test_the_summary_names_it_and_the_default_is_off() -> None:
    assert STRATEGY.chunked_loss is False and "chunked" not in STRATEGY.summary()
    assert "zero2 chunked-ce mb2x2" in replace(STRATEGY, chunked_loss=True).summary()


def test_every_engine_and_stage_can_have_it() -> None:
    """DeepSpeed's ZeRO-3 gathers the head's weight for the loss as for the head's forward; fsdp2 gathers its root
    (the head's group)."""
    assert not any(conflicts(Knobs(zero_stage=stage, chunked_loss=True)) for stage in range(4))
    assert not conflicts(Knobs(zero_stage=3, chunked_loss=True, engine=Engine.FSDP2))
    pinned = job("llama-3-8b", "full", strategy={"zeroStage": 3, "chunkedLoss": True})
    result = plan_job(pinned, [A100_NODE])
    assert result.chosen is not None and result.chosen.strategy.chunked_loss
    assert {c.strategy.engine for c in result.candidates} >= {Engine.DEEPSPEED}


def test_the_loss_buffers_shrink_from_twelve_bytes_per_logit_to_one_chunk() -> None:
    shape = preset_shape("llama-3-8b")
    setup = ActivationSetup("full", "bf16", False, 2, 2048, "sdpa")
    plain, chunked = head_and_loss(shape, setup), head_and_loss(shape, replace(setup, chunked_loss=True))
    assert plain > 12 * 4096 * shape.vocab_size
    assert chunked < plain / 4  # the head gradient (1 GiB, made by the loss backward) is the largest part
    assert estimate_activations(shape, replace(setup, chunked_loss=True)).peak < estimate_activations(shape, setup).peak


def test_it_costs_the_recomputed_lm_head_matmul() -> None:
    shape = preset_shape("llama-3-8b")
    extra = _training_flops_per_token(shape, replace(STRATEGY, chunked_loss=True), 2048) - _training_flops_per_token(
        shape, STRATEGY, 2048
    )
    assert extra == 2 * shape.hidden_size * shape.vocab_size


@pytest.mark.parametrize(
    ("preset", "method", "pool"),
    [("llama-3-8b", "full", A100_NODE), ("llama-3.2-1b", "full", RTX_4090), ("qwen2.5-7b", "lora", RTX_4090),
     ("gemma-2-9b", "lora", ONE_A100)],
)  # fmt: skip
def test_pinning_it_off_is_the_plan_without_it(preset: str, method: str, pool) -> None:
    pinned = plan_job(job(preset, method, strategy={"chunkedLoss": False}), [pool])
    unpinned = plan_job(job(preset, method), [pool])
    assert not any(c.strategy.chunked_loss for c in pinned.candidates + pinned.rejected)
    # Every plan without it is the same plan, to the byte (fewer of them: recomputation is not evaluated
    # where the chunked loss makes the largest micro-batch fit without it).
    known = [c.model_dump() for c in pinned.candidates]
    assert all(c.model_dump() in known for c in unpinned.candidates if not c.strategy.chunked_loss)
    assert unpinned.chosen is not None and pinned.chosen is not None
    if not unpinned.chosen.strategy.chunked_loss:
        assert unpinned.chosen == pinned.chosen
    else:
        assert unpinned.chosen.throughput.tokens_per_second > pinned.chosen.throughput.tokens_per_second


def test_it_is_chosen_only_where_it_makes_a_plan_fit_or_a_faster_plan_fit() -> None:
    """Qwen2.5's 152k vocabulary on a 24 GB card: LoRA fits only with the parameters offloaded to CPU
    without it; with it the base stays on the GPU, which is faster."""
    without = plan_job(job("qwen2.5-7b", "lora", strategy={"chunkedLoss": False}), [RTX_4090]).chosen
    chosen = plan_job(job("qwen2.5-7b", "lora"), [RTX_4090]).chosen
    assert without is not None and chosen is not None
    assert without.strategy.offload_parameters == "cpu"
    assert chosen.strategy.chunked_loss and chosen.strategy.offload_parameters == "none"
    assert chosen.throughput.tokens_per_second > without.throughput.tokens_per_second
    # Where the largest micro-batch fits without it, it is never evaluated.
    result = plan_job(job("qwen2.5-0.5b", "full", batch=8), [A100_NODE])
    assert not any(c.strategy.chunked_loss for c in result.candidates)
    # Where it is evaluated, it is recorded only with a larger micro-batch than the same knobs without it.
    result = plan_job(job("llama-3-8b", "full"), [A100_NODE])
    plain = {_knobs(c.strategy): c.strategy.micro_batch_size for c in result.candidates if not c.strategy.chunked_loss}
    for candidate in result.candidates:
        if candidate.strategy.chunked_loss:
            assert candidate.strategy.micro_batch_size > plain.get(_knobs(candidate.strategy), 0)


def _knobs(s: Strategy) -> tuple:
    return (s.nodes, s.gpus_per_node, s.zero_stage, s.offload_optimizer, s.offload_parameters,
            s.gradient_checkpointing)  # fmt: skip
