"""The training loop: resume, step, checkpoint, export.

One optimizer step is ``gradient_accumulation_steps`` micro-batches through the engine's ``backward`` and
``step`` (the engine applies the update, the clipping and the LR schedule at the boundary). The engine is the
config's (:data:`memfit_trainer.engine.ENGINES`), spoken to through
:class:`~memfit_trainer.training_engine.TrainingEngine` only; where the run starts and how its state is saved
and loaded every ``checkpointEverySteps`` steps is :mod:`memfit_trainer.resume`; the techniques of
:data:`TECHNIQUES` install themselves on the run before the first step (:mod:`memfit_trainer.technique`).

Test hooks:

* ``MEMFIT_TEST_INJECT_OOM_AT_STEP=N`` raises ``torch.OutOfMemoryError`` inside optimizer step N on every
  rank, to exercise the out-of-memory path without a GPU;
* ``MEMFIT_TEST_HOLD_AFTER_STEP=N:PATH`` makes every rank wait after optimizer step N (its metrics, progress
  and checkpoint written) until PATH exists or the rank is asked to stop (:mod:`memfit_trainer.stop`), so that
  a test can scrape, inspect, stop or kill a run that is certainly still going, however fast the machine
  trains.

Before each optimizer step the ranks agree whether any of them received SIGTERM or SIGINT; if one did, the
step reached is checkpointed (unless it just was) and :func:`train` returns it without exporting.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist

from memfit.api.vocabulary import Attention
from memfit.contract.sections import TrainingConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer import activation_offload, chunked_loss, sequence_parallel, tiled_mlp
from memfit_trainer.checkpoint import CheckpointManager
from memfit_trainer.console import ConsoleProgress
from memfit_trainer.data import DataPosition, flash_varlen_kwargs
from memfit_trainer.disk_space import said_when_full
from memfit_trainer.engine import build_engine
from memfit_trainer.export import save_final
from memfit_trainer.metrics import TrainerMetrics
from memfit_trainer.model import build_model
from memfit_trainer.oom import OomGuard
from memfit_trainer.optimization import total_optimizer_steps
from memfit_trainer.protocol_hold import wait_for
from memfit_trainer.resume import check_layout, final_marker, find_start, resume, save_checkpoint
from memfit_trainer.run import Ranks, Run
from memfit_trainer.stop import StopRequest
from memfit_trainer.technique import BatchLoss, Technique
from memfit_trainer.training_engine import TrainingEngine
from memfit_trainer.validation import Validation, config_data, report_validation

TECHNIQUES: tuple[Technique, ...] = (
    sequence_parallel.install,
    chunked_loss.install,
    activation_offload.install,
    tiled_mlp.install,
)
"""Installed in this order (the order their lines appear in the log); their ``around`` wrappers wrap the loss in
this order too (the first innermost)."""
INJECT_OOM_ENV = "MEMFIT_TEST_INJECT_OOM_AT_STEP"
HOLD_ENV = "MEMFIT_TEST_HOLD_AFTER_STEP"


def _inject_oom(step: int) -> None:
    if os.environ.get(INJECT_OOM_ENV) == str(step):
        raise torch.OutOfMemoryError(f"injected by {INJECT_OOM_ENV}={step} (test hook)")


def _hold(step: int, stop: StopRequest) -> None:
    """The ``MEMFIT_TEST_HOLD_AFTER_STEP`` test hook (see the module docstring)."""
    at, _, release = os.environ.get(HOLD_ENV, "").partition(":")
    if at != str(step) or not release:
        return
    wait_for(release, given_up=lambda: stop.requested)


def _checkpoint(run: Run, step: int, position: DataPosition, metrics: TrainerMetrics) -> None:
    started = time.monotonic()
    with said_when_full(run.manager.root, f"the checkpoint of step {step}"):
        save_checkpoint(run, step, position)
    metrics.checkpoint(step=step, seconds=time.monotonic() - started)


def _mean_across_ranks(value: torch.Tensor) -> float:
    """Reduced where the loss is: NCCL reduces only device tensors (gloo reduces host and device ones)."""
    value = value.detach().float()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


class NonFiniteStep(Exception):
    """A step's loss or gradient norm was NaN or infinite (its update is in memory only: nothing was written)."""


