"""memfit's prediction for each peer's own recipe beside the peak memory the peer published for it.

Run: python bench/peer_figures.py
Each job of examples/peers/torchtune.yaml pins the peer's recipe as the peer ran it (every strategy knob, so
the planner adds nothing) and is planned on the peer's GPU (examples/peers/inventory.yaml: the card's real
memory, no headroom). Printed per job: the published peak; memfit's per-GPU total (what the GPU must hold: the
allocator's peak plus the CUDA context, NCCL's buffers and allocator fragmentation) and its predicted
torch.cuda.max_memory_allocated() (the allocator's peak, what the peers report), each with its ratio to the
figure; and the strategy planned. The figures are the peers' measurements on real GPUs; memfit's are estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from memfit.api.loading import load_documents
from memfit.api.plan import PlanResult
from memfit.api.runtime import Runtime
from memfit.planner.search import plan_job
from memfit.units import GIB

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "examples" / "peers" / "torchtune.yaml"
INVENTORY = ROOT / "examples" / "peers" / "inventory.yaml"
RUNTIME: Final = Runtime.of(["flash-attn"])
"""The peers' trainers had the kernels their recipes name: torch's flex attention, flash-attn for PEFT's."""
TORCHTUNE = "torchtune README, Memory and training speed (30b8519)"
TORCHTUNE_FLAGS = "torchtune README, Optimization flags (1814feb)"


@dataclass(frozen=True)
class PeerFigure:
    job: str
    """metadata.name in examples/peers/torchtune.yaml."""
    published_gib: float
    peer: str
    gpu: str
    gpus: int
    """GPUs the peer ran on (the plan must use as many)."""
    source: str
    accumulation: int = 1
    """The peer's gradient accumulation steps."""


FIGURES = (
    PeerFigure("llama-3.1-8b-qlora", 7.4, "torchtune", "RTX 4090", 1, TORCHTUNE),
    PeerFigure("llama-3.1-8b-lora", 16.2, "torchtune", "RTX 4090", 1, TORCHTUNE),
    PeerFigure("llama-3.1-8b-full", 18.9, "torchtune", "RTX 4090", 1, TORCHTUNE),
    PeerFigure("llama-3.1-70b-full", 13.9, "torchtune", "8x A100", 8, TORCHTUNE),
    PeerFigure("llama-3.2-3b-full", 24.9, "torchtune", "A100", 1, TORCHTUNE_FLAGS),
    PeerFigure("llama-3.2-3b-full-8bit", 17.6, "torchtune", "A100", 1, TORCHTUNE_FLAGS),
    PeerFigure("llama-2-70b-qlora", 19.6e9 / GIB, "PEFT", "2x 24 GB", 2, "PEFT docs, FSDP + QLoRA (19.6 GB)", 2),
)


def plan_figure(figure: PeerFigure) -> PlanResult:
    """memfit's plan of the peer's recipe on the peer's GPU (``chosen`` None: by memfit, it does not fit)."""
    documents = load_documents(JOBS, INVENTORY)
    job = next(job for job in documents.jobs if job.metadata.name == figure.job)
    return plan_job(job.spec, documents.pools, runtime=RUNTIME)


def main() -> None:
    print("Each peer's recipe pinned, on the peer's GPU, no headroom (runtime: torch + flash-attn). published: the")
    print("peer's allocator peak (torchtune: peak active memory; PEFT: not said). total: what memfit says the GPU")
    print("must hold (+ CUDA context, NCCL, fragmentation). alloc: memfit's predicted max_memory_allocated.")
    print(f"{'job':<22} {'peer':<9} {'GPU':<8} {'published':>9} {'total':>7} {'ratio':>5} {'alloc':>7} {'ratio':>5}"
          "  recipe as planned")  # fmt: skip
    for figure in FIGURES:
        result = plan_figure(figure)
        plan = result.chosen
        row = f"{figure.job:<22} {figure.peer:<9} {figure.gpu:<8} {figure.published_gib:>7.1f} G"
        if plan is None:
            why = result.rejected[0].reason if result.rejected else "nothing to evaluate"
            print(f"{row}  no plan for the peer's recipe: {why}")
            continue
        total, allocated = plan.memory.per_gpu.total / GIB, plan.memory.per_gpu.peak_allocated_bytes / GIB
        ratios = f"{total / figure.published_gib:>5.2f} {allocated:>5.1f} G {allocated / figure.published_gib:>5.2f}"
        print(f"{row} {total:>5.1f} G {ratios}  {plan.strategy.summary()} {plan.strategy.attention}")


if __name__ == "__main__":
    main()
