"""Prometheus metrics of one trainer rank, with the plan's predictions beside the measurements.

Every rank serves ``/metrics`` on ``metrics.port + local_rank`` from a registry of its own (nothing else
in the process leaks into it). All series carry ``finetunejob`` (namespace/name) and ``rank``:

* training: ``memfit_train_step``, ``memfit_train_loss``, ``memfit_train_learning_rate``,
  ``memfit_train_tokens_per_second`` (this rank, recent steps), ``memfit_train_step_duration_seconds``
  (histogram), ``memfit_train_samples_total`` and ``memfit_train_tokens_total`` (counters, this process);
* memory, read when scraped: on a GPU ``memfit_gpu_memory_{allocated,reserved,peak_allocated}_bytes``
  (``device="cuda:N"``, PyTorch's caching allocator); on every rank ``memfit_host_memory_bytes``
  (``device="cpu"``, ``kind="rss"``), the process's resident set: host RAM, never a GPU figure;
* the plan's estimates (only with ``prediction``): ``memfit_predicted_peak_allocated_bytes``,
  ``memfit_predicted_total_bytes``, ``memfit_gpu_capacity_bytes``, ``memfit_predicted_tokens_per_second``,
  and ``memfit_train_estimated_mfu_ratio`` only when the plan knows the GPU's peak FLOP/s;
* checkpoints: ``memfit_checkpoint_duration_seconds`` (histogram), ``memfit_checkpoint_last_step``,
  ``memfit_checkpoint_last_timestamp_seconds``;
* validation (only with ``data.validation``): ``memfit_validation_loss`` (the mean over all ranks' validation
  target tokens, the same on every rank), ``memfit_validation_step`` (the step it was computed at) and
  ``memfit_validation_duration_seconds`` (histogram; not counted in the tokens per second);
* rank 0 only, the job's progress: ``memfit_train_total_steps``, ``memfit_train_progress_ratio``,
  ``memfit_train_eta_seconds``; it also writes the progress file (:mod:`memfit.contract.progress`).

Gauges appear with their first real value, never as an invented zero; counters and histograms start at
zero, which is true for this process.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from memfit.api.vocabulary import Method
from memfit.contract.progress import (
    CHECKPOINT_STEP_METRIC,
    ETA_METRIC,
    RESUMED_FROM_STEP_METRIC,
    SET_ASIDE_METRIC,
    STEP_METRIC,
    TOKENS_PER_SECOND_METRIC,
    TOTAL_STEPS_METRIC,
    VALIDATION_LOSS_METRIC,
    VALIDATION_STEP_METRIC,
    Progress,
    write_progress,
)
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelShape

log = logging.getLogger(__name__)

RATE_WINDOW_STEPS = 20
"""Steps tokens/s, MFU and the ETA average over: smooths data-loading jitter, still follows a change of pace."""
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Optimizer-step seconds: a small LoRA step on one GPU up to a ZeRO-3 step with NVMe offload."""
CHECKPOINT_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
"""Checkpoint seconds: an adapter in a second up to a large model with optimizer states on a slow volume."""
LABELS = ("finetunejob", "rank")
"""`finetunejob` is namespace/name; not `job`, which Prometheus reserves for the scrape job."""


def model_flops_per_token(shape: ModelShape, sequence_length: int, method: Method) -> float:
    """Model FLOPs one trained token needs (MFU's numerator: recomputation is not counted), as the planner's
    throughput model counts them (:meth:`memfit.model_shape.ModelShape.model_flops_per_token`)."""
    return shape.model_flops_per_token(sequence_length, trains_base=method == Method.FULL)


