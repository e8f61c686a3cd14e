"""GPU truth kit: planned against measured peak memory and tokens/s of short local runs on this machine's GPUs.

Run from the repository root on a machine with CUDA GPUs (``nvidia-smi`` must answer: ``memfit run --local``
plans for the GPUs it reports):

    .venv/bin/python bench/gpu_truth.py [--cases PATTERN,...] [--json FILE] [--steps 8] [--warmup 3]
    .venv/bin/python bench/gpu_truth.py --cases default  # the default plans only (a lent GPU's first minutes)
    .venv/bin/python bench/gpu_truth.py --list          # the matrix, nothing run (any machine)
    .venv/bin/python bench/gpu_truth.py --plan-only     # plan every case for this machine, run nothing

Without a CUDA GPU it prints one line (``gpu_truth: no CUDA GPU on this machine; nothing measured``) and exits 0.

The default plans (``DEFAULT_PLANS``) are jobs as users write them (model, method, batch, sequence length and
nothing else): whatever the plan chooses for this machine runs, its engine and attention kernel included. The
matrix (``MATRIX``) crosses random-init model shapes from a 4-layer toy to Llama 3.1 8B with the methods
(full, LoRA, QLoRA) and techniques (ZeRO stages, optimizer and parameter offload, gradient checkpointing,
micro-batch and accumulation, sequence length, 8-bit optimizer, eager attention). Each case is a FineTuneJob
with ``model.randomInit: true``, a generated jsonl corpus (byte-level tokenizer, in a temporary directory)
and every strategy knob pinned, on ``--gpus`` GPUs (default 1). For each case the kit

1. plans it for this machine exactly as ``memfit run --local`` does (``inspect_machine`` / ``local_pool`` /
   ``plan_job``); a case the planner says does not fit here is skipped with the planner's reason, and a plan
   that is not exactly the case's knobs is skipped too (nothing is run under another strategy's name);
2. runs ``memfit run JOB --local --nproc N --workdir DIR`` as a subprocess (its own process group, a time
   limit per case), with the trainer's hold hook ``MEMFIT_TEST_HOLD_AFTER_STEP=WARMUP:FILE``: every rank
   waits after optimizer step WARMUP (metrics and progress written, outside any timed step) until the kit
   has read it; the rendered trainer config's ``prediction`` is checked against the kit's plan;
3. measures, and stops the run once its last step is measured (the final checkpoint and model save are not
   what it measures; an 8B full-training checkpoint alone is over 100 GB).

How it measures, and why there:

* **peak memory**: each rank's Prometheus endpoint, ``memfit_gpu_memory_peak_allocated_bytes``
  (``torch.cuda.max_memory_allocated()`` of that rank's device, read when scraped, never reset by the
  trainer). The trainer writes no file holding the peak and logs none, so scraping is the only source;
  ``memfit run --local`` serves metrics on an ephemeral port (``metrics.port: 0``), so the kit finds each
  rank's port from ``/proc`` (the trainer processes below the run, by ``RANK`` in their environment, and
  their listening TCP sockets) and keeps the one whose ``/metrics`` answers with memfit's series. It
  scrapes at the hold, every second after it, and at once when rank 0's progress file shows the last step;
  the figure reported is the largest over ranks (the plan is per GPU) together with the step the scrape
  had reached (``through step``), normally the last one.
* **tokens/s, steady state**: rank 0's progress file (``memfit.contract.progress``), whose
  ``tokensPerSecond`` is the job's rate over rank 0's last ``RATE_WINDOW_STEPS`` step times (the trainer's
  own ``step_seconds``, start-up and checkpoints excluded) times the world size. With ``steps <=
  RATE_WINDOW_STEPS`` the window holds every step so far, so ``steps / rate`` after step n is the time of
  steps 1..n per token; read exactly at step WARMUP (the hold) and at the last step N, the difference gives
  the rate of steps WARMUP+1..N alone: ``(N - k) / (N / rate_N - k / rate_k)``. The first WARMUP steps
  (allocator warm-up, kernel selection, lazily built optimizer states) are excluded.
* **out of memory**: the trainer's termination message (``{"reason": "OutOfMemory", "measuredPeakBytes"}``)
  gives the peak it had reached when it failed; it is reported with status ``out of memory``.

Output: a header line (date, GPU name from ``torch.cuda.get_device_name``, driver from ``nvidia-smi``, CUDA
and torch versions), a table (planned GiB = the plan's predicted ``peakAllocatedBytes``, measured GiB, ratio
measured/planned, planned tokens/s, measured tokens/s, ratio) and the same as JSON, rewritten after every case,
in ``--json FILE`` or by default in ``bench/results/gpu-truth-DATE.json`` (the README's table is printed from
the newest such file by ``bench/gpu_truth_report.py``). The header also names the versions of the trainer's
packages (``MEASURED_PACKAGES``). A
figure that was not measured is never shown as one: such rows say ``skipped: REASON``, ``not run`` or
``failed: REASON`` and leave the measured columns empty.

``run_cases(..., device="cpu")`` runs the same code path on a machine without a GPU (the tests' smoke run
of the toy case): the memory figure is then ``memfit_host_memory_bytes``, the trainer process's resident set
(host RAM, the largest value scraped), labelled as such everywhere; it is not comparable with a GPU plan.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import http.client
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool
from memfit.api.plan import PlanCandidate, PlanResult, Strategy
from memfit.api.vocabulary import Attention, MasterWeights, Method, Offload, Optimizer, Precision
from memfit.cli.local_machine import LocalMachine, inspect_machine, local_pool
from memfit.contract.progress import Progress, read_progress
from memfit.contract.reader import ConfigError, load_config
from memfit.units import GIB

NO_GPU_LINE = "gpu_truth: no CUDA GPU on this machine; nothing measured"
HOLD_ENV = "MEMFIT_TEST_HOLD_AFTER_STEP"
"""memfit_trainer.loop.HOLD_ENV. The trainer's constants are repeated, not imported: its modules import torch,
which --list and planning do not need (tests/test_gpu_truth.py checks that they agree)."""
RATE_WINDOW_STEPS = 20
"""memfit_trainer.metrics.RATE_WINDOW_STEPS: the steps the progress file's tokensPerSecond averages over."""
DEFAULT_STEPS = 8
DEFAULT_WARMUP = 3
DEFAULT_TIMEOUT_SECONDS = 1200.0
POLL_SECONDS = 0.05
SCRAPE_EVERY_SECONDS = 1.0
SCRAPE_TIMEOUT_SECONDS = 3.0
STOP_GRACE_SECONDS = 60.0
LOG_TAIL_LINES = 3
LOG_TAIL_CHARS = 400
JOB_NAMESPACE = "gpu-truth"
TRAINER_MODULE = "memfit_trainer.main"
CORPUS_WORDS = (
    "the", "model", "reads", "a", "line", "of", "text", "and", "learns", "which", "byte", "comes", "next",
    "while", "memory", "is", "measured", "against", "plan", "on", "one", "GPU", "with", "random", "weights",
)  # fmt: skip
"""The generated corpus's vocabulary (random-init models use a byte-level tokenizer: the text only has to be
long enough)."""
TOY = "toy"
"""The model name of the smallest case: examples/tiny's 4-layer Llama (seconds per run, also on a CPU)."""
TOY_ARCHITECTURE: dict[str, Any] = {
    "family": "llama",
    "hiddenSize": 128,
    "intermediateSize": 352,
    "numLayers": 4,
    "numAttentionHeads": 4,
    "numKeyValueHeads": 2,
    "vocabSize": 258,
}

