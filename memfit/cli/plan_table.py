"""The human view of a plan: the chosen strategy, its memory against the GPU, and who came next.

Text from the user (job, model and pool names, and the reasons and advice that quote them) is printed
literally: never read as rich markup or emoji codes, and with control characters shown as escapes
instead of reaching the terminal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from memfit.api.finetunejob import MIN_SEQUENCE_LENGTH, FineTuneJob
from memfit.api.plan import PerGPUMemory, PhaseMemory, PlanCandidate, PlanResult
from memfit.api.runtime import package_needed
from memfit.api.techniques import TECHNIQUES
from memfit.api.vocabulary import Offload, StepPhase
from memfit.planner.longest import LongestSequence
from memfit.planner.report import speed_ratio
from memfit.units import GIB

RUNNERS_UP = 5
BAR_WIDTH = 30
MOMENTS = {StepPhase.FORWARD_BACKWARD: "forward/backward pass", StepPhase.OPTIMIZER_STEP: "optimizer step"}

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
"""C0 and C1 controls (ESC, CSI, BEL, newlines...) and the invisible format characters that reorder or
hide text (bidirectional overrides, zero-width characters)."""


def literal(text: str, style: str = "") -> Text:
    """``text`` exactly as given, each control character replaced by its escape (``\\x1b``)."""
    return Text(_CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text), style=style)


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f}"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def why_lost(candidate: PlanCandidate, chosen: PlanCandidate) -> str:
    """One phrase: what makes ``candidate`` worse than ``chosen``."""
    speed = speed_ratio(candidate.throughput.tokens_per_second, chosen.throughput.tokens_per_second)
    if candidate.strategy.method != chosen.strategy.method:
        return (f"{candidate.strategy.method} changes the model more than {chosen.strategy.method}, "
                f"which auto prefers ({speed})")  # fmt: skip
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
    if a.sequence_parallel > b.sequence_parallel:
        differences.append(f"each sequence split over {a.sequence_parallel} GPUs (all-to-alls)")
    if a.micro_batch_size * b.sequence_parallel < b.micro_batch_size * a.sequence_parallel:  # per GPU
        differences.append(f"micro-batch {a.micro_batch_size}")
    detail = ", ".join(differences) or "more communication"
    bought = f"; {candidate.techniques}" if candidate.techniques else ""
    return f"{speed} ({detail}){bought}"


def runners_up(result: PlanResult, limit: int = RUNNERS_UP) -> list[PlanCandidate]:
    """The candidates after the chosen one, the best of every other method among them."""
    others = result.candidates[1:]
    methods = {result.candidates[0].strategy.method} if result.candidates else set()
    picked: list[int] = []
    for index, candidate in enumerate(others):
        if candidate.strategy.method not in methods:
            methods.add(candidate.strategy.method)
            picked.append(index)
    rest = [index for index in range(len(others)) if index not in picked]
    return [others[index] for index in sorted(picked + rest[: max(0, limit - len(picked))])]


def _new_console() -> Console:
    return Console(highlight=False, width=max(120, Console().width))


def _print_heading(console: Console, job: FineTuneJob, about: str) -> None:
    """``name: model<about>``, the user's names printed literally."""
    console.print(Text.assemble(literal(job.metadata.name, "bold"), ": ", literal(job.spec.model.name), about))


def print_plan_table(
    job: FineTuneJob, result: PlanResult, console: Console | None = None, gpus_read_as: Sequence[str] = ()
) -> None:
    """The plan as tables; ``gpus_read_as``: which card each pool that names its GPUs by an alias was planned
    for (``product_read_as``)."""
    console = console or _new_console()
    spec = job.spec
    training = spec.training
    about = (f" ({_params(result.model_parameters)} parameters), method {spec.method.value}, "
             f"{training.global_batch_size} x {training.sequence_length} tokens per step")  # fmt: skip
    _print_heading(console, job, about)
    console.print(Text.assemble(("Model", "bold"), ": ", literal(result.model_basis)))
    for reading in gpus_read_as:
        console.print(Text.assemble(("GPUs", "bold"), ": ", literal(reading)))
    chosen = result.chosen
    if chosen is None:
        _print_no_fit(result, console)
        return
    s = chosen.strategy
    console.print(
        Text.assemble(
            ("Fits", "bold green"),
            ": ",
            literal(s.summary()),
            f"  ({s.gpus} GPU{'s' if s.gpus > 1 else ''}, {_params(chosen.trainable_parameter_count)} trainable)",
        )  # fmt: skip
    )
    if result.why_chosen:
        console.print(Text.assemble("Why: ", literal(result.why_chosen)))
    console.print(
        f"Throughput (estimate): {chosen.throughput.tokens_per_second:,.0f} tokens/s, "
        f"{chosen.throughput.step_seconds:.2f} s per step"
    )
    console.print(f"Attention: {s.attention}, from {package_needed(s.attention)}")
    if not s.packing and spec.dataset.packing is None:
        console.print("Packing: off (this model's linear-attention layers would carry their state across packed "
                      "documents without flash-linear-attention)")  # fmt: skip
    console.print(_memory_table(chosen, spec.resources.memory_headroom_percent))
    memory = chosen.memory
    console.print(f"Per node: CPU {_gib(memory.per_node.cpu)} GiB, NVMe {_gib(memory.per_node.nvme)} GiB")

    others = runners_up(result)
    if others:
        table = Table(title="Runner-up candidates", title_justify="left")
        for column in ("strategy", "GiB/GPU", "tokens/s (est.)", "why it lost"):
            table.add_column(column, justify="right" if "/" in column else "left")
        for candidate in others:
            speed = f"{candidate.throughput.tokens_per_second:,.0f}"
            table.add_row(literal(candidate.strategy.summary()), _gib(candidate.memory.per_gpu.total), speed,
                          literal(why_lost(candidate, chosen)))  # fmt: skip
        console.print(table)
    _print_rejected(result, console)
    console.print(
        f"{result.feasible_count} candidates fit, {len(result.rejected)} nearest misses; "
        f"planned in {result.planning_seconds * 1000:.1f} ms"
    )