def _resident_bytes() -> float:
    """This process's RSS from /proc (the trainer runs in Linux containers)."""
    with open("/proc/self/statm") as statm:
        return float(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class TrainerMetrics:
    """The metrics endpoint of one rank; rank 0 also reports the job's progress."""

    def __init__(self, config: TrainerConfig, *, rank: int, world_size: int, port: int, device: torch.device) -> None:
        self.rank, self.world_size = rank, world_size
        self.registry = CollectorRegistry()
        self._labels = (config.job, str(rank))
        self._checkpoint_every = config.training.checkpoint_every_steps
        self._progress_file = Path(config.metrics.progress_file) if rank == 0 and config.metrics.progress_file else None
        self.last_progress: Progress | None = None
        """Rank 0's progress after its last step (its termination message carries the final one)."""
        self._window: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW_STEPS)
        self._step: int | None = None
        self._total_steps: int | None = None
        self._loss = math.nan
        self._last_checkpoint_step: int | None = None
        self._last_checkpoint_seconds = 0.0
        self._resumed_from_step: int | None = None
        self._set_aside = 0
        self._validation_loss: float | None = None
        self._validation_step: int | None = None

        self._step_gauge = self._gauge(STEP_METRIC, "Optimizer steps completed (the last finished step).")
        self._loss_gauge = self._gauge("memfit_train_loss", "Training loss of the last optimizer step.")
        self._lr_gauge = self._gauge("memfit_train_learning_rate", "Learning rate of the last optimizer step.")
        self._tps_gauge = self._gauge(
            TOKENS_PER_SECOND_METRIC,
            f"Tokens this rank trained per second over its last {RATE_WINDOW_STEPS} optimizer steps "
            "(sum over ranks for the job).",
        )
        self._step_seconds = Histogram(
            "memfit_train_step_duration_seconds", "Wall time of one optimizer step on this rank.", LABELS,
            buckets=STEP_BUCKETS, registry=self.registry,
        ).labels(*self._labels)  # fmt: skip
        self._samples = Counter(
            "memfit_train_samples", "Samples this rank trained on since its process started (a sequence split "
            "over n ranks counts 1/n on each).", LABELS,
            registry=self.registry,
        ).labels(*self._labels)  # fmt: skip
        self._tokens = Counter(
            "memfit_train_tokens", "Tokens this rank trained on since its process started.", LABELS,
            registry=self.registry,
        ).labels(*self._labels)  # fmt: skip

        self._child(
            "memfit_host_memory_bytes",
            "Host memory of this trainer process: its resident set size (RSS) from /proc. Not GPU memory; on "
            "GPU ranks it shows what CPU offload and the data pipeline hold.",
            device="cpu", kind="rss",
        ).set_function(_resident_bytes)  # fmt: skip
        if device.type == "cuda":
            self._child(
                "memfit_gpu_memory_allocated_bytes",
                "GPU memory held by live tensors on this rank (torch.cuda.memory_allocated).",
                device=str(device),
            ).set_function(lambda: torch.cuda.memory_allocated(device))
            self._child(
                "memfit_gpu_memory_reserved_bytes",
                "GPU memory the PyTorch caching allocator holds on this rank (torch.cuda.memory_reserved).",
                device=str(device),
            ).set_function(lambda: torch.cuda.memory_reserved(device))
            self._child(
                "memfit_gpu_memory_peak_allocated_bytes",
                "Peak GPU memory held by tensors on this rank since start or the last reset "
                "(torch.cuda.max_memory_allocated); compare with memfit_predicted_peak_allocated_bytes.",
                device=str(device),
            ).set_function(lambda: torch.cuda.max_memory_allocated(device))

        self._mfu_gauge: Gauge | None = None
        self._flops_per_token = self._peak_flops = 0.0
        prediction = config.prediction
        if prediction is not None:
            plan = f"Estimate from the memfit plan ({prediction.strategy}), not a measurement:"
            self._child(
                "memfit_predicted_peak_allocated_bytes", f"{plan} peak GPU memory allocated by tensors per GPU."
            ).set(prediction.peak_allocated_bytes)
            self._child(
                "memfit_predicted_total_bytes",
                f"{plan} GPU memory per GPU with the allocator's fragmentation and the CUDA context.",
            ).set(prediction.total_bytes)
            self._child(
                "memfit_gpu_capacity_bytes",
                "Memory of one GPU as the memfit plan assumed it (GPU catalog or pool spec), not measured.",
            ).set(prediction.gpu_memory_bytes)
            self._child(
                "memfit_predicted_tokens_per_second",
                f"{plan} training tokens per second of the whole job (all ranks together; every rank exports "
                "the same value).",
            ).set(prediction.tokens_per_second)
            architecture = config.model.architecture
            if prediction.peak_flops and architecture is not None:
                training = config.training
                self._flops_per_token = model_flops_per_token(architecture, training.sequence_length, training.method)
                self._peak_flops = prediction.peak_flops
                self._mfu_gauge = self._gauge(
                    "memfit_train_estimated_mfu_ratio",
                    "Estimated model FLOPs utilisation of this rank's GPU: model FLOPs per token (6N plus causal "
                    "attention for full training, 4N plus attention with a frozen base) x this rank's tokens per "
                    "second / the plan's dense peak FLOP/s of one GPU.",
                )

        self._checkpoint_seconds = Histogram(
            "memfit_checkpoint_duration_seconds", "Wall time of one checkpoint save on this rank.", LABELS,
            buckets=CHECKPOINT_BUCKETS, registry=self.registry,
        ).labels(*self._labels)  # fmt: skip
        self._checkpoint_step_gauge = self._gauge(CHECKPOINT_STEP_METRIC, "Step of the last checkpoint saved.")
        self._resumed_gauge = self._gauge(RESUMED_FROM_STEP_METRIC, "Step of the checkpoint this process resumed from.")
        self._set_aside_gauge = self._gauge(
            SET_ASIDE_METRIC,
            "Newer checkpoints this process set aside as unusable (failed verification) before resuming.",
        )
        self._checkpoint_time_gauge = self._gauge(
            "memfit_checkpoint_last_timestamp_seconds", "Unix time the last checkpoint save finished."
        )

        self._validation_loss_gauge = self._gauge(
            VALIDATION_LOSS_METRIC,
            "Validation loss at memfit_validation_step: the mean over all ranks' validation target tokens.",
        )
        self._validation_step_gauge = self._gauge(VALIDATION_STEP_METRIC, "Step of the last validation loss.")
        self._validation_seconds = Histogram(
            "memfit_validation_duration_seconds", "Wall time of one validation pass on this rank.", LABELS,
            buckets=STEP_BUCKETS, registry=self.registry,
        ).labels(*self._labels)  # fmt: skip

        if rank == 0:
            self._total_gauge = self._gauge(TOTAL_STEPS_METRIC, "Optimizer steps the whole run takes.")
            self._ratio_gauge = self._gauge(
                "memfit_train_progress_ratio", "Share of the run's optimizer steps completed (0 to 1)."
            )
            self._eta_gauge = self._gauge(
                ETA_METRIC,
                "Estimated seconds until the last step: remaining steps and checkpoints at the recent pace.",
            )
        if self._progress_file is not None:
            self._progress_file.parent.mkdir(parents=True, exist_ok=True)

        try:
            self._server, self._thread = start_http_server(port, registry=self.registry)
        except OSError as error:
            raise OSError(f"cannot serve trainer metrics on port {port}: {error.strerror or error}") from error
        self.port: int = self._server.server_port
        self._closed = False

    @classmethod
    def from_config(cls, config: TrainerConfig, *, rank: int, local_rank: int, world_size: int) -> TrainerMetrics:
        """Serve on ``metrics.port + local_rank`` (an ephemeral port for port 0); GPU metrics only with CUDA."""
        port = config.metrics.port + local_rank if config.metrics.port else 0
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return cls(config, rank=rank, world_size=world_size, port=port, device=device)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        """A gauge labelled job and rank whose series appears with its first ``_set``."""
        return Gauge(name, documentation, LABELS, registry=self.registry)

    def _child(self, name: str, documentation: str, **extra: str) -> Gauge:
        """The single series of a gauge labelled job, rank and ``extra``, created now."""
        family = Gauge(name, documentation, LABELS + tuple(extra), registry=self.registry)
        return family.labels(*self._labels, *extra.values())

    def _set(self, gauge: Gauge, value: float) -> None:
        gauge.labels(*self._labels).set(value)

    def step(
        self,
        *,
        step: int,
        total_steps: int | None,
        loss: float,
        learning_rate: float,
        tokens: int,
        samples: float,
        step_seconds: float,
    ) -> None:
        """Record one finished optimizer step (this rank's tokens and samples); rank 0 reports progress."""
        self._step, self._total_steps, self._loss = step, total_steps, loss
        self._set(self._step_gauge, step)
        self._set(self._loss_gauge, loss)
        self._set(self._lr_gauge, learning_rate)
        self._step_seconds.observe(step_seconds)
        self._samples.inc(samples)
        self._tokens.inc(tokens)
        self._window.append((tokens, step_seconds))
        tokens_per_second = self._tokens_per_second()
        self._set(self._tps_gauge, tokens_per_second)
        if self._mfu_gauge is not None:
            self._set(self._mfu_gauge, self._flops_per_token * tokens_per_second / self._peak_flops)
        if self.rank == 0:
            self._report_progress()

    def started(self, *, resumed_from_step: int | None, set_aside: int) -> None:
        """Record where this process started: the checkpoint it resumed from (it counts as the last checkpoint
        until the first save), and how many newer ones it set aside."""
        self._set(self._set_aside_gauge, set_aside)
        self._set_aside = set_aside
        if resumed_from_step is not None:
            self._set(self._resumed_gauge, resumed_from_step)
            self._set(self._checkpoint_step_gauge, resumed_from_step)
            self._resumed_from_step = self._last_checkpoint_step = resumed_from_step

    def checkpoint(self, *, step: int, seconds: float) -> None:
        """Record a finished checkpoint save of ``step`` that took ``seconds``."""
        self._checkpoint_seconds.observe(seconds)
        self._set(self._checkpoint_step_gauge, step)
        self._set(self._checkpoint_time_gauge, time.time())
        self._last_checkpoint_step, self._last_checkpoint_seconds = step, seconds
        if self.rank == 0 and self._step is not None:
            self._report_progress()

    def validation(self, *, step: int, loss: float, seconds: float) -> None:
        """Record the validation loss computed after ``step`` (a pass of ``seconds``)."""
        self._validation_seconds.observe(seconds)
        self._set(self._validation_loss_gauge, loss)
        self._set(self._validation_step_gauge, step)
        self._validation_loss = loss if math.isfinite(loss) else None
        self._validation_step = step
        if self.rank == 0 and self._step is not None:
            self._report_progress()

    def close(self) -> None:
        """Stop serving (idempotent); the progress file stays for the operator to read."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _tokens_per_second(self) -> float:
        seconds = sum(s for _, s in self._window)
        return sum(t for t, _ in self._window) / seconds if seconds > 0 else 0.0

    def _eta_seconds(self) -> float | None:
        """Remaining steps at the recent mean step time, plus remaining checkpoints (every N steps and at the
        last step, as the loop saves them) at the last one's time."""
        if self._total_steps is None or self._step is None:
            return None
        every, total = self._checkpoint_every, self._total_steps
        steps_left = max(0, total - self._step)
        checkpoints_left = total // every - self._step // every + (total % every != 0) if steps_left else 0
        mean_step = sum(s for _, s in self._window) / len(self._window)
        return steps_left * mean_step + checkpoints_left * self._last_checkpoint_seconds

    def _report_progress(self) -> None:
        """Rank 0: progress gauges and the progress file (a failed write is logged, never fatal to training)."""
        assert self._step is not None
        eta_seconds = self._eta_seconds()
        percent = None
        if self._total_steps is not None and eta_seconds is not None:
            percent = 100 * self._step / self._total_steps
            self._set(self._total_gauge, self._total_steps)
            self._set(self._ratio_gauge, self._step / self._total_steps)
            self._set(self._eta_gauge, eta_seconds)
        if self.rank != 0:
            return
        updated = _now()
        progress = Progress(
            step=self._step,
            total_steps=self._total_steps,
            percent=percent,
            tokens_per_second=self._tokens_per_second() * self.world_size,
            eta_seconds=eta_seconds,
            eta=updated + timedelta(seconds=round(eta_seconds)) if eta_seconds is not None else None,
            last_checkpoint_step=self._last_checkpoint_step,
            loss=self._loss if math.isfinite(self._loss) else None,
            validation_loss=self._validation_loss,
            validation_step=self._validation_step,
            resumed_from_step=self._resumed_from_step,
            checkpoints_set_aside=self._set_aside,
            updated=updated,
        )
        self.last_progress = progress
        if self._progress_file is None:
            return
        try:
            write_progress(self._progress_file, progress)
        except OSError as error:
            log.warning("cannot write progress file %s: %s", self._progress_file, error)