Device = Literal["cuda", "cpu"]
MEMORY_METRIC: dict[Device, str] = {
    "cuda": "memfit_gpu_memory_peak_allocated_bytes",
    "cpu": "memfit_host_memory_bytes",
}
"""The series the measured memory is read from: torch.cuda.max_memory_allocated() on a GPU; on a CPU run
the process's resident set (host RAM, not GPU memory: only for the CPU smoke run)."""
MEMORY_MEANING: dict[Device, str] = {
    "cuda": "torch.cuda.max_memory_allocated() per GPU (memfit_gpu_memory_peak_allocated_bytes), largest rank",
    "cpu": "host RSS of the trainer process (memfit_host_memory_bytes), largest scraped: a CPU run, NOT GPU memory",
}
Status = Literal["measured", "skipped", "not run", "failed", "out of memory"]


# --- the matrix --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One short run: a model shape, a method and every strategy knob pinned (per GPU); or, unpinned, a job
    that states only its model, method, batch and sequence length, run as the plan chooses (a default plan)."""

    model: str
    """A preset of memfit.catalog.models, or TOY."""
    method: Method
    micro_batch_size: int
    sequence_length: int
    zero_stage: int = 0
    offload_optimizer: Offload = Offload.NONE
    offload_parameters: Offload = Offload.NONE
    gradient_checkpointing: bool = False
    accumulation: int = 1
    """Micro-batches per optimizer step on each GPU."""
    optimizer: Optimizer = Optimizer.ADAMW
    attention: Attention = Attention.SDPA
    chunked_loss: bool = False
    activation_offloading: bool = False
    master_weights: MasterWeights = MasterWeights.FP32
    pinned: bool = True
    """False: the knobs above are not the job's (``micro_batch_size`` is then its sequences per GPU and step)."""

    @property
    def name(self) -> str:
        """e.g. ``llama-3.1-8b-full-z2-optcpu-ckpt-mb1x1-s2048``, or ``llama-3.1-8b-auto-default-b8-s4096`` for
        a default plan: unique in the matrix, what ``--cases`` matches."""
        if not self.pinned:
            return f"{self.model}-{self.method.value}-default-b{self.micro_batch_size}-s{self.sequence_length}"
        optional = (
            (self.offload_optimizer != Offload.NONE, f"opt{self.offload_optimizer.value}"),
            (self.offload_parameters != Offload.NONE, f"param{self.offload_parameters.value}"),
            (self.gradient_checkpointing, "ckpt"),
            (True, f"mb{self.micro_batch_size}x{self.accumulation}"),
            (True, f"s{self.sequence_length}"),
            (self.optimizer != Optimizer.ADAMW, self.optimizer.value),
            (self.attention != Attention.SDPA, self.attention.value),
            (self.chunked_loss, "chunkedce"),
            (self.activation_offloading, "actcpu"),
            (self.master_weights != MasterWeights.FP32, f"{self.master_weights.value}masters"),
        )
        parts = [self.model, self.method.value, f"z{self.zero_stage}"] + [token for on, token in optional if on]
        return "-".join(parts)

    def global_batch_size(self, ranks: int) -> int:
        return self.micro_batch_size * self.accumulation * ranks

    def tokens_per_step(self, ranks: int) -> int:
        return self.global_batch_size(ranks) * self.sequence_length


def _case(model: str, method: Method, mb: int, seq: int, **knobs: Any) -> Case:
    return Case(model=model, method=method, micro_batch_size=mb, sequence_length=seq, **knobs)


_FULL, _LORA, _QLORA, _CPU = Method.FULL, Method.LORA, Method.QLORA, Offload.CPU
_TORCHTUNE_3B: dict[str, Any] = {
    "gradient_checkpointing": True,
    "chunked_loss": True,
    "master_weights": MasterWeights.BF16,
}
"""torchtune's Llama-3.2-3B full fine-tune, as issue 11 compared it (pure bf16, chunked loss, checkpointing)."""

