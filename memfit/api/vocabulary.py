"""memfit's words, each defined once: the enumerations of the API, the plan, the trainer's contract and the
operator's status. Everything else imports them from here, so a value is spelled in one place only.

A plan never holds ``auto``: the ``Planned*`` types are the subsets a chosen strategy can take.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import Field

MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "memfit"
"""The label, and its value, on every object the operator creates: how it finds (and watches) its own pods."""

ALL_LINEAR: Final = "all-linear"
"""peft's ``target_modules`` shorthand for every linear layer but the output head."""

TIMESTAMP_FORMAT: Final = "%Y-%m-%dT%H:%M:%SZ"
"""RFC 3339 in UTC to the second (``strftime``): the timestamps of a FineTuneJob's status and of checkpoint markers."""


class Method(StrEnum):
    """How the weights are trained."""

    AUTO = "auto"
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


PlannedMethod = Literal[Method.FULL, Method.LORA, Method.QLORA]
"""A method a plan can run (never auto)."""


class Precision(StrEnum):
    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


PlannedPrecision = Literal[Precision.BF16, Precision.FP16, Precision.FP32]
"""A precision a plan can run (never auto)."""


class Devices(StrEnum):
    """What a plan's ranks compute on (a trainer config's ``devices``)."""

    CUDA = "cuda"
    """NVIDIA GPUs, one per rank: the trainer refuses to start where it sees none."""
    CPU = "cpu"
    """CPU processes (a CPU pool, or ``memfit run --local`` without GPUs)."""


class Offload(StrEnum):
    """Where offloaded states live: the GPU itself (none), CPU memory, or NVMe."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Optimizer(StrEnum):
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw8bit"
    PAGED_ADAMW_8BIT = "paged_adamw8bit"
    ADAFACTOR = "adafactor"
    LION = "lion"


class Engine(StrEnum):
    """What shards and steps the model: DeepSpeed ZeRO, or PyTorch's FSDP2 (``fully_shard``)."""

    DEEPSPEED = "deepspeed"
    FSDP2 = "fsdp2"


class MasterWeights(StrEnum):
    """What the optimizer updates: fp32 master copies of the 16-bit weights (mixed precision), or the bf16
    weights themselves with bf16 gradients and optimizer states (pure bf16: less memory, other numerics)."""

    FP32 = "fp32"
    BF16 = "bf16"


EIGHT_BIT_OPTIMIZERS = frozenset({Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT})
"""bitsandbytes' optimizers: their states live on the GPU, so they never combine with optimizer offload."""


class Attention(StrEnum):
    SDPA = "sdpa"
    EAGER = "eager"
    FLASH = "flash"
    FLEX = "flex"
    """torch's ``flex_attention`` (transformers' ``flex_attention``): packed documents and padding become a
    ``BlockMask`` of 128x128 tiles, not a dense mask. CUDA only: torch has no flex backward on the CPU."""


ATTN_IMPLEMENTATION: dict[Attention, str] = {
    Attention.SDPA: "sdpa",
    Attention.EAGER: "eager",
    Attention.FLASH: "flash_attention_2",
    Attention.FLEX: "flex_attention",
}
"""``transformers``' name of each kernel (``attn_implementation``, and the kernels a profile says a model class
implements)."""


class TrainOn(StrEnum):
    """Which tokens of a record are training targets (``dataset.trainOn``)."""

    ASSISTANT = "assistant"
    """Chat records: the assistant turns only; prompt/completion records: the completion only."""
    ALL = "all"
    """Every token (system, user and tool turns, prompts, template markup)."""


class OnBadRecord(StrEnum):
    """What a record the trainer cannot use does (``dataset.onBadRecord``)."""

    FAIL = "fail"
    """Stop, naming its file, line and field."""
    SKIP = "skip"
    """Leave it out and count it."""


BYTE_TOKENIZER_VOCAB: Final = 258
"""Ids of the byte-level tokenizer randomInit models use without a tokenizer of their own (256 bytes, end of
text, padding): the model's vocabulary must hold them."""

DEFAULT_MAX_RECORD_MIB: Final = 4
"""``dataset.maxRecordMib``: a larger record is refused (or skipped) as read; its tokens would cost every
rank a few hundred times its size in memory."""
MAX_RECORD_MIB: Final = 1024


