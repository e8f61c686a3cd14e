"""From what a search found to what the planner reports: the order of the plans that fit, the techniques
worth their cost, at most MAX_CANDIDATES of them with the best of every method, why the first won, and the
API records of candidates and misses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.plan import PlanCandidate, PlanThroughput, RejectedCandidate
from memfit.api.vocabulary import Method, PlannedMethod
from memfit.planned_model import PlannedModel
from memfit.planner.evaluated import Evaluated, Fit, Shortfall
from memfit.planner.throughput import estimate_throughput

MAX_CANDIDATES = 50
"""Feasible candidates reported (the best of each method always among them)."""
METHOD_PREFERENCE: tuple[PlannedMethod, ...] = (Method.FULL, Method.LORA, Method.QLORA)
"""`method: auto` takes the method that changes the model least among those that fit."""
MAX_REJECTED = 25
"""Nearest misses reported: the closest attempt of each pool x layout x method, closest first."""
MIN_TECHNIQUE_GAIN = 1.05
"""A plan whose memory-saving techniques cost speed (recomputed LM head, PCIe copies, other numerics) must be
at least this much faster than the best plan of its method without them: below it the estimated gain is
within the throughput model's own uncertainty."""


@dataclass(frozen=True, slots=True)
class Miss:
    """A reported candidate that does not fit, with what it falls short of (for the advice)."""

    candidate: RejectedCandidate
    shortfall: Shortfall


def ranked(fits: list[Fit]) -> list[Fit]:
    """The plans worth reporting, in the planner's order: the method that changes the model least, then the
    fastest, then the one with the most room."""
    return sorted(_worth_their_cost(fits), key=_preference)


def _worth_their_cost(fits: list[Fit]) -> list[Fit]:
    """Drop the plans whose techniques buy less than MIN_TECHNIQUE_GAIN over the best plan of their method
    that uses none (where there is one: a technique that makes the method fit at all is always kept)."""
    plain: dict[str, float] = {}
    for fit in fits:
        if fit.techniques is None:
            plain[fit.method] = max(plain.get(fit.method, 0.0), fit.tokens_per_second)
    return [
        fit
        for fit in fits
        if fit.techniques is None
        or fit.method not in plain
        or fit.tokens_per_second >= MIN_TECHNIQUE_GAIN * plain[fit.method]
    ]


def _preference(fit: Fit) -> tuple[int, float, float]:
    """The method first, then the speed; of equally fast plans, the one that leaves the most room."""
    return METHOD_PREFERENCE.index(fit.evaluated.template.method), -fit.tokens_per_second, fit.evaluated.miss_ratio


def reported(ranked: list[Fit]) -> list[Fit]:
    """The first MAX_CANDIDATES of ``ranked``, with the best of every method among them."""
    heads: dict[str, int] = {}
    for index, fit in enumerate(ranked):
        heads.setdefault(fit.method, index)
    rest = [index for index in range(len(ranked)) if index not in heads.values()]
    kept = sorted({*heads.values(), *rest[: max(0, MAX_CANDIDATES - len(heads))]})
    return [ranked[index] for index in kept]


def nearest_first(misses: list[Evaluated]) -> list[Evaluated]:
    return sorted(misses, key=lambda miss: miss.miss_ratio)


def speed_ratio(faster: float, slower: float) -> str:
    """``faster`` against ``slower`` in words: "35% faster", "2.1x faster", "6% slower", "as fast"."""
    ratio = faster / slower
    if ratio >= 2:
        return f"{ratio:.1f}x faster"
    if ratio >= 1.005:
        return f"{ratio - 1:.0%} faster"
    return f"{1 - ratio:.0%} slower" if ratio <= 0.995 else "as fast"


def why_chosen(spec: FineTuneJobSpec, ranked: list[Fit]) -> str:
    """One sentence: why the first of ``ranked`` won."""
    best = ranked[0]
    method = best.method
    same = [fit for fit in ranked if fit.method == method]
    if len(same) == 1:
        within = f"the only {method} plan that fits"
    else:
        ratio = speed_ratio(best.tokens_per_second, same[1].tokens_per_second)
        versus = "as fast as the next" if ratio == "as fast" else f"{ratio} than the next"
        within = f"the fastest of the {len(same)} {method} plans that fit ({versus})"
    bought = f"; it uses {best.techniques}" if best.techniques else ""
    if spec.method is not Method.AUTO:
        return f"method {method} is pinned, and this is {within}{bought}."
    higher = METHOD_PREFERENCE[: METHOD_PREFERENCE.index(method)]
    sentence = "method auto takes the method that changes the model least (full, then lora, then qlora)"
    if higher:
        sentence += f" and no {' or '.join(higher)} plan fits"
    sentence += f"; this is {within}"
    others: dict[str, Fit] = {}
    for fit in ranked:
        if fit.method != method:
            others.setdefault(fit.method, fit)
    for other, fit in others.items():
        ratio = speed_ratio(fit.tokens_per_second, best.tokens_per_second)
        sentence += f"; the best {other} plan would be {ratio} ({fit.tokens_per_second:,.0f} tokens/s est.)"
    return sentence + bought + "."


def _candidate_fields(shape: PlannedModel, evaluated: Evaluated, throughput: PlanThroughput) -> dict[str, Any]:
    return {
        "strategy": evaluated.strategy,
        "parameter_count": shape.parameter_count,
        "trainable_parameter_count": evaluated.trainable,
        "memory": evaluated.memory,
        "gpu_memory_bytes": evaluated.capacity.gpu_memory_bytes,
        "fits": evaluated.fits,
        "throughput": throughput,
    }


def to_candidate(shape: PlannedModel, fit: Fit) -> PlanCandidate:
    return PlanCandidate(**_candidate_fields(shape, fit.evaluated, fit.throughput), techniques=fit.techniques)


def to_miss(shape: PlannedModel, sequence_length: int, miss: Evaluated) -> Miss:
    shortfall = miss.shortfall
    assert shortfall is not None, "a miss falls short of something"
    throughput = estimate_throughput(shape, miss.strategy, miss.capacity, sequence_length, miss.trainable)
    candidate = RejectedCandidate(**_candidate_fields(shape, miss, throughput), reason=miss.reason)
    return Miss(candidate, shortfall)