MATRIX: tuple[Case, ...] = (
    _case(TOY, _FULL, 4, 128),
    # Qwen2.5 0.5B: a small model with a large (152k, tied) vocabulary: the loss buffers weigh.
    _case("qwen2.5-0.5b", _FULL, 4, 1024),
    _case("qwen2.5-0.5b", _FULL, 8, 2048, gradient_checkpointing=True),
    _case("qwen2.5-0.5b", _FULL, 2, 1024, accumulation=2),
    _case("qwen2.5-0.5b", _FULL, 2, 1024, attention=Attention.EAGER),
    _case("qwen2.5-0.5b", _FULL, 4, 1024, zero_stage=3),
    _case("qwen2.5-0.5b", _LORA, 4, 1024),
    _case("qwen2.5-0.5b", _QLORA, 4, 1024),
    # Llama 3.2 1B: 128k vocabulary, tied embeddings.
    _case("llama-3.2-1b", _FULL, 4, 2048),
    _case("llama-3.2-1b", _FULL, 4, 2048, gradient_checkpointing=True, optimizer=Optimizer.ADAMW_8BIT),
    _case("llama-3.2-1b", _LORA, 8, 2048, gradient_checkpointing=True),
    # Qwen2.5 1.5B: the ZeRO-1/2 code paths and optimizer offload to CPU.
    _case("qwen2.5-1.5b", _FULL, 4, 1024, zero_stage=1, offload_optimizer=_CPU),
    _case("qwen2.5-1.5b", _FULL, 2, 1024, zero_stage=2),
    # Llama 3.2 3B.
    _case("llama-3.2-3b", _FULL, 2, 2048, gradient_checkpointing=True),
    _case("llama-3.2-3b", _LORA, 2, 2048),
    _case("llama-3.2-3b", _QLORA, 4, 2048, gradient_checkpointing=True),
    # Qwen2.5 7B: adapters on a 7B base.
    _case("qwen2.5-7b", _LORA, 2, 2048, gradient_checkpointing=True),
    _case("qwen2.5-7b", _QLORA, 2, 2048, gradient_checkpointing=True),
    # Llama 3.1 8B: full training only with offload on one GPU; adapters with and without recomputation.
    _case("llama-3.1-8b", _FULL, 1, 2048, zero_stage=2, offload_optimizer=_CPU, gradient_checkpointing=True),
    _case(
        "llama-3.1-8b",
        _FULL,
        1,
        2048,
        zero_stage=3,
        offload_optimizer=_CPU,
        offload_parameters=_CPU,
        gradient_checkpointing=True,
    ),
    _case("llama-3.1-8b", _LORA, 1, 2048),
    _case("llama-3.1-8b", _LORA, 4, 4096, gradient_checkpointing=True),
    _case("llama-3.1-8b", _QLORA, 2, 2048, gradient_checkpointing=True),
    # The memory-saving techniques, alone and together (issue 11's two published comparisons among them).
    _case("qwen2.5-0.5b", _FULL, 8, 2048, gradient_checkpointing=True, chunked_loss=True),
    _case("qwen2.5-0.5b", _FULL, 8, 2048, gradient_checkpointing=True, activation_offloading=True),
    _case("qwen2.5-1.5b", _FULL, 4, 1024, zero_stage=2, master_weights=MasterWeights.BF16),
    _case("llama-3.2-3b", _FULL, 2, 4096, **_TORCHTUNE_3B),
    _case("llama-3.2-3b", _FULL, 2, 4096, **_TORCHTUNE_3B, activation_offloading=True),
    _case("llama-3.1-8b", _QLORA, 2, 2048, gradient_checkpointing=True, chunked_loss=True),
    _case(
        "llama-3.1-8b", _QLORA, 2, 2048, gradient_checkpointing=True, chunked_loss=True, activation_offloading=True
    ),  # fmt: skip
    _case(
        "llama-3.1-8b", _LORA, 2, 2048, gradient_checkpointing=True, chunked_loss=True, activation_offloading=True
    ),  # fmt: skip
)
"""Every pinned case, smallest first. Knobs are per GPU: with --gpus N each case keeps its micro-batch and
accumulation per GPU and its global batch grows N-fold."""

DEFAULT_PLANS: tuple[Case, ...] = tuple(
    Case(model=model, method=method, micro_batch_size=sequences, sequence_length=tokens, pinned=False)
    for model, method, sequences, tokens in (
        ("qwen2.5-0.5b", Method.AUTO, 8, 2048),
        ("llama-3.2-3b", Method.LORA, 8, 4096),
        ("llama-3.1-8b", Method.AUTO, 8, 4096),  # examples/llama-3.1-8b-lora.yaml, per GPU
        ("qwen2.5-7b", Method.QLORA, 4, 4096),
    )
)
"""The jobs as users write them, nothing but model, method, batch and sequence length: whatever the plan
chooses (engine, kernels, techniques) is what runs and is measured. Random weights need a model of typed
sizes (``randomInit``), so the models only profiled from their config.json (gpt-oss, Qwen3.5) are not here."""
CASES: tuple[Case, ...] = (MATRIX[0], *DEFAULT_PLANS, *MATRIX[1:])
"""What the kit runs, in this order: the toy (seconds: the kit works here), the default plans, the matrix."""


def select_cases(patterns: Sequence[str], cases: Sequence[Case] = CASES) -> list[Case]:
    """The cases whose name contains one of ``patterns`` or matches it as a glob (all without patterns)."""
    if not patterns:
        return list(cases)
    return [c for c in cases if any(p in c.name or fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def job_document(case: Case, *, ranks: int = 1, steps: int = DEFAULT_STEPS) -> dict[str, Any]:
    """The FineTuneJob of ``case`` (camelCase, as a user writes it): random init, the generated corpus on the
    ``data`` claim, every knob pinned (none for a default plan); a checkpoint only at the last step."""
    architecture = dict(TOY_ARCHITECTURE) if case.model == TOY else {"preset": case.model}
    training: dict[str, Any] = {
        "globalBatchSize": case.global_batch_size(ranks),
        "sequenceLength": case.sequence_length,
        "maxSteps": steps,
        "checkpointEverySteps": steps,
    }
    if not case.pinned:
        return _job(case, architecture, training, {"resources": {"maxGPUs": ranks}})
    strategy: dict[str, Any] = {
        "zeroStage": case.zero_stage,
        "offloadOptimizer": case.offload_optimizer.value,
        "offloadParameters": case.offload_parameters.value,
        "gradientCheckpointing": case.gradient_checkpointing,
        "microBatchSize": case.micro_batch_size,
        "attention": case.attention.value,
        "chunkedLoss": case.chunked_loss,
        "activationOffloading": case.activation_offloading,
        "masterWeights": case.master_weights.value,
    }
    training.update(precision=Precision.BF16.value, optimizer=case.optimizer.value)
    return _job(case, architecture, training, {"resources": {"maxGPUs": ranks}, "strategy": strategy})


def _job(case: Case, architecture: dict[str, Any], training: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "memfit.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": job_name(case), "namespace": JOB_NAMESPACE},
        "spec": {
            "model": {"name": case.model, "randomInit": True, "architecture": architecture},
            "dataset": {"source": {"pvc": "data", "path": "train.jsonl"}, "format": "jsonl", "textField": "text"},
            "method": case.method.value,
            "training": training,
            **more,
            "output": {"pvc": "output", "path": "run/"},
        },
    }


def job_name(case: Case) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in case.name.lower())


