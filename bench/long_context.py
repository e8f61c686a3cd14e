"""The longest sequence memfit plans beside the longest that long-context peers published on the same jobs.

Run: python bench/long_context.py
Each job of examples/peers/long-context.yaml (which also holds its pools) is bisected by
``memfit plan --max-sequence-length``'s search. Printed per job: the peer's published longest sequence, memfit's
longest planned one, their ratio, and the plan that reaches it. The published figures are the peers'
measurements on real GPUs; memfit's are estimates of its memory model, never run at that length here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memfit.api.loading import load_documents
from memfit.planner.longest import longest_sequence

JOBS = Path(__file__).resolve().parent.parent / "examples" / "peers" / "long-context.yaml"
ALST = "ALST paper (arXiv 2506.13996), abstract"
ALST_README = "ArcticTraining sequence-parallelism README, as quoted in memfit issue 23"


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
    PublishedLength("qwen3-32b-full-1gpu", 230_000, "ALST", "1x H100", ALST_README),
    PublishedLength("qwen3-32b-full-8gpu", 1_550_000, "ALST", "8x H100", ALST_README),
    PublishedLength("llama-3.1-70b-full-8gpu", 200_000, "ALST", "8x H100", ALST_README),
    PublishedLength("llama-3.1-8b-qlora-1gpu", 342_000, "Unsloth", "1x 80 GB", "Unsloth docs, as quoted in issue 23"),
)


def main() -> None:
    documents = load_documents(JOBS)
    jobs = {job.metadata.name: job for job in documents.jobs}
    header = f"{'job':<24} {'peer':<8} {'GPUs':<8} {'published':>10} {'memfit':>10} {'ratio':>6}"
    print(f"{header}  plan (memfit's estimate)")
    for figure in FIGURES:
        (row,) = longest_sequence(jobs[figure.job].spec, documents.pools)
        if row.plan is None or row.sequence_length is None:
            print(f"{figure.job:<24} {figure.peer:<8} {figure.gpus:<8} {figure.tokens:>10,} {'no plan':>10}")
            continue
        ratio = row.sequence_length / figure.tokens
        print(f"{figure.job:<24} {figure.peer:<8} {figure.gpus:<8} {figure.tokens:>10,} {row.sequence_length:>10,} "
              f"{ratio:>6.2f}  {row.plan.strategy.summary()}")  # fmt: skip


if __name__ == "__main__":
    main()
