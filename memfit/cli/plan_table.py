"""The human view of a plan: the chosen strategy, its memory against the GPU, and who came next."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memfit.api.finetunejob import FineTuneJob
from memfit.api.plan import PlanCandidate, PlanResult
from memfit.api.vocabulary import Offload

GIB = 1024**3
RUNNERS_UP = 5
BAR_WIDTH = 30


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f}"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def why_lost(candidate: PlanCandidate, chosen: PlanCandidate) -> str:
    """One phrase: what makes ``candidate`` worse than ``chosen``."""
    if candidate.strategy.method != chosen.strategy.method:
        return f"{candidate.strategy.method} changes the model more than {chosen.strategy.method}"
    slower = 1 - candidate.throughput.tokens_per_second / chosen.throughput.tokens_per_second
    differences = []
    a, b = candidate.strategy, chosen.strategy
    if a.gpus < b.gpus:
        differences.append(f"{a.gpus} GPUs instead of {b.gpus}")
    if a.zero_stage == 3 and b.zero_stage != 3:
        differences.append("ZeRO-3 gathers weights every pass")
    if a.offload_optimizer != Offload.NONE and b.offload_optimizer == Offload.NONE:
        differences.append(f"optimizer on {a.offload_optimizer}")
    if a.offload_parameters != Offload.NONE and b.offload_parameters == Offload.NONE:
        differences.append(f"weights on {a.offload_parameters}")
    if a.gradient_checkpointing and not b.gradient_checkpointing:
        differences.append("recomputes activations")
    if a.micro_batch_size < b.micro_batch_size:
        differences.append(f"micro-batch {a.micro_batch_size}")
    detail = ", ".join(differences) or "more communication"
    return f"{slower:.0%} slower ({detail})" if slower > 0.005 else f"as fast ({detail})"


def print_plan_table(job: FineTuneJob, result: PlanResult, console: Console | None = None) -> None:
    console = console or Console(highlight=False, width=max(120, Console().width))
    spec = job.spec
    shape, training = spec.model.architecture.shape(), spec.training
    console.print(
        f"[bold]{job.metadata.name}[/]: {spec.model.name} ({_params(shape.parameter_count)} parameters), "
        f"method {spec.method.value}, {training.global_batch_size} x {training.sequence_length} tokens per step"
    )
    chosen = result.chosen
    if chosen is None:
        _print_no_fit(result, console)
        return
    s, memory = chosen.strategy, chosen.memory
    console.print(
        f"[bold green]Fits[/]: {s.summary()}  ({s.gpus} GPU{'s' if s.gpus > 1 else ''}, "
        f"{_params(chosen.trainable_parameter_count)} trainable)"
    )
    console.print(
        f"Throughput (estimate): {chosen.throughput.tokens_per_second:,.0f} tokens/s, "
        f"{chosen.throughput.step_seconds:.2f} s per step"
    )
    capacity = chosen.gpu_memory_bytes
    usable = capacity * (1 - spec.resources.memory_headroom_percent / 100)
    table = Table(title=f"Memory per GPU (estimate) against {_gib(capacity)} GiB", title_justify="left")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    per_gpu = memory.per_gpu
    parts = [
        ("parameters", per_gpu.parameters),
        ("gradients", per_gpu.gradients),
        ("optimizer states", per_gpu.optimizer_states),
        ("activations", per_gpu.activations),
        ("overhead", per_gpu.overhead),
    ]
    for name, value in parts:
        bar = "#" * round(BAR_WIDTH * value / capacity)
        table.add_row(name, _gib(value), f"{value / capacity:.0%}", bar)
    table.add_section()
    table.add_row("[bold]total[/]", f"[bold]{_gib(per_gpu.total)}[/]", f"{per_gpu.total / capacity:.0%}",
                  f"limit {_gib(usable)} GiB ({spec.resources.memory_headroom_percent:g}% headroom)")  # fmt: skip
    table.add_row("peak allocated", _gib(per_gpu.peak_allocated_bytes), "", "torch.cuda.max_memory_allocated()")
    console.print(table)
    console.print(f"Per node: CPU {_gib(memory.per_node.cpu)} GiB, NVMe {_gib(memory.per_node.nvme)} GiB")

    runners_up = [c for c in result.candidates if c is not chosen][:RUNNERS_UP]
    if runners_up:
        others = Table(title="Runner-up candidates", title_justify="left")
        for column in ("strategy", "GiB/GPU", "tokens/s (est.)", "why it lost"):
            others.add_column(column, justify="right" if "/" in column else "left")
        for candidate in runners_up:
            others.add_row(candidate.strategy.summary(), _gib(candidate.memory.per_gpu.total),
                           f"{candidate.throughput.tokens_per_second:,.0f}", why_lost(candidate, chosen))  # fmt: skip
        console.print(others)
    _print_rejected(result, console)
    console.print(
        f"{result.feasible_count} candidates fit, {len(result.rejected)} nearest misses; "
        f"planned in {result.planning_seconds * 1000:.1f} ms"
    )


def _print_rejected(result: PlanResult, console: Console, limit: int = 3) -> None:
    if not result.rejected:
        return
    table = Table(title="Nearest misses", title_justify="left")
    table.add_column("strategy")
    table.add_column("why it does not fit")
    for rejected in result.rejected[:limit]:
        table.add_row(rejected.strategy.summary(), rejected.reason)
    console.print(table)


def _print_no_fit(result: PlanResult, console: Console) -> None:
    console.print("[bold red]Nothing fits.[/]")
    for line in result.advice:
        console.print(f"  - {line}")
    _print_rejected(result, console, limit=5)