def build_job(case: Case, *, ranks: int = 1, steps: int = DEFAULT_STEPS) -> FineTuneJob:
    """The validated FineTuneJob of ``case`` (raises on a case the API refuses)."""
    return FineTuneJob.model_validate(job_document(case, ranks=ranks, steps=steps))


CASE_KNOBS = {
    "method": "method", "zero stage": "zero_stage", "optimizer offload": "offload_optimizer",
    "parameter offload": "offload_parameters", "gradient checkpointing": "gradient_checkpointing",
    "micro-batch": "micro_batch_size", "optimizer": "optimizer", "attention": "attention",
    "chunked loss": "chunked_loss", "activation offloading": "activation_offloading",
    "master weights": "master_weights",
}  # fmt: skip
"""The knobs a case pins, by the name a mismatch gives them: the same attribute of a Case and a Strategy."""


def case_mismatch(case: Case, strategy: Strategy, ranks: int) -> str | None:
    """How ``strategy`` differs from what ``case`` pins (None: it is exactly the case; a default plan pins only
    its GPUs)."""
    pairs: dict[str, tuple[object, object]] = {"GPUs": (strategy.gpus, ranks)}
    if case.pinned:
        pairs |= {label: (getattr(strategy, name), getattr(case, name)) for label, name in CASE_KNOBS.items()}
        pairs["accumulation"] = (strategy.gradient_accumulation_steps, case.accumulation)
        pairs["precision"] = (strategy.precision, Precision.BF16)
    differences = [f"{key} {str(got)} (case: {str(wanted)})" for key, (got, wanted) in pairs.items() if got != wanted]
    return "; ".join(differences) or None


def plan_case(job: FineTuneJob, pool: GPUPool, ranks: int) -> PlanResult:
    """Plan ``job`` on ``pool`` exactly as ``memfit run --local`` does (its resources narrowed to the pool and
    the rank count)."""
    from memfit.api.runtime import Runtime
    from memfit.planner.search import plan_job

    resources = job.spec.resources.model_copy(update={"pool": pool.metadata.name, "max_gpus": ranks})
    return plan_job(job.spec.model_copy(update={"resources": resources}), [pool], runtime=Runtime.local())


def why_not(result: PlanResult) -> str:
    """The planner's reason that nothing fits, in one line."""
    if result.rejected:
        return f"does not fit: {result.rejected[0].reason}"
    if result.advice:
        return f"does not fit: {result.advice[0]}"
    return "does not fit: the planner found no candidate"


# --- results -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """The plan's estimates for one case (never measurements)."""

    strategy: str
    attention: str
    peak_allocated_bytes: int
    total_bytes: int
    gpu_memory_bytes: int
    tokens_per_second: float

    @classmethod
    def of(cls, candidate: PlanCandidate) -> Planned:
        return cls(
            strategy=candidate.strategy.summary(),
            attention=str(candidate.strategy.attention),
            peak_allocated_bytes=candidate.memory.per_gpu.peak_allocated_bytes,
            total_bytes=candidate.memory.per_gpu.total,
            gpu_memory_bytes=candidate.gpu_memory_bytes,
            tokens_per_second=candidate.throughput.tokens_per_second,
        )


@dataclass
class Measured:
    """What one run measured; every field None until it was actually read from the run."""

    device: Device
    peak_bytes: float | None = None
    """The largest over ranks of MEMORY_METRIC[device] (on an OOM: the termination message's measuredPeakBytes)."""
    peak_through_step: int | None = None
    """The optimizer step every rank had reached when the scrape behind ``peak_bytes`` was taken."""
    peak_per_rank: dict[int, float] = field(default_factory=dict)
    tokens_per_second: float | None = None
    """Whole job, steady state over ``steady_steps``."""
    steady_steps: tuple[int, int] | None = None
    """First and last optimizer step the steady rate covers."""

    @property
    def memory_source(self) -> str:
        return MEMORY_MEANING[self.device]

    @property
    def anything(self) -> bool:
        return self.peak_bytes is not None or self.tokens_per_second is not None


def _measured_over_planned(measured: float | None, planned: float) -> float | None:
    """measured / planned, where a measurement exists and the plan predicts something."""
    return None if measured is None or planned <= 0 else measured / planned


