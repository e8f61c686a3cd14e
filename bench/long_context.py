"""The longest sequence memfit plans for long-context peers' own recipes, beside the longest the peers published.

Run: python bench/long_context.py
Each job of examples/peers/long-context.yaml (which also holds its pools) pins its peer's recipe: ALST's
(DeepSpeed ZeRO-3, the optimizer on the host and on one GPU the parameters too, checkpoints offloaded to the
host but at 70B, tiled MLP, fused logits and loss, flash attention, Ulysses over every GPU) or Unsloth's
(QLoRA on one GPU, checkpoints on the host, chunked loss, flash attention). Two columns, each bisected by
``memfit plan --max-sequence-length``'s search in this one run, for a trainer with flash-attn (the recipes'
kernel; memfit's trainer image has none, ``Runtime.of(["flash-attn"])`` says it has):

- recipe: the longest sequence memfit plans for the peer's recipe as pinned, on the whole card (no headroom:
  the figures are the longest the peers ran);
- best: the longest of memfit's own plan of the same job, its strategy unpinned, at the default headroom.

Each with its ratio to the published figure. The figures are the peers' measurements on real GPUs; memfit's
are estimates of its memory model, never run at those lengths here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from memfit.api.finetunejob import FineTuneJobSpec, ResourcesSpec, StrategySpec
from memfit.api.gpupool import GPUPool
from memfit.api.loading import load_documents
from memfit.api.runtime import Runtime
from memfit.planner.longest import LongestSequence, longest_sequence

JOBS = Path(__file__).resolve().parent.parent / "examples" / "peers" / "long-context.yaml"
RUNTIME: Final = Runtime.of(["flash-attn"])
ALST = "ALST paper (arXiv 2506.13996), abstract"
RECIPES = "ArcticTraining projects/sequence-parallelism"


@dataclass(frozen=True)
class PublishedLength:
    job: str
    """metadata.name in examples/peers/long-context.yaml."""
    tokens: int
    peer: str
    gpus: str
    source: str


FIGURES = (
    PublishedLength("llama-3.1-8b-full-1gpu", 500_000, "ALST", "1x H100", ALST),
    PublishedLength("llama-3.1-8b-full-8gpu", 3_700_000, "ALST", "8x H100", ALST),
    PublishedLength("qwen3-32b-full-1gpu", 230_000, "ALST", "1x H100", f"{RECIPES}/run-h100-sp1-qwen3-32b.yml"),
    PublishedLength("qwen3-32b-full-8gpu", 1_550_000, "ALST", "8x H100", f"{RECIPES}/run-h100-sp8-qwen3-32b.yml"),
    PublishedLength("llama-3.1-70b-full-8gpu", 200_000, "ALST", "8x H100", f"{RECIPES}/run-h100-sp8-llama-70b.yml"),
    PublishedLength("llama-3.1-8b-qlora-1gpu", 342_733, "Unsloth", "1x 80 GB", "Unsloth docs, Unsloth Benchmarks"),
)


def unpinned(spec: FineTuneJobSpec) -> FineTuneJobSpec:
    """The job as memfit would plan it by itself: no strategy knob pinned, the default headroom."""
    resources = ResourcesSpec(pool=spec.resources.pool, max_gpus=spec.resources.max_gpus)
    return spec.model_copy(update={"strategy": StrategySpec(), "resources": resources})


def longest(spec: FineTuneJobSpec, pools: list[GPUPool]) -> LongestSequence:
    (row,) = longest_sequence(spec, pools, runtime=RUNTIME)  # each job names its pool
    return row


def column(row: LongestSequence, published: int) -> str:
    """The length and its ratio to the published one (``no plan`` where not even the shortest fits)."""
    if row.sequence_length is None:
        return f"{'no plan':>10} {'':>5}"
    return f"{row.sequence_length:>10,} {row.sequence_length / published:>5.2f}"


def main() -> None:
    documents = load_documents(JOBS)
    jobs = {job.metadata.name: job.spec for job in documents.jobs}
    headroom = ResourcesSpec().memory_headroom_percent
    print("Longest sequence (tokens), planned for a trainer with flash-attn (runtime: torch + flash-attn).")
    print("recipe: the peer's own recipe pinned (ALST's or Unsloth's), no headroom, as the peer ran it.")
    print(f"best: memfit's own plan of the job, strategy unpinned, {headroom:g}% headroom (the default).")
    print(f"{'job':<24} {'peer':<8} {'GPUs':<8} {'published':>10} {'recipe':>10} {'ratio':>5} {'best':>10} "
          f"{'ratio':>5}  memfit's best plan")  # fmt: skip
    for figure in FIGURES:
        recipe, best = longest(jobs[figure.job], documents.pools), longest(unpinned(jobs[figure.job]), documents.pools)
        plan = "" if best.plan is None else f"{best.plan.strategy.summary()} {best.plan.strategy.attention}"
        print(f"{figure.job:<24} {figure.peer:<8} {figure.gpus:<8} {figure.tokens:>10,} "
              f"{column(recipe, figure.tokens)} {column(best, figure.tokens)}  {plan}")  # fmt: skip


if __name__ == "__main__":
    main()
