"""The longest ``sequenceLength`` a job fits on each pool, and the plan that reaches it.

Unsloth publishes such tables for a few GPUs, measured by hand; this computes them for the user's own
pools from the same memory model the planner uses, with everything the planner may choose for long
sequences: splitting each over several GPUs (Ulysses sequence parallelism), the tiled MLP, the chunked loss,
activation offloading. Memory grows with the sequence length under every strategy (activations are linear in
each GPU's share of it, padded to whole shares, eager attention's scores and SDPA's mask quadratic), so a
bisection finds the boundary exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memfit.api.finetunejob import MAX_SEQUENCE_LENGTH, MIN_SEQUENCE_LENGTH, FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.plan import PlanCandidate
from memfit.api.runtime import IMAGE_RUNTIME, Runtime
from memfit.planned_model import PlannedModel
from memfit.planner.search import best_plan, planned_model, selected_pools


@dataclass(frozen=True, slots=True)
class LongestSequence:
    pool: str
    sequence_length: int | None
    """The longest that fits (None: not even the shortest, MIN_SEQUENCE_LENGTH, does)."""
    plan: PlanCandidate | None
    """The plan at that length."""

    @property
    def api_maximum(self) -> bool:
        """Whether the length is the longest the API accepts (MAX_SEQUENCE_LENGTH): the job may fit longer ones."""
        return self.sequence_length == MAX_SEQUENCE_LENGTH

    @property
    def sequence_parallel(self) -> int:
        """GPUs each sequence of the plan is split over (1: none, or no plan)."""
        return self.plan.strategy.sequence_parallel if self.plan is not None else 1


def with_sequence_length(spec: FineTuneJobSpec, sequence_length: int, pool: str) -> FineTuneJobSpec:
    training = spec.training.model_copy(update={"sequence_length": sequence_length})
    resources = spec.resources.model_copy(update={"pool": pool})
    return spec.model_copy(update={"training": training, "resources": resources})


def longest_sequence(
    spec: FineTuneJobSpec,
    pools: Sequence[GPUPool],
    progress: Callable[[str], None] | None = None,
    model: PlannedModel | None = None,
    runtime: Runtime = IMAGE_RUNTIME,
) -> list[LongestSequence]:
    """Per pool (the job's own, if it names one): bisect sequenceLength between the shortest and the
    longest the API accepts, planning at each step (``model`` and ``runtime``: as for ``plan_job``)."""
    model = planned_model(spec, model, runtime)
    results = []
    for capacity in selected_pools(spec, pools, runtime):  # raises PlanningError as planning does
        name = capacity.name
        if progress is not None:
            progress(name)

        def plan_at(length: int, name: str = name) -> PlanCandidate | None:
            return best_plan(with_sequence_length(spec, length, name), pools, model, runtime)

        best = plan_at(MIN_SEQUENCE_LENGTH)
        if best is None:
            results.append(LongestSequence(name, None, None))
            continue
        low, high = MIN_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH  # low fits; find the largest that does
        top = plan_at(high)
        if top is not None:
            results.append(LongestSequence(name, high, top))
            continue
        while high - low > 1:
            middle = (low + high) // 2
            plan = plan_at(middle)
            if plan is not None:
                low, best = middle, plan
            else:
                high = middle
        results.append(LongestSequence(name, low, best))
    return results