def _memory_table(chosen: PlanCandidate, headroom_percent: float) -> Table:
    """The binding moment of the step part by part, then the other moment's total."""
    capacity, memory = chosen.gpu_memory_bytes, chosen.memory
    per_gpu, phases, binding = memory.per_gpu, memory.phases, memory.binding
    title = f"Memory per GPU (estimate) against {_gib(capacity)} GiB"
    if phases is not None and binding is not None:
        title += f" at its peak, the {MOMENTS[binding]}"
    table = Table(title=title, title_justify="left")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    bound: PhaseMemory | PerGPUMemory = per_gpu  # plans recorded before the phases were: the per-GPU summary
    if phases is not None and binding is not None:
        bound = phases.at(binding)
    parts = [
        ("parameters", bound.parameters),
        ("gradients", bound.gradients),
        ("optimizer states", bound.optimizer_states),
        ("activations", bound.activations),
        ("overhead", bound.overhead),
    ]
    for name, value in parts:
        bar = "#" * round(BAR_WIDTH * value / capacity)
        table.add_row(name, _gib(value), f"{value / capacity:.0%}", bar)
    table.add_section()
    usable = capacity * (1 - headroom_percent / 100)
    limit = f"limit {_gib(usable)} GiB ({headroom_percent:g}% headroom)"
    table.add_row(Text("total", style="bold"), Text(_gib(per_gpu.total), style="bold"),
                  f"{per_gpu.total / capacity:.0%}", limit)  # fmt: skip
    if phases is not None and binding is not None:
        other = next(phase for phase in MOMENTS if phase != binding)
        other_total = phases.at(other).total
        note = "does not bind"
        if other == StepPhase.FORWARD_BACKWARD:
            note += f" (activations {_gib(phases.forward_backward.activations)} GiB)"
        table.add_row(f"{MOMENTS[other]} total", _gib(other_total), f"{other_total / capacity:.0%}", note)
    table.add_row("peak allocated", _gib(per_gpu.peak_allocated_bytes), "", "torch.cuda.max_memory_allocated()")
    peak = per_gpu.activation_peak
    if peak is not None and peak != bound.activations:
        table.add_row("activation peak", _gib(peak), "", "activations' own peak, at a moment that binds less")
    return table


def print_longest_table(job: FineTuneJob, rows: list[LongestSequence], console: Console | None = None) -> None:
    """``memfit plan --max-sequence-length``: per pool, the longest sequenceLength and how it runs."""
    console = console or _new_console()
    spec = job.spec
    _print_heading(console, job, f", method {spec.method.value}, {spec.training.global_batch_size} sequences per "
                                 "step: the longest sequenceLength that fits each pool (estimates)")  # fmt: skip
    table = Table(title_justify="left")
    columns = ("pool", "longest sequenceLength", "GiB/GPU", "tokens/s (est.)", "sequence split over", "strategy",
               "techniques")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right" if column in ("longest sequenceLength", "GiB/GPU") else "left")
    for row in rows:
        if row.plan is None or row.sequence_length is None:
            table.add_row(literal(row.pool), "none", "", "", "", literal(f"nothing fits even at {MIN_SEQUENCE_LENGTH}"),
                          "")  # fmt: skip
            continue
        plan = row.plan
        length = f"{row.sequence_length:,}" + (" (the API maximum)" if row.api_maximum else "")
        split = f"{row.sequence_parallel} GPUs" if row.sequence_parallel > 1 else "1 GPU (not split)"
        table.add_row(literal(row.pool), length, _gib(plan.memory.per_gpu.total),
                      f"{plan.throughput.tokens_per_second:,.0f}", split, literal(plan.strategy.summary()),
                      literal(_techniques_used(plan)))  # fmt: skip
    console.print(table)


def _techniques_used(plan: PlanCandidate) -> str:
    """The memory-saving techniques the plan runs, with what they bought where the planner says so."""
    strategy = plan.strategy
    used = ", ".join(technique.name for technique in TECHNIQUES if getattr(strategy, technique.knob))
    return plan.techniques or used


def _print_rejected(result: PlanResult, console: Console, limit: int = 3) -> None:
    if not result.rejected:
        return
    table = Table(title="Nearest misses", title_justify="left")
    table.add_column("strategy")
    table.add_column("why it does not fit")
    for rejected in result.rejected[:limit]:
        table.add_row(literal(rejected.strategy.summary()), literal(rejected.reason))
    console.print(table)


def _print_no_fit(result: PlanResult, console: Console) -> None:
    console.print(Text("Nothing fits.", style="bold red"))
    for line in result.advice:
        console.print(Text.assemble("  - ", literal(line)))
    _print_rejected(result, console, limit=5)
