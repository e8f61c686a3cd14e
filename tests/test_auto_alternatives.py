"""`method: auto` shows its alternatives: the best candidate of every method the spec allows is among the
candidates and the runner-ups, and the chosen plan says why it won. Auto's choice itself keeps its
documented preference: the method that changes the model least among those that fit."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from memfit.api.finetunejob import FineTuneJob, FineTuneJobSpec
from memfit.api.gpupool import GPUPool
from memfit.api.loading import load_documents
from memfit.api.plan import PlanResult
from memfit.api.vocabulary import Method
from memfit.cli.plan_table import print_plan_table, runners_up
from memfit.planner.report import MAX_CANDIDATES
from memfit.planner.search import plan_job
from tests.planning_fixtures import A100_NODE, job, pool

ROOT = Path(__file__).parent.parent
METHODS = ("full", "lora", "qlora")
# The case: Llama-2-70B on one A100-80GB with a host large enough to stream the frozen base.
ONE_A100_BIG_HOST = pool("a100", "NVIDIA-A100-SXM4-80GB", 1, 1, 256)


def best_of(spec: FineTuneJobSpec, pools: list[GPUPool], method: str) -> str | None:
    """The plan the planner picks when ``method`` is pinned: the best of that method."""
    chosen = plan_job(spec.model_copy(update={"method": Method(method)}), pools).chosen
    return chosen.strategy.summary() if chosen else None


def first_of_each_method(result: PlanResult) -> dict[str, str]:
    firsts: dict[str, str] = {}
    for candidate in result.candidates:
        firsts.setdefault(candidate.strategy.method, candidate.strategy.summary())
    return firsts


def test_70b_on_one_a100_shows_qlora_next_to_the_lora_it_prefers() -> None:
    spec, pools = job("llama-2-70b"), [ONE_A100_BIG_HOST]
    result = plan_job(spec, pools)
    assert result.chosen is not None
    # Activation offloading buys micro-batch 32 in one pass (16 x 2 without): the CPU-held weights travel once.
    chosen = "lora fsdp2-zero3 opt->cpu params->cpu ckpt act->cpu mb32x1 bf16 adamw on 1x1 a100"
    assert result.chosen.strategy.summary() == chosen
    assert result.chosen.techniques == "activation offloading: micro-batch 32 (16 without)"
    assert first_of_each_method(result) == {
        "lora": best_of(spec, pools, "lora"),
        "qlora": best_of(spec, pools, "qlora"),
    }
    assert best_of(spec, pools, "full") is None
    why = result.why_chosen
    assert why is not None and why.endswith(".") and not re.search(r"\.\s+[A-Z]", why)  # one sentence
    assert "no full plan fits" in why and "the best qlora plan would be" in why
    qlora = next(c for c in result.candidates if c.strategy.method == "qlora")
    assert f"{qlora.throughput.tokens_per_second:,.0f} tokens/s" in why


def test_the_best_of_every_allowed_method_is_a_candidate_even_past_the_cap() -> None:
    jobs = load_documents(ROOT / "examples" / "llama-3.1-8b-lora.yaml").jobs
    h100_node = pool("h100", "NVIDIA-H100-80GB-HBM3", 8, 1, 2000)  # full plans enough to fill the list
    pools = [*load_documents(ROOT / "examples" / "inventory.yaml").pools, h100_node]
    training = jobs[0].spec.training.model_copy(update={"global_batch_size": 256})  # layouts enough to fill it
    spec = jobs[0].spec.model_copy(update={"training": training})
    result = plan_job(spec, pools)
    assert result.feasible_count > MAX_CANDIDATES >= len(result.candidates)
    full = [c for c in result.candidates if c.strategy.method == "full"]
    assert len(full) > MAX_CANDIDATES - 3  # the full candidates alone would fill the list
    assert first_of_each_method(result) == {m: best_of(spec, pools, m) for m in METHODS}
    assert result.candidates[0] == result.chosen and result.chosen.strategy.method == "full"


def test_candidates_come_in_the_planners_order() -> None:
    result = plan_job(job("llama-3.1-8b", batch=16), [A100_NODE, pool("l4", "NVIDIA-L4", 1, 4, 200)])
    order = [(METHODS.index(c.strategy.method), -c.throughput.tokens_per_second) for c in result.candidates]
    assert order == sorted(order)
    assert {c.strategy.method for c in result.candidates} == set(METHODS)


def test_a_pinned_method_plans_only_that_method_and_says_so() -> None:
    result = plan_job(job("llama-2-7b", "lora", batch=16), [A100_NODE])
    assert {c.strategy.method for c in result.candidates} == {"lora"}
    assert result.why_chosen is not None and result.why_chosen.startswith("method lora is pinned, and this is the ")


def test_the_runner_ups_show_the_best_of_each_other_method() -> None:
    document = {"metadata": {"name": "big"}, "spec": job("llama-2-70b").model_dump(by_alias=True, mode="json")}
    plan_of = FineTuneJob.model_validate(document)
    result = plan_job(plan_of.spec, [ONE_A100_BIG_HOST])
    shown = runners_up(result)
    # lora without activation offloading next (fsdp2, then DeepSpeed), then the best qlora (DeepSpeed), then qlora
    # on fsdp2 (and with its CPU offload, a larger micro-batch)
    assert [c.strategy.summary() for c in shown] == [
        "lora fsdp2-zero3 opt->cpu params->cpu ckpt mb16x2 bf16 adamw on 1x1 a100",
        "lora zero3 params->cpu ckpt mb16x2 bf16 adamw on 1x1 a100",
        "qlora zero0 ckpt mb8x4 bf16 adamw on 1x1 a100",
        "qlora fsdp2-zero3 ckpt mb8x4 bf16 adamw on 1x1 a100",
        "qlora fsdp2-zero3 opt->cpu params->cpu ckpt mb16x2 bf16 adamw on 1x1 a100",
    ]
    out = io.StringIO()
    print_plan_table(plan_of, result, Console(file=out, width=200))
    text = out.getvalue()
    assert "qlora zero0 ckpt mb8x4 bf16 adamw on 1x1 a100" in text
    assert "qlora changes the model more than lora, which auto prefers" in text
    assert "Why: method auto takes the method that changes the model least" in text


def test_runner_ups_keep_other_methods_when_the_chosen_method_has_many() -> None:
    jobs = load_documents(ROOT / "examples" / "llama-3.1-8b-lora.yaml").jobs
    pools = load_documents(ROOT / "examples" / "inventory.yaml").pools
    result = plan_job(jobs[0].spec, pools)
    shown = runners_up(result)
    assert len(shown) == 5
    assert [c.strategy.method for c in shown].count("full") == 3
    assert {c.strategy.method for c in shown} == set(METHODS)