@dataclass
class CaseResult:
    case: Case
    status: Status
    reason: str | None = None
    planned: Planned | None = None
    measured: Measured | None = None
    seconds: float | None = None
    """Wall time of the run (none when nothing ran)."""

    @property
    def memory_ratio(self) -> float | None:
        """Measured peak / planned peak (only when both exist)."""
        if self.planned is None or self.measured is None:
            return None
        return _measured_over_planned(self.measured.peak_bytes, self.planned.peak_allocated_bytes)

    @property
    def throughput_ratio(self) -> float | None:
        """Measured steady tokens/s / planned tokens/s (only when both exist)."""
        if self.planned is None or self.measured is None:
            return None
        return _measured_over_planned(self.measured.tokens_per_second, self.planned.tokens_per_second)

    def to_dict(self) -> dict[str, Any]:
        case = self.case
        measured = self.measured
        return {
            "name": case.name,
            "case": {
                "model": case.model,
                "method": case.method.value,
                "zeroStage": case.zero_stage,
                "offloadOptimizer": case.offload_optimizer.value,
                "offloadParameters": case.offload_parameters.value,
                "gradientCheckpointing": case.gradient_checkpointing,
                "microBatchSize": case.micro_batch_size,
                "gradientAccumulationSteps": case.accumulation,
                "sequenceLength": case.sequence_length,
                "optimizer": case.optimizer.value,
                "attention": case.attention.value,
                "pinned": case.pinned,
            },
            "status": self.status,
            "reason": self.reason,
            "planned": None
            if self.planned is None
            else {
                "strategy": self.planned.strategy,
                "attention": self.planned.attention,
                "peakAllocatedBytes": self.planned.peak_allocated_bytes,
                "totalBytes": self.planned.total_bytes,
                "gpuMemoryBytes": self.planned.gpu_memory_bytes,
                "tokensPerSecond": self.planned.tokens_per_second,
            },
            "measured": None
            if measured is None or not measured.anything
            else {
                "device": measured.device,
                "memorySource": measured.memory_source,
                "peakBytes": measured.peak_bytes,
                "peakThroughStep": measured.peak_through_step,
                "peakBytesPerRank": {str(rank): value for rank, value in sorted(measured.peak_per_rank.items())},
                "tokensPerSecond": measured.tokens_per_second,
                "steadySteps": list(measured.steady_steps) if measured.steady_steps else None,
            },
            "ratios": {"peakMemory": self.memory_ratio, "tokensPerSecond": self.throughput_ratio},
            "seconds": self.seconds,
        }


def steady_tokens_per_second(warmup: int, rate_at_warmup: float, steps: int, rate_at_end: float) -> float:
    """The job's tokens/s over steps warmup+1..steps from the progress file's rates after step ``warmup`` and
    after step ``steps`` (each: tokens of steps 1..n over their summed step time, as long as n is within the
    trainer's RATE_WINDOW_STEPS). Raises ValueError where that cannot be worked out."""
    if not 1 <= warmup < steps <= RATE_WINDOW_STEPS:
        raise ValueError(f"needs 1 <= warmup ({warmup}) < steps ({steps}) <= {RATE_WINDOW_STEPS}")
    if not (rate_at_warmup > 0 and rate_at_end > 0 and math.isfinite(rate_at_warmup) and math.isfinite(rate_at_end)):
        raise ValueError(f"the progress file's rates are not positive ({rate_at_warmup}, {rate_at_end})")
    seconds_per_token_after = steps / rate_at_end - warmup / rate_at_warmup  # x tokens per step
    if seconds_per_token_after <= 0:
        raise ValueError("the progress file's rates are inconsistent (the later steps took no time)")
    return (steps - warmup) / seconds_per_token_after


# --- the output --------------------------------------------------------------------------------------------


def header_line(info: dict[str, str]) -> str:
    return "gpu_truth " + "  ".join(f"{key}: {value}" for key, value in info.items())


