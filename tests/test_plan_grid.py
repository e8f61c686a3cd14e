"""Every plan the planner reports has the memory of its own strategy: the search's caches may serve an
evaluation only what a fresh computation of that exact strategy gives (a cache key that left out a knob
static memory reads once served fsdp2's chunked-loss variants the plain variant's memory)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.plan import PlanCandidate, PlanResult
from memfit.memory.estimate import activation_setup, peak_memory, static_memory
from memfit.memory.profiled_activations import model_activations
from memfit.memory.setup import StaticSetup
from memfit.planner.search import lora_settings, plan_job
from tests.plan_grid import INVENTORY, grid_jobs

GRID = dict(grid_jobs())

pytestmark = pytest.mark.slow  # the module plans every job of the grid


@pytest.fixture(scope="module")
def plans() -> dict[str, PlanResult]:
    return {name: plan_job(spec, INVENTORY) for name, spec in GRID.items()}


def fresh_memory(spec: FineTuneJobSpec, candidate: PlanCandidate) -> object:
    """The memory of the candidate's strategy computed from nothing but that strategy."""
    shape = spec.planned_model()
    lora = lora_settings(spec, shape)
    strategy = candidate.strategy
    static = static_memory(shape, StaticSetup.of(strategy), lora)
    setup = activation_setup(shape, strategy, spec.training.sequence_length, lora)
    return peak_memory(static, model_activations(shape, setup), strategy.gradient_accumulation_steps)


def test_the_grid_covers_fsdp2_chunked_loss_plans(plans: dict[str, PlanResult]) -> None:
    reported = [c.strategy for plan in plans.values() for c in [*plan.candidates, *plan.rejected]]
    assert any(s.engine == "fsdp2" and s.chunked_loss for s in reported)
    assert any(s.engine == "deepspeed" and s.activation_offloading for s in reported)


@pytest.mark.parametrize("name", sorted(GRID))
def test_every_reported_plan_has_its_own_strategys_memory(name: str, plans: dict[str, PlanResult]) -> None:
    spec = GRID[name]
    for candidate in [*plans[name].candidates, *plans[name].rejected]:
        assert candidate.memory == fresh_memory(spec, candidate), candidate.strategy.summary()


def test_a_changed_knob_changes_the_fresh_computation() -> None:
    """The check above can fail: fsdp2's static memory reads the chunked loss."""
    spec = GRID["llama-3.2-3b full fsdp2"]
    plan = plan_job(spec, INVENTORY).chosen
    assert plan is not None
    flipped = plan.model_copy(update={"strategy": replace(plan.strategy, chunked_loss=not plan.strategy.chunked_loss)})
    assert fresh_memory(spec, flipped) != plan.memory
