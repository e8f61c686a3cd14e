"""Issue 11's bar: on the jobs peers published peak-memory figures for (examples/peers/torchtune.yaml), a GPU
with 1.1x the published memory and no headroom gets a plan, without offloading parameters or optimizer
states unless the peer did, and the planned total stays within 1.1x the figure."""

from __future__ import annotations

import pytest

from bench.peer_figures import FIGURES, MARGIN, PeerFigure, plan_figure
from memfit.api.vocabulary import Offload
from memfit.units import GIB


@pytest.mark.parametrize("figure", FIGURES, ids=[figure.job for figure in FIGURES])
def test_memfit_plans_the_peers_job_within_a_tenth_of_its_figure(figure: PeerFigure) -> None:
    plan = plan_figure(figure)
    assert plan is not None, f"{figure.job}: no plan on a GPU with {MARGIN}x {figure.published_gib} GiB"
    if not figure.peer_offloaded:
        assert plan.strategy.offload_optimizer == Offload.NONE and plan.strategy.offload_parameters == Offload.NONE
    assert plan.memory.per_gpu.total <= MARGIN * figure.published_gib * GIB
    assert plan.strategy.micro_batch_size == 2 and plan.strategy.gradient_accumulation_steps == 1  # the peer's batch


def test_the_pools_have_exactly_the_margin_over_the_published_figures() -> None:
    from bench.peer_figures import INVENTORY, JOBS
    from memfit.api.loading import load_documents

    documents = load_documents(JOBS, INVENTORY)
    memory = {pool.metadata.name: pool.spec.gpu_memory_gib for pool in documents.pools}
    for figure in FIGURES:
        job = next(job for job in documents.jobs if job.metadata.name == figure.job)
        assert job.spec.resources.memory_headroom_percent == 0
        assert memory[job.spec.resources.pool] == pytest.approx(MARGIN * figure.published_gib, abs=0.005)