class DatasetFormat(StrEnum):
    JSONL = "jsonl"
    PARQUET = "parquet"
    ARROW = "arrow"


ZeroStage = Annotated[int, Field(ge=0, le=3)]
"""DeepSpeed ZeRO stage 0-3."""


class Phase(StrEnum):
    """Where a FineTuneJob is (status.phase)."""

    PENDING = "Pending"
    INVALID = "Invalid"
    UNSCHEDULABLE = "Unschedulable"
    LAUNCHING = "Launching"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    """The conditions of a FineTuneJob's status."""

    READY = "Ready"
    PLANNED = "Planned"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    SUSPENDED = "Suspended"


class Reason(StrEnum):
    """The CamelCase reasons of conditions and Events."""

    SPEC_ACCEPTED = "SpecAccepted"
    INVALID_SPEC = "InvalidSpec"
    SPEC_IMMUTABLE = "SpecImmutable"
    PLANNED = "Planned"
    UNSCHEDULABLE = "Unschedulable"
    PROFILING = "Profiling"
    """The job types no model sizes: a profiling pod reads the model's config.json (Planned=False meanwhile)."""
    PROFILED = "Profiled"
    """The model's profile was stored in its ConfigMap (an Event)."""
    MODEL_UNREADABLE = "ModelUnreadable"
    """The model cannot be profiled (no config.json, an unknown model_type, the Hub refused): the profiling
    pod's one line."""
    POOL_GONE = "PoolGone"
    LAUNCHING = "Launching"
    RUNNING = "Running"
    COMPLETED = "Completed"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    RANK_FAILED = "RankFailed"
    OUT_OF_MEMORY = "OutOfMemory"
    REPLANNED = "Replanned"
    NO_LEANER_PLAN = "NoLeanerPlan"
    RESTART_LIMIT_REACHED = "RestartLimitReached"
    REPLAN_LIMIT_REACHED = "ReplanLimitReached"
    TRAINER_CONFIG_ERROR = "TrainerConfigError"
    SUSPEND_REQUESTED = "SuspendRequested"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    """spec.suspend is false again: a new attempt resumes from the last checkpoint."""
    RESUMED_FROM = "ResumedFrom"
    """The trainer resumed from another checkpoint than the one the launch expected (an Event, once)."""
    CHECKPOINT_SET_ASIDE = "CheckpointSetAside"
    """The trainer set aside newer checkpoints that failed verification or could not be read (a Warning, once)."""


class Outcome(StrEnum):
    """How a trainer pod, a gang of them, or an attempt stands or ended (status.attempts[].outcome)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    OUT_OF_MEMORY = "OutOfMemory"
    CONFIG_ERROR = "ConfigError"
    """The trainer refused its config or data: permanent, a restart would fail the same way."""
    SUSPENDED = "Suspended"


EndedOutcome = Literal[
    Outcome.SUCCEEDED, Outcome.FAILED, Outcome.OUT_OF_MEMORY, Outcome.CONFIG_ERROR, Outcome.SUSPENDED
]
"""How an attempt ended (never pending or running: an attempt under way has no outcome yet)."""


class TerminationReason(StrEnum):
    """The ``reason`` of the trainer's termination message (memfit.contract.termination)."""

    OUT_OF_MEMORY = "OutOfMemory"
    CONFIG_ERROR = "ConfigError"
    COMPLETED = "Completed"
    NO_SPACE = "NoSpace"
    """A checkpoint or the export could not be written: the output volume is full."""
    STOPPED = "Stopped"
    """Stopped on SIGTERM or SIGINT after a checkpoint of the step it was at: a restart resumes there."""
    NON_FINITE = "NonFinite"
    """The loss or the gradient norm of a step was NaN or infinite: stopped before anything of it was written."""


class StepPhase(StrEnum):
    """The two moments of a training step whose memory a GPU must hold (a plan's ``memory.binding``)."""

    FORWARD_BACKWARD = "forwardBackward"
    """The forward and backward passes of one micro-batch: weights, states, gradients and activations."""
    OPTIMIZER_STEP = "optimizerStep"
    """The optimizer step: weights, states and gradients with the fp32 gradient partition it reads;
    the activations are freed by then."""