def gib_text(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def rate_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def status_text(result: CaseResult) -> str:
    text: str = result.status
    if result.reason:
        text += f": {result.reason}"
    return text


TABLE_COLUMNS = (
    "case",
    "planned GiB",
    "measured GiB",
    "mem ratio",
    "planned tok/s",
    "measured tok/s",
    "tok/s ratio",
    "status",
)


def table_rows(results: Sequence[CaseResult]) -> list[list[str]]:
    rows = []
    for result in results:
        planned, measured = result.planned, result.measured
        peak = measured.peak_bytes if measured else None
        peak_text = gib_text(peak)
        if peak is not None and result.status == "out of memory":
            peak_text += " @OOM"
        elif measured is not None and peak is not None and measured.peak_through_step is not None:
            peak_text += f" @{measured.peak_through_step}"
        rows.append([
            result.case.name,
            gib_text(planned.peak_allocated_bytes if planned else None),
            peak_text,
            ratio_text(result.memory_ratio),
            rate_text(planned.tokens_per_second if planned else None),
            rate_text(measured.tokens_per_second if measured else None),
            ratio_text(result.throughput_ratio),
            status_text(result),
        ])  # fmt: skip
    return rows


def format_table(results: Sequence[CaseResult], device: Device = "cuda") -> str:
    """The results as a plain-text table (numbers right-aligned) with what the columns mean below it."""
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in [list(TABLE_COLUMNS), *rows]) for i in range(len(TABLE_COLUMNS))]
    last = len(TABLE_COLUMNS) - 1

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            if i == last:
                out.append(cell)
            elif i == 0:
                out.append(cell.ljust(widths[i]))
            else:
                out.append(cell.rjust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [line(TABLE_COLUMNS), line(["-" * w for w in widths[:last]] + ["-" * len(TABLE_COLUMNS[last])])]
    lines += [line(row) for row in rows]
    lines += [
        "planned GiB: the plan's peakAllocatedBytes (an estimate of torch.cuda.max_memory_allocated()); "
        "planned tok/s: the plan's throughput estimate.",
        f"measured GiB: {MEMORY_MEANING[device]}; @N: the optimizer step the scrape had reached; @OOM: the "
        "peak when a step ran out of memory (a lower bound of what it needed).",
        "measured tok/s: whole job, steady state (steps after the warm-up), from the trainer's own step times.",
        "ratios: measured / planned. '-': not measured or not planned (see status).",
    ]
    return "\n".join(lines)


def report_json(info: dict[str, str], settings: dict[str, Any], results: Sequence[CaseResult]) -> dict[str, Any]:
    return {"header": info, "settings": settings, "results": [result.to_dict() for result in results]}


RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where a GPU run writes its results by default, one dated file per run: what the README's table is made of
(``bench/gpu_truth_report.py``)."""


def dated_results_path(date: str) -> Path:
    """``results/gpu-truth-YYYY-MM-DD.json`` for the header's ISO date (``-2``, ``-3``... for more runs that day)."""
    day = date[:10]
    path = RESULTS_DIR / f"gpu-truth-{day}.json"
    again = 2
    while path.exists():
        path, again = RESULTS_DIR / f"gpu-truth-{day}-{again}.json", again + 1
    RESULTS_DIR.mkdir(exist_ok=True)
    return path


# --- running one case --------------------------------------------------------------------------------------


def write_corpus(path: Path, tokens: int, seed: int = 0) -> Path:
    """At least ``tokens`` byte-level tokens of plain English-like text, one jsonl record per ~2000 bytes."""
    words = CORPUS_WORDS
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w") as handle:
        while written < tokens:
            text = " ".join(rng.choice(words) for _ in range(330))
            handle.write(json.dumps({"text": text}) + "\n")
            written += len(text) + 1
    return path


def memfit_command() -> list[str]:
    """``memfit`` of this interpreter's environment."""
    return [sys.executable, "-m", "memfit.cli.main"]


def _proc(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as handle:
        return handle.read()


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _proc(int(entry), "stat").decode(errors="replace")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def trainer_ranks(root: int) -> dict[int, int]:
    """rank -> pid of the trainer processes below ``root`` (their command line runs TRAINER_MODULE; the rank is
    the ``RANK`` torchrun put in their environment)."""
    ranks: dict[int, int] = {}
    for pid in descendants(root):
        try:
            command = _proc(pid, "cmdline").split(b"\0")
            environ = _proc(pid, "environ").split(b"\0")
        except OSError:
            continue
        if TRAINER_MODULE.encode() not in command or any(arg.startswith(b"--nproc") for arg in command):
            continue  # not the trainer, or torchrun's agent (whose arguments name the trainer's module too)
        variables = dict(v.split(b"=", 1) for v in environ if b"=" in v)
        rank = variables.get(b"RANK", b"")
        if b"LOCAL_RANK" in variables and rank.isdigit():
            ranks[int(rank)] = pid
    return ranks


def listening_ports(pid: int) -> list[int]:
    """TCP ports process ``pid`` listens on, those bound to every address first (where prometheus_client's
    server binds by default)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    except OSError:
        return []
    found: list[tuple[bool, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = _proc(pid, f"net/{table}").decode().splitlines()[1:]
        except OSError:
            continue
        for row in lines:
            fields = row.split()
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].rsplit(":", 1)
            found.append((set(address) != {"0"}, int(port, 16)))
    return [port for _, port in sorted(set(found))]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_SECONDS) as response:
        return str(response.read().decode())


def metric_values(text: str) -> dict[str, float]:
    """Sample name -> value of a Prometheus exposition (the largest where a name has several series)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = max(values.get(sample.name, -math.inf), float(sample.value))
    return values


def find_metrics_port(pid: int) -> int | None:
    """The port of ``pid``'s listening sockets whose /metrics answers with the trainer's series."""
    for port in listening_ports(pid):
        try:
            if "memfit_train_" in scrape(port):
                return port
        except (OSError, ValueError, http.client.HTTPException):
            continue
    return None


def _log_tail(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-LOG_TAIL_LINES:])[-LOG_TAIL_CHARS:]


def _termination(path: Path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _read_progress(path: Path) -> Progress | None:
    try:
        return read_progress(path)
    except (OSError, ValidationError):
        return None  # the trainer replaces it atomically; a bad document is read again at the next poll


class _RunFailed(Exception):
    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class _Run:
    """One ``memfit run --local`` subprocess: polling, scraping, stopping."""

    def __init__(self, command: list[str], env: dict[str, str], directory: Path, device: Device, ranks: int) -> None:
        self.directory, self.device, self.ranks = directory, device, ranks
        self.log = directory / "run.log"
        self.work = directory / "work"
        self.progress_file = self.work / "progress.json"
        self.release = directory / "release"
        self.ports: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.last_scrape = -math.inf
        self.measured = Measured(device)
        self.scraped_steps: dict[int, int] = {}
        self.family: set[int] = set()
        """Every process seen below the run (remember_family)."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=directory,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.process.poll() is None

    def ended_reason(self) -> _RunFailed:
        """Why the run ended before it was measured."""
        code = self.process.returncode
        termination = _termination(self.work / "termination-log")
        if termination and termination.get("reason") == "OutOfMemory":
            peak = termination.get("measuredPeakBytes")
            if isinstance(peak, int | float) and self.device == "cuda":
                self.measured.peak_bytes = float(peak)
                self.measured.peak_through_step = None
            return _RunFailed("out of memory", f"CUDA out of memory in step {termination.get('step')}")
        if termination and termination.get("message"):
            return _RunFailed("failed", f"exit code {code}: {termination.get('reason')}: {termination['message']}")
        return _RunFailed("failed", f"exit code {code}: {_log_tail(self.log) or 'no output'}")

    def wait_for_step(self, step: int, deadline: float) -> Progress:
        """Poll rank 0's progress file until it shows ``step`` (scraping every SCRAPE_EVERY_SECONDS)."""
        while True:
            progress = _read_progress(self.progress_file)
            if progress is not None and progress.step >= step:
                return progress
            if not self.alive():
                raise self.ended_reason()
            if time.monotonic() > deadline:
                at = progress.step if progress else 0
                raise _RunFailed("failed", f"timed out at step {at} (waiting for step {step})")
            if time.monotonic() - self.last_scrape > SCRAPE_EVERY_SECONDS:
                self.remember_family()
                self.scrape_all()
            time.sleep(POLL_SECONDS)

    def discover(self, deadline: float) -> None:
        """Find every rank's process and metrics port (the ranks hold, so their servers answer)."""
        while True:
            self.pids = trainer_ranks(self.process.pid)
            self.family |= set(self.pids.values())
            for rank, pid in self.pids.items():
                if rank not in self.ports and (port := find_metrics_port(pid)) is not None:
                    self.ports[rank] = port
            if len(self.ports) == self.ranks:
                return
            if not self.alive():
                raise self.ended_reason()
            if time.monotonic() > deadline:
                raise _RunFailed("failed", f"found the metrics of ranks {sorted(self.ports)} of {self.ranks}")
            time.sleep(0.5)

    def scrape_all(self) -> None:
        """Read every rank's memory series; keep the largest value and the step each rank had reached."""
        self.last_scrape = time.monotonic()
        metric = MEMORY_METRIC[self.device]
        for rank, port in self.ports.items():
            try:
                values = metric_values(scrape(port))
            except (OSError, ValueError, http.client.HTTPException):
                continue  # finished, or between steps: the last good scrape stands
            if metric in values:
                self.measured.peak_per_rank[rank] = max(self.measured.peak_per_rank.get(rank, 0.0), values[metric])
            if "memfit_train_step" in values:
                self.scraped_steps[rank] = int(values["memfit_train_step"])
        if len(self.measured.peak_per_rank) == self.ranks:
            self.measured.peak_bytes = max(self.measured.peak_per_rank.values())
            self.measured.peak_through_step = min(self.scraped_steps.values()) if self.scraped_steps else None

    def remember_family(self) -> None:
        """Note every process below the run (torchrun's agent, the ranks), to end them even if the run's own
        process has gone first."""
        if self.alive():
            self.family |= set(descendants(self.process.pid))

    def stop(self) -> None:
        """End the run and everything below it: SIGTERM to its process group (memfit run and torchrun's agent,
        which ends its workers: they run in sessions of their own), SIGKILL after STOP_GRACE_SECONDS, then the
        same for any process of the run still there; returns when they are gone, so that the next case starts
        on free GPUs."""
        self.remember_family()
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while (alive := [pid for pid in self.family if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        while [pid for pid in alive if _running(pid)] and time.monotonic() < deadline + STOP_GRACE_SECONDS:
            time.sleep(0.2)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = _proc(pid, "stat").decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _planned_of_config(work: Path) -> str | None:
    """The strategy the trainer config that memfit run rendered carries (None where it cannot be read)."""
    try:
        config = load_config(work / "trainer-config.json")
    except (ConfigError, OSError):
        return None
    return config.prediction.strategy if config.prediction else None


def run_case(
    case: Case,
    *,
    machine: LocalMachine,
    device: Device,
    ranks: int,
    steps: int,
    warmup: int,
    timeout: float,
    root: Path,
    run: bool = True,
) -> CaseResult:
    """Plan ``case`` for this machine and (with ``run``) run and measure it with ``memfit run --local``."""
    try:
        job = build_job(case, ranks=ranks, steps=steps)
        result = plan_case(job, local_pool(machine, ranks), ranks)
    except (ValidationError, ValueError) as error:
        return CaseResult(case, "skipped", f"cannot be planned here: {error}")
    if result.chosen is None:
        return CaseResult(case, "skipped", why_not(result))
    planned = Planned.of(result.chosen)
    mismatch = case_mismatch(case, result.chosen.strategy, ranks)
    if mismatch is not None:
        return CaseResult(case, "skipped", f"the plan is not the case: {mismatch}", planned)
    if not run:
        return CaseResult(case, "not run", "--plan-only", planned)

    directory = root / job_name(case)
    directory.mkdir(parents=True, exist_ok=False)
    write_corpus(directory / "data" / "train.jsonl", tokens=case.tokens_per_step(ranks) * steps * 2)
    job_file = directory / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_document(case, ranks=ranks, steps=steps), sort_keys=False))
    env = dict(os.environ)
    env[HOLD_ENV] = f"{warmup}:{directory / 'release'}"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = [*memfit_command(), "run", str(job_file), "--local", "--nproc", str(ranks),
               "--workdir", str(directory / "work")]  # fmt: skip
    started = time.monotonic()
    deadline = started + timeout
    process = _Run(command, env, directory, device, ranks)
    status: Status = "measured"
    reason: str | None = None
    try:
        at_warmup = process.wait_for_step(warmup, deadline)
        if at_warmup.step != warmup:
            raise _RunFailed("failed", f"the run did not hold after step {warmup} (progress at {at_warmup.step})")
        config_strategy = _planned_of_config(process.work)
        if config_strategy != planned.strategy:
            raise _RunFailed("failed", f"memfit run planned {config_strategy!r}, the kit {planned.strategy!r}")
        process.discover(deadline)
        process.scrape_all()
        process.release.touch()
        at_end = process.wait_for_step(steps, deadline)
        process.scrape_all()
        process.measured.tokens_per_second = steady_tokens_per_second(
            warmup, at_warmup.tokens_per_second, steps, at_end.tokens_per_second
        )
        process.measured.steady_steps = (warmup + 1, steps)
        if process.measured.peak_bytes is None:
            status, reason = "failed", "no rank's memory series could be scraped"
        elif process.measured.peak_through_step is not None and process.measured.peak_through_step < steps:
            reason = f"memory read at step {process.measured.peak_through_step} of {steps}"
    except _RunFailed as failure:
        status, reason = failure.status, failure.reason
    except ValueError as error:
        status, reason = "failed", str(error)
    finally:
        process.release.touch()
        process.stop()
    return CaseResult(case, status, reason, planned, process.measured, round(time.monotonic() - started, 1))


def run_cases(
    cases: Sequence[Case],
    *,
    device: Device = "cuda",
    ranks: int = 1,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    run: bool = True,
    keep: Path | None = None,
    machine: LocalMachine | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
    budget: float | None = None,
) -> list[CaseResult]:
    """Plan, run and measure ``cases`` one after the other on this machine. ``device="cpu"``: the CPU smoke
    path (a machine without GPUs; memory is the trainer's host RSS, labelled as such). ``budget``: seconds
    after which no further case starts (a lent GPU's minutes are counted); those left say ``not run``."""
    if not 1 <= warmup < steps <= RATE_WINDOW_STEPS:
        raise ValueError(f"needs 1 <= --warmup ({warmup}) < --steps ({steps}) <= {RATE_WINDOW_STEPS}")
    machine = machine or inspect_machine()
    if device == "cuda" and not machine.has_gpus:
        raise ValueError("nvidia-smi reports no GPU: memfit run --local would plan for CPU processes")
    if device == "cpu" and machine.has_gpus:
        raise ValueError("device='cpu' is for machines without GPUs (memfit run --local would use the GPUs)")
    results = []
    stop_starting = None if budget is None else time.monotonic() + budget
    with _root(keep) as root:
        for case in cases:
            if stop_starting is not None and time.monotonic() > stop_starting:
                results.append(CaseResult(case, "not run", f"the --budget of {budget:g} s was spent"))
                continue
            result = run_case(case, machine=machine, device=device, ranks=ranks, steps=steps, warmup=warmup,
                              timeout=timeout, root=root, run=run)  # fmt: skip
            if keep is None and (root / job_name(case)).exists():
                shutil.rmtree(root / job_name(case), ignore_errors=True)  # an 8B run leaves GBs of output
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


class _root:
    """``keep`` (created), or a temporary directory removed afterwards."""

    def __init__(self, keep: Path | None) -> None:
        self.keep = keep
        self.temporary: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Path:
        if self.keep is not None:
            run = self.keep / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            run.mkdir(parents=True)
            return run
        self.temporary = tempfile.TemporaryDirectory(prefix="memfit-gpu-truth-")
        return Path(self.temporary.name)

    def __exit__(self, *_: object) -> None:
        if self.temporary is not None:
            self.temporary.cleanup()


# --- the machine -------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` (False without torch: nothing could be measured either)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


GPU_INFO_SCRIPT = """
import json, torch
print(json.dumps({"names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                  "cuda": torch.version.cuda, "torch": torch.__version__}))
"""


def machine_info(device: Device) -> dict[str, str]:
    """The header: date, GPU name(s) (torch.cuda.get_device_name), driver (nvidia-smi), CUDA and torch.

    The CUDA queries run in a child process, so that this one holds no CUDA context on a GPU the runs use."""
    info = {"date": datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")}
    if device == "cpu":
        import torch

        info.update(device="CPU only (memory: host RSS, not GPU memory)", torch=torch.__version__)
        return info
    query = subprocess.run([sys.executable, "-c", GPU_INFO_SCRIPT], capture_output=True, text=True, timeout=300)
    details: dict[str, Any] = json.loads(query.stdout) if query.returncode == 0 else {}
    names: list[str] = details.get("names", [])
    counted = {name: names.count(name) for name in names}
    info["gpu"] = ", ".join(f"{count}x {name}" for name, count in counted.items()) or "unknown"
    info["driver"] = _driver_version()
    info["cuda"] = str(details.get("cuda") or "unknown")
    info["torch"] = str(details.get("torch") or "unknown")
    info.update(package_versions())
    return info


MEASURED_PACKAGES = ("transformers", "deepspeed", "peft", "bitsandbytes", "flash-attn", "liger-kernel")
"""The trainer's packages whose versions a measurement depends on (a header field each)."""


def package_versions() -> dict[str, str]:
    """The installed version of each of :data:`MEASURED_PACKAGES` ("not installed" where it is not)."""
    versions = {}
    for name in MEASURED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _driver_version() -> str:
    try:
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except OSError:
        return "unknown"
    lines = query.stdout.split()
    return lines[0] if query.returncode == 0 and lines else "unknown"


# --- the command line --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu_truth.py", description="Planned vs measured peak GPU memory and tokens/s of short local runs."
    )
    parser.add_argument("--cases", default="", help="comma-separated substrings or globs of case names (default all)")
    parser.add_argument("--list", action="store_true", help="list the (selected) cases and exit")
    parser.add_argument("--plan-only", action="store_true", help="plan each case for this machine, run none")
    parser.add_argument(
        "--json", type=Path, metavar="FILE",
        help=f"write the results as JSON to FILE (default on a GPU: {RESULTS_DIR.name}/gpu-truth-DATE.json in bench/)",
    )  # fmt: skip
    parser.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs (ranks) per case (default 1)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per run (<= {RATE_WINDOW_STEPS})"
    )
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="first steps left out of tokens/s")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="seconds per case")
    parser.add_argument("--budget", type=float, metavar="SECONDS", help="start no case after this many seconds")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep each case's job, data, log and work dir here")
    return parser