def _check_finite(step: int, loss: float, grad_norm: float | None, started_from: int | None) -> None:
    """Training on garbage stops here, before the step's metrics, checkpoint or export: every rank holds the
    same reduced loss (and norm), so all of them stop together."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if value is not None and not math.isfinite(value)]  # fmt: skip
    if bad:
        origin = f"checkpoint step {started_from}" if started_from is not None else "the initial weights"
        raise NonFiniteStep(
            f"step {step}: {' and '.join(bad)}: stopped before writing anything of it (the run started from "
            f"{origin}); lower training.learningRate or check the data"
        )


def rank_share(training: TrainingConfig) -> tuple[float, int]:
    """The samples and tokens one rank trains on per optimizer step: its chunk of each sequence, so that the
    metrics summed over ranks count each sequence once also when it is split over sequence-parallel ranks."""
    sequences = training.micro_batch_size * training.gradient_accumulation_steps
    return sequences / training.sequence_parallel, sequences * training.sequence_length // training.sequence_parallel


def _model_loss(engine: TrainingEngine) -> BatchLoss:
    return lambda batch: cast(torch.Tensor, engine(**batch).loss)


def _with_document_boundaries(config: TrainerConfig, loss_of: BatchLoss) -> BatchLoss:
    """With flash attention a packed batch also carries its documents' boundaries
    (:func:`~memfit_trainer.data.flash_varlen_kwargs`)."""
    if config.training.attention != Attention.FLASH:
        return loss_of
    return lambda batch: loss_of(
        {**batch, **flash_varlen_kwargs(batch["position_ids"])} if "position_ids" in batch else batch
    )


def _install_techniques(run: Run, progress: ConsoleProgress) -> tuple[BatchLoss, list[Callable[[], str]]]:
    """Every technique of :data:`TECHNIQUES` installed on ``run``: the micro-batch's loss, and the lines to say
    at the end of the run. The flash document boundaries are of the whole batch, before any technique's
    ``around`` (sequence parallelism) shards it."""
    loss_of, summaries = _model_loss(run.engine), []
    arounds: list[Callable[[BatchLoss], BatchLoss]] = []
    for install in TECHNIQUES:
        installed = install(run)
        if installed is None:
            continue
        progress.message(installed.said)
        loss_of = installed.loss or loss_of
        if installed.around is not None:
            arounds.append(installed.around)
        if installed.summary is not None:
            summaries.append(installed.summary)
    for around in arounds:
        loss_of = around(loss_of)
    return _with_document_boundaries(run.config, loss_of), summaries


def train(
    config: TrainerConfig, ranks: Ranks, metrics: TrainerMetrics, guard: OomGuard, stop: StopRequest
) -> int | None:
    """Run (or finish) the training the config describes; collective over all ranks. The step it stopped at,
    checkpointed, when ``stop`` was requested before the end; None when the training is done and exported.

    The caller runs this inside ``with guard:`` (one guard for the whole run: nesting guards would report
    the inner guard's exit as a second OOM); the loop keeps ``guard.step`` at the step in progress.
    """
    training = config.training
    manager = CheckpointManager(config.checkpoint_dir)
    if ranks.rank == 0:
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    start = find_start(manager, config, ranks)
    if start.step is not None:
        check_layout(manager, start.step, config.layout.to_dict())

    built = build_model(config, ranks.local_rank)
    batches, held_out = config_data(config, built.tokenizer, ranks.rank, ranks.world_size)
    total = total_optimizer_steps(training, batches.micro_batches_per_epoch)
    if start.done(total):  # another layout trained to the end: its final output stands
        said = f"done already: final output of step {total} in {config.final_dir}"
        ConsoleProgress(total, enabled=ranks.rank == 0).message(said)
        return None
    engine = build_engine(config, built.model, total, converted=start.conversion is not None)
    run = Run(config, ranks, engine, manager, batches)
    progress = ConsoleProgress(total, enabled=ranks.rank == 0)
    progress.message(f"metrics: rank 0 serves /metrics on port {metrics.port}")  # ephemeral under `memfit run --local`
    if batches.statistics is not None:  # what truncation and padding cost, said once (not known when streaming)
        progress.message(batches.statistics.describe())
    position, step, saved = DataPosition(), 0, 0
    resumed = resume(run, start)
    metrics.started(resumed_from_step=None if resumed is None else resumed.step, set_aside=start.set_aside)
    if resumed is not None:
        step, position, saved = resumed.step, resumed.position, resumed.step
        progress.message(f"resumed from checkpoint step {step} ({resumed.said})")
    else:
        torch.manual_seed(training.seed + ranks.rank)  # dropout differs per rank, reproducibly

    device = engine.device
    loss_of, summaries = _install_techniques(run, progress)
    validation = Validation(held_out, engine.module, loss_of, device) if held_out is not None else None
    accumulation = training.gradient_accumulation_steps
    samples_per_rank, tokens_per_rank = rank_share(training)
    stream = batches.iterate(position)
    while step < total and not stop.agreed(device):
        started = time.monotonic()
        guard.at(step + 1)  # an OOM from here on is reported as this step's
        loss_sum = torch.zeros((), device=device)
        for _ in range(accumulation):
            position, batch = next(stream)
            loss = loss_of({k: v.to(device) for k, v in batch.items()})
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        _inject_oom(step + 1)
        step += 1
        loss_value = _mean_across_ranks(loss_sum / accumulation)
        _check_finite(step, loss_value, engine.last_grad_norm, resumed.step if resumed is not None else None)
        seconds = time.monotonic() - started
        learning_rate = engine.learning_rate
        metrics.step(
            step=step,
            total_steps=total,
            loss=loss_value,
            learning_rate=learning_rate,
            tokens=tokens_per_rank,
            samples=samples_per_rank,
            step_seconds=seconds,
        )
        progress.step(step, loss_value, learning_rate, tokens_per_rank * ranks.world_size)
        if validation is not None and validation.due(step, total):
            report_validation(validation.evaluate(step), metrics, progress)
        if step % training.checkpoint_every_steps == 0 or step == total:
            _checkpoint(run, step, position, metrics)
            saved = step
        _hold(step, stop)
    if step < total:  # stopped
        if saved != step:
            _checkpoint(run, step, position, metrics)
        progress.message(f"stopped by {stop.describe()} at step {step}/{total}: run again to resume from there")
        return step
    for summary in summaries:
        progress.message(summary())
    with said_when_full(config.final_dir.parent, "the final export"):
        save_final(engine, built.tokenizer, config.final_dir, rank=ranks.rank, marker=final_marker(config, step))
    progress.message(f"done: step {step}/{total}, final output in {config.final_dir}")
    return None