def list_cases(cases: Sequence[Case], ranks: int, steps: int) -> str:
    lines = []
    for case in cases:
        lines.append(f"{case.name}  ({case.global_batch_size(ranks)} x {case.sequence_length} tokens per step, "
                     f"{steps} steps)")  # fmt: skip
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cases = select_cases([p.strip() for p in args.cases.split(",") if p.strip()])
    if not cases:
        print(f"gpu_truth: no case matches {args.cases!r} (--list shows them)", file=sys.stderr)
        return 2
    if args.list:
        print(list_cases(cases, args.gpus, args.steps))
        return 0
    if not 1 <= args.warmup < args.steps <= RATE_WINDOW_STEPS:
        print(f"gpu_truth: needs 1 <= --warmup < --steps <= {RATE_WINDOW_STEPS}", file=sys.stderr)
        return 2
    if not cuda_available():
        print(NO_GPU_LINE)
        return 0
    info = machine_info("cuda")
    print(header_line(info), flush=True)
    if args.json is None and not args.plan_only:
        args.json = dated_results_path(info["date"])
    # A SIGTERM (a scheduler's, `timeout`'s) ends the case in progress like Ctrl-C does: the run is stopped,
    # its processes (in sessions of their own) too, rather than left training on the GPU.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    settings = {"gpus": args.gpus, "steps": args.steps, "warmup": args.warmup, "planOnly": args.plan_only}
    done: list[CaseResult] = []

    def progress(result: CaseResult) -> None:
        print(f"gpu_truth: {result.case.name}: {status_text(result)}", file=sys.stderr, flush=True)
        done.append(result)
        if args.json is not None:  # after every case: a run stopped from outside keeps what it measured
            args.json.write_text(json.dumps(report_json(info, settings, done), indent=2) + "\n")

    try:
        results = run_cases(
            cases, device="cuda", ranks=args.gpus, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
            run=not args.plan_only, keep=args.keep, on_result=progress, budget=args.budget,
        )  # fmt: skip
    except ValueError as error:
        print(f"gpu_truth: {error}", file=sys.stderr)
        return 2
    print(format_table(results, "cuda"))
    if args.json is not None:
        args.json.write_text(json.dumps(report_json(info, settings, results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
