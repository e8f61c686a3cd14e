"""The trainer's config contract: the JSON the operator writes into a ConfigMap and ``memfit-train
--config FILE`` reads.

The trainer owns it (this module imports only pydantic and memfit's core, never torch, so the operator
can render it). Everything the trainer does is decided here; the environment adds only what Kubernetes
or torchrun know (rank, world size, master address, the Hub token's variable).

What the trainer reads is checked whole before any work (:func:`load_config`): strict JSON types (a string
is never a number, a float never an integer, a boolean neither), finite numbers within documented bounds,
absolute paths that do not climb (``..``) and stay inside the job's volumes where the config names them
(``volumes``), and a ``deepspeed`` section of the keys memfit renders that agrees with ``training``. A config
that breaks any of this is one :class:`ConfigError` line, never a traceback: the trainer exits 2 and the
operator fails the job instead of restarting it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from memfit.api.base import ApiModel
from memfit.api.knobs import Knobs
from memfit.api.knobs import conflicts as knob_conflicts
from memfit.api.loading import describe_validation_error
from memfit.api.vocabulary import (
    EIGHT_BIT_OPTIMIZERS,
    Attention,
    DatasetFormat,
    Engine,
    MasterWeights,
    Method,
    Offload,
    Optimizer,
    PlannedMethod,
    PlannedPrecision,
    Precision,
    TrainOn,
)
from memfit.contract.layout import CheckpointLayout
from memfit.model_shape import ModelShape

CONFIG_VERSION: Final = 1

# Reading the file: a trainer config is a few kilobytes of shallow JSON (a ConfigMap holds at most 1 MiB).
MAX_CONFIG_BYTES: Final = 1024 * 1024
MAX_CONFIG_DEPTH: Final = 16
"""Nesting of JSON objects and arrays (the deepest rendered key, deepspeed.zero_optimization.offload_param.
device, is at depth 4)."""

# Bounds: each at least the FineTuneJob API's own (memfit.api), so every config the renderer makes is
# valid, and small enough that the trainer's arithmetic stays finite and its loops bounded.
MAX_SEQUENCE_LENGTH: Final = 4 * 1024 * 1024
MAX_BATCH: Final = 1024 * 1024
"""Micro-batch size and gradient accumulation steps."""
MAX_GLOBAL_BATCH: Final = 16 * 1024 * 1024
MAX_STEPS: Final = 1_000_000_000
"""Epochs, optimizer steps, checkpoint interval."""
MAX_KEEP_CHECKPOINTS: Final = 10_000
MAX_SEED: Final = 2**32 - 1
MAX_LEARNING_RATE: Final = 10.0
MAX_WEIGHT_DECAY: Final = 100.0
MAX_GRAD_NORM: Final = 1e9
MAX_LORA_RANK: Final = 65_536
MAX_LORA_ALPHA: Final = 1e6
MAX_BYTES: Final = 2**63 - 1
MAX_PATH_LENGTH: Final = 4096
MAX_NAME_LENGTH: Final = 1024
MAX_BUCKET_ELEMENTS: Final = 2**40
ARCHITECTURE_BOUNDS: Final = {
    "hidden_size": 2**20,
    "intermediate_size": 2**23,
    "num_layers": 2**13,
    "num_attention_heads": 2**13,
    "num_key_value_heads": 2**13,
    "vocab_size": 2**25,
    "head_dim": 2**15,
    "num_experts": 2**15,
    "experts_per_token": 2**15,
}
"""The largest value of each size of ``model.architecture`` (all sizes are at least 1)."""

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LORA_TARGET = r"^[A-Za-z0-9_.\-]+$"
JOB_NAME = r"^[^/\s]+/[^/\s]+$"
"""namespace/name (labels metrics and logs)."""


class ConfigError(ValueError):
    """The config cannot be honoured; raised at start, before any GPU work.

    ``termination_log`` is where the config asked for the termination message when the config as a whole
    could not be read (None: the default path)."""

    def __init__(self, message: str, termination_log: str | None = None) -> None:
        super().__init__(message)
        self.termination_log = termination_log


# --- paths ---------------------------------------------------------------------------------------------


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("control characters (NUL, newline, ...) are not allowed")
    return text


def _absolute_path(path: str) -> str:
    """An absolute POSIX path that does not climb: the trainer runs wherever its pod starts it, so a
    relative path would depend on the working directory, and ``..`` could leave the job's volume."""
    _printable(path)
    parts = PurePosixPath(path).parts
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    if ".." in parts:
        raise ValueError(f"{path!r} contains `..`: paths must not climb out of their volume")
    return path


AbsolutePath = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH), AfterValidator(_absolute_path)]
"""An absolute path without ``..`` or control characters."""
Name = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_NAME_LENGTH), AfterValidator(_printable)]
"""A non-empty, printable, bounded string (a field name, a revision, a label)."""


def within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it, lexically (both absolute, without ``..``)."""
    candidate, base = PurePosixPath(path), PurePosixPath(root)
    return candidate == base or base in candidate.parents


def _model_name(name: str) -> str:
    """A Hub id (``org/name``) or an absolute local directory; never a relative path that climbs."""
    _printable(name)
    if name.startswith("/"):
        return _absolute_path(name)
    if ".." in PurePosixPath(name).parts or name.startswith("~"):
        raise ValueError(f"{name!r} is neither a Hub id nor an absolute directory")
    return name


# --- sections ------------------------------------------------------------------------------------------


def _shape(value: Any, handler: ValidatorFunctionWrapHandler) -> ModelShape:
    """ModelShape computes head_dim in its constructor: a zero head count must be an error, not a
    ZeroDivisionError out of the validator; without a headDim the heads must divide the width."""
    try:
        shape: ModelShape = handler(value)
    except ArithmeticError as error:
        raise ValueError(f"impossible sizes ({error})") from None
    head_dim_given = not isinstance(value, dict) or value.get("headDim", value.get("head_dim")) is not None
    if not head_dim_given and shape.hidden_size % shape.num_attention_heads:
        raise ValueError(
            f"hiddenSize ({shape.hidden_size}) is not divisible by numAttentionHeads ({shape.num_attention_heads}); "
            "set headDim"
        )
    return shape


class ModelConfig(ApiModel):
    name_or_path: Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH), AfterValidator(_model_name)]
    """Hub id or local directory given to from_pretrained."""
    random_init: Annotated[bool, Strict()] = False
    """Build the architecture with random weights instead of loading (smoke tests, examples)."""
    architecture: ModelShape | None = None
    """The model's shape (memfit.model_shape.ModelShape); required with randomInit."""
    revision: Name | None = None
    tokenizer: Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH)] | None = None
    """Hub id or local directory of the tokenizer when it is not the model's own (``name_or_path``); a
    randomInit model without one uses the built-in byte-level tokenizer."""
    token_env: Annotated[str, Strict(), Field(min_length=1, max_length=256)] = "HF_TOKEN"
    """Environment variable holding the Hub token (the token itself never appears in the config)."""

    @field_validator("architecture", mode="wrap")
    @classmethod
    def _constructible(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> ModelShape | None:
        if value is None:
            return None
        return _shape(value, handler)

    @field_validator("architecture")
    @classmethod
    def _sizes(cls, shape: ModelShape | None) -> ModelShape | None:
        if shape is None:
            return None
        for name, largest in ARCHITECTURE_BOUNDS.items():
            size = getattr(shape, name)
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= largest:
                raise ValueError(f"{name} must be an integer from 1 to {largest}, got {size!r}")
        if shape.num_attention_heads % shape.num_key_value_heads:
            raise ValueError(
                f"numAttentionHeads ({shape.num_attention_heads}) must be a multiple of numKeyValueHeads "
                f"({shape.num_key_value_heads})"
            )
        if shape.experts_per_token > shape.num_experts:
            raise ValueError("expertsPerToken cannot exceed numExperts")
        return shape

    @field_validator("token_env")
    @classmethod
    def _env_name(cls, name: str) -> str:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        return name

    @model_validator(mode="after")
    def _architecture_for_random_init(self) -> ModelConfig:
        if self.random_init and self.architecture is None:
            raise ValueError("model.randomInit needs model.architecture")
        return self


class ValidationConfig(ApiModel):
    fraction: Annotated[float, Strict(), Field(gt=0, le=0.5, allow_inf_nan=False)] | None = None
    """Share of the training records held out (by the seed)."""
    path: AbsolutePath | None = None
    """Validation records of their own (same format and fields as the training data)."""
    every_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] = 100

    @model_validator(mode="after")
    def _one_kind(self) -> ValidationConfig:
        if (self.fraction is None) == (self.path is None):
            raise ValueError("data.validation needs exactly one of fraction or path")
        return self


class DataConfig(ApiModel):
    path: AbsolutePath
    """A file or a directory of jsonl, parquet or arrow files."""
    format: DatasetFormat | None = None
    text_field: Name | None = None
    messages_field: Name | None = None
    prompt_field: Name | None = None
    completion_field: Name | None = None
    train_on: TrainOn = TrainOn.ASSISTANT
    """Chat: assistant turns only, or every token; prompt/completion: the completion only, or every token."""
    packing: Annotated[bool, Strict()] = True
    """Documents packed into full sequences with per-document attention and positions, or one per sequence."""
    validation: ValidationConfig | None = None
    streaming: Annotated[bool, Strict()] = False


class LoraConfig(ApiModel):
    rank: Annotated[int, Strict(), Field(ge=1, le=MAX_LORA_RANK)] = 16
    alpha: Annotated[float, Strict(), Field(gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False)] = 32.0
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.05
    target_modules: Annotated[
        list[Annotated[str, Strict(), Field(min_length=1, max_length=256, pattern=LORA_TARGET)]],
        Field(min_length=1, max_length=256),
    ] = Field(default_factory=lambda: ["all-linear"])

    @field_validator("target_modules")
    @classmethod
    def _all_linear_alone(cls, targets: list[str]) -> list[str]:
        if "all-linear" in targets and len(targets) > 1:
            raise ValueError("`all-linear` stands for every linear module: list it alone")
        return targets


class TrainingConfig(ApiModel):
    method: PlannedMethod
    sequence_length: Annotated[int, Strict(), Field(ge=1, le=MAX_SEQUENCE_LENGTH)]
    micro_batch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)]
    gradient_accumulation_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)]
    global_batch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_GLOBAL_BATCH)]
    epochs: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] | None = None
    max_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] | None = None
    learning_rate: Annotated[float, Strict(), Field(gt=0, le=MAX_LEARNING_RATE, allow_inf_nan=False)]
    warmup_ratio: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.03
    weight_decay: Annotated[float, Strict(), Field(ge=0, le=MAX_WEIGHT_DECAY, allow_inf_nan=False)] = 0.0
    max_grad_norm: Annotated[float, Strict(), Field(ge=0, le=MAX_GRAD_NORM, allow_inf_nan=False)] = 1.0
    """0: no gradient clipping (as DeepSpeed's ``gradient_clipping``; required by optimizer-in-backward)."""
    optimizer: Optimizer = Optimizer.ADAMW
    precision: PlannedPrecision
    gradient_checkpointing: Annotated[bool, Strict()] = False
    attention: Attention = Attention.SDPA
    chunked_loss: Annotated[bool, Strict()] = False
    """The LM head and the cross-entropy chunk by chunk (memfit_trainer.chunked_loss); ZeRO 0-2 only."""
    activation_offloading: Annotated[bool, Strict()] = False
    """Checkpointed layers' saved inputs wait in pinned host memory (memfit_trainer.activation_offload)."""
    master_weights: MasterWeights = MasterWeights.FP32
    """bf16: pure bf16 weights, gradients and optimizer states (no fp32 master copy)."""
    seed: Annotated[int, Strict(), Field(ge=0, le=MAX_SEED)] = 42
    checkpoint_every_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)] = 500
    keep_checkpoints: Annotated[int, Strict(), Field(ge=1, le=MAX_KEEP_CHECKPOINTS)] = 2
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _length(self) -> TrainingConfig:
        if (self.epochs is None) == (self.max_steps is None):
            raise ValueError("training needs exactly one of epochs and maxSteps")
        return self


NonNegativeBytes = Annotated[int, Strict(), Field(ge=0, le=MAX_BYTES)]


class PredictionConfig(ApiModel):
    """What the plan predicted, exported beside the measurements (all estimates)."""

    strategy: Name
    peak_allocated_bytes: NonNegativeBytes
    total_bytes: NonNegativeBytes
    gpu_memory_bytes: Annotated[int, Strict(), Field(ge=1, le=MAX_BYTES)]
    tokens_per_second: Annotated[float, Strict(), Field(ge=0, le=1e18, allow_inf_nan=False)]
    peak_flops: Annotated[float, Strict(), Field(gt=0, le=1e21, allow_inf_nan=False)] | None = None
    """Dense peak FLOP/s of one GPU in the planned precision (for MFU); None where unknown."""


class MetricsConfig(ApiModel):
    port: Annotated[int, Strict(), Field(ge=0, le=65535)] = 9400
    """Rank r serves /metrics on port + local rank (0: pick a free port, for tests)."""
    progress_file: AbsolutePath | None = None
    """Rank 0 writes its progress here as JSON after every step (the operator reads it)."""


class VolumesConfig(ApiModel):
    """Where the job's volumes are (mounted in the pod, or the local directories standing in for them): the
    roots its paths stay inside. The trainer refuses, before any work, a data path, output directory or
    model directory outside its volume, symlinks resolved."""

    model: AbsolutePath | None = None
    """The model volume (only when the weights come from one)."""
    data: AbsolutePath | None = None
    output: AbsolutePath | None = None


# --- the DeepSpeed section -----------------------------------------------------------------------------


class _DeepSpeedPart(BaseModel):
    """DeepSpeed's own snake_case keys; only those memfit renders (DeepSpeed ignores a misspelt key
    silently, so an unknown one is an error here)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


DsInt = Annotated[int, Strict(), Field(ge=1, le=MAX_BUCKET_ELEMENTS)]
DsBool = Annotated[bool, Strict()]


class DeepSpeedOffload(_DeepSpeedPart):
    device: Offload
    pin_memory: DsBool = False
    nvme_path: AbsolutePath | None = None

    @model_validator(mode="after")
    def _nvme_path(self) -> DeepSpeedOffload:
        if self.device == Offload.NVME and self.nvme_path is None:
            raise ValueError("device nvme needs nvme_path")
        return self


class DeepSpeedZero(_DeepSpeedPart):
    stage: Annotated[int, Strict(), Field(ge=0, le=3)] = 0
    overlap_comm: DsBool | None = None
    contiguous_gradients: DsBool | None = None
    reduce_bucket_size: DsInt | None = None
    allgather_bucket_size: DsInt | None = None
    stage3_prefetch_bucket_size: DsInt | None = None
    stage3_param_persistence_threshold: DsInt | None = None
    stage3_max_live_parameters: DsInt | None = None
    stage3_max_reuse_distance: DsInt | None = None
    stage3_gather_16bit_weights_on_model_save: DsBool | None = None
    offload_optimizer: DeepSpeedOffload | None = None
    offload_param: DeepSpeedOffload | None = None

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> DeepSpeedZero:
        if self.offload_optimizer is not None and self.offload_optimizer.device != Offload.NONE and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO (stage 1, 2 or 3), the stage is 0")
        if self.offload_param is not None and self.offload_param.device != Offload.NONE and self.stage != 3:
            raise ValueError(f"offload_param needs ZeRO stage 3, the stage is {self.stage}")
        return self


class DeepSpeedPrecision(_DeepSpeedPart):
    enabled: DsBool
    loss_scale: Annotated[float, Strict(), Field(ge=0, le=2.0**64, allow_inf_nan=False)] | None = None
    initial_scale_power: Annotated[int, Strict(), Field(ge=0, le=64)] | None = None
    hysteresis: Annotated[int, Strict(), Field(ge=1, le=2**20)] | None = None
    loss_scale_window: Annotated[int, Strict(), Field(ge=1, le=2**31)] | None = None
    min_loss_scale: Annotated[float, Strict(), Field(gt=0, le=2.0**64, allow_inf_nan=False)] | None = None
    bf16_master_weights_and_grads: DsBool | None = None
    """bf16 section only (training.masterWeights bf16, ZeRO 1-3): bf16 master partitions and gradients."""
    bf16_optimizer_states: DsBool | None = None
    """bf16 section only, with bf16_master_weights_and_grads: the optimizer's states stay in bf16 on the GPU."""

    @property
    def bf16_masters(self) -> bool:
        return bool(self.enabled and self.bf16_master_weights_and_grads)


class DeepSpeedOptimizerParams(_DeepSpeedPart):
    lr: Annotated[float, Strict(), Field(gt=0, le=MAX_LEARNING_RATE, allow_inf_nan=False)]
    betas: (
        Annotated[
            list[Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)]], Field(min_length=2, max_length=2)
        ]
        | None
    ) = None
    eps: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    weight_decay: Annotated[float, Strict(), Field(ge=0, le=MAX_WEIGHT_DECAY, allow_inf_nan=False)] = 0.0


DEEPSPEED_OPTIMIZER_TYPES: Final = {"adamw": Optimizer.ADAMW, "lion": Optimizer.LION}
"""The optimizers DeepSpeed builds from its config (memfit.render.deepspeed), by lower-cased type."""


class DeepSpeedOptimizer(_DeepSpeedPart):
    type: Annotated[str, Strict()]
    params: DeepSpeedOptimizerParams

    @field_validator("type")
    @classmethod
    def _known(cls, name: str) -> str:
        if name.lower() not in DEEPSPEED_OPTIMIZER_TYPES:
            raise ValueError(f"{name!r} is not an optimizer memfit has DeepSpeed build (AdamW, Lion)")
        return name


class DeepSpeedSection(_DeepSpeedPart):
    """The keys of ``TrainerConfig.deepspeed``, typed (the config keeps the dict DeepSpeed is given)."""

    train_batch_size: Annotated[int, Strict(), Field(ge=1, le=MAX_GLOBAL_BATCH)] | None = None
    train_micro_batch_size_per_gpu: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)] | None = None
    gradient_accumulation_steps: Annotated[int, Strict(), Field(ge=1, le=MAX_BATCH)] | None = None
    gradient_clipping: Annotated[float, Strict(), Field(ge=0, le=MAX_GRAD_NORM, allow_inf_nan=False)] | None = None
    steps_per_print: Annotated[int, Strict(), Field(ge=1, le=2**63 - 1)] | None = None
    wall_clock_breakdown: DsBool | None = None
    zero_optimization: DeepSpeedZero = Field(default_factory=DeepSpeedZero)
    bf16: DeepSpeedPrecision | None = None
    fp16: DeepSpeedPrecision | None = None
    optimizer: DeepSpeedOptimizer | None = None
    zero_allow_untested_optimizer: DsBool | None = None
    zero_force_ds_cpu_optimizer: DsBool | None = None

    @model_validator(mode="after")
    def _one_precision(self) -> DeepSpeedSection:
        if self.bf16 is not None and self.fp16 is not None and self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16 and fp16 are both enabled")
        return self

    @property
    def precision(self) -> Precision | None:
        """The precision the section enables (None: it enables none, DeepSpeed trains in fp32)."""
        if self.bf16 is not None and self.bf16.enabled:
            return Precision.BF16
        if self.fp16 is not None and self.fp16.enabled:
            return Precision.FP16
        return None


def precision_section(precision: Precision, master_weights: MasterWeights, zero_stage: int) -> dict[str, Any] | None:
    """DeepSpeed's ``bf16`` or ``fp16`` section (its key is the precision), or None where there is none.

    fp32 masters: DeepSpeed's mixed precision, the 16-bit weights and gradients with fp32 master weights, fp32
    gradient partitions and fp32 optimizer states (fp16 with dynamic loss scaling).

    bf16 masters (pure bf16; the numerics change: every update is rounded to bf16's 8-bit mantissa, so
    updates smaller than about 2^-8 of a weight are lost, and the moments are bf16 too):

    * ZeRO-1/2/3: ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``. Each rank keeps a bf16
      copy of its partition as the master, reduces gradients into a bf16 partition and gives the optimizer
      bf16 moments (``_configure_master_weights`` in DeepSpeed's ``base_optimizer.py`` picks the dtype).
    * ZeRO-0: no section at all. DeepSpeed refuses bf16 masters without ZeRO, and its bf16 mode would wrap
      the optimizer in fp32 masters; without a section its engine casts nothing and hands the optimizer the
      model's own bf16 parameters (the trainer builds the model in bf16), so the weights are the masters.
      The engine still all-reduces the gradients and clips them (``clip_fp32_gradients``, whatever their
      dtype); there is no loss scaling, which bf16 does not need."""
    if precision == Precision.FP16:
        return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}
    if precision != Precision.BF16:
        return None
    if master_weights != MasterWeights.BF16:
        return {"enabled": True}
    if zero_stage == 0:
        return None
    return {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _describe_part(error: ValidationError) -> str:
    lines = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(section)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "not a key memfit renders (DeepSpeed would ignore a misspelt key silently)"
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def deepspeed_section(deepspeed: dict[str, Any]) -> DeepSpeedSection:
    """The typed view of a config's ``deepspeed`` dict (validated when the config was)."""
    return DeepSpeedSection.model_validate(deepspeed)


def _master_weights_problems(ds: DeepSpeedSection, master_weights: MasterWeights) -> list[str]:
    """Whether the precision section keeps the master weights that training.masterWeights names (see
    :func:`precision_section`: an absent section is filled in by the trainer from that function)."""
    problems = []
    if ds.fp16 is not None and (
        ds.fp16.bf16_master_weights_and_grads is not None or ds.fp16.bf16_optimizer_states is not None
    ):
        problems.append("deepspeed.fp16 cannot hold bf16_master_weights_and_grads or bf16_optimizer_states")
    bf16 = ds.bf16
    if bf16 is not None and bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        problems.append("deepspeed.bf16.bf16_optimizer_states needs bf16_master_weights_and_grads")
    stage = ds.zero_optimization.stage
    bf16_masters = bf16 is not None and bf16.bf16_masters
    if master_weights == MasterWeights.FP32:
        if bf16_masters:
            problems.append("deepspeed.bf16 keeps bf16 master weights but training.masterWeights is fp32")
        return problems
    if stage == 0 and bf16 is not None and bf16.enabled:
        problems.append(
            "training.masterWeights bf16 at ZeRO-0 trains the bf16 weights themselves: deepspeed.bf16 must be "
            "absent or disabled (its mixed precision would keep fp32 masters; DeepSpeed's own bf16 masters need "
            "ZeRO 1-3)"
        )
    if stage > 0 and bf16 is not None and not (bf16_masters and bf16.bf16_optimizer_states):
        problems.append(
            "training.masterWeights bf16 needs deepspeed.bf16.bf16_master_weights_and_grads and "
            "bf16_optimizer_states true (DeepSpeed would keep fp32 masters, or refuse bf16 ones on the GPU)"
        )
    return problems


# --- the config ----------------------------------------------------------------------------------------


class Fsdp2Config(ApiModel):
    """How the FSDP2 engine shards the model (``torch.distributed.fsdp.fully_shard`` on every decoder layer and
    the root)."""

    reshard_after_forward: Annotated[bool, Strict()] = True
    """True: each layer's parameters are resharded after its forward and gathered again for the backward (ZeRO-3
    like); False: kept gathered until the backward (ZeRO-2 like)."""
    cpu_offload: Annotated[bool, Strict()] = False
    """CPUOffloadPolicy: sharded parameters, gradients and optimizer states in (pinned) host memory, the
    optimizer step on the CPU."""
    reduce_dtype: Literal[Precision.FP32, Precision.BF16] = Precision.FP32
    """Gradient reduce-scatter dtype (MixedPrecisionPolicy.reduce_dtype): fp32 with fp32 masters."""
    optimizer_in_backward: Annotated[bool, Strict()] = False
    """One optimizer per sharded parameter, stepped from its post-accumulate-grad hook as soon as its
    gradient is reduced (the gradient then freed): accumulation 1, no clipping."""


class TrainerConfig(ApiModel):
    """Everything one training run needs."""

    version: Literal[1] = CONFIG_VERSION
    job: Annotated[str, Strict(), Field(min_length=3, max_length=320, pattern=JOB_NAME)]
    """namespace/name of the FineTuneJob (labels metrics and logs)."""
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    output_dir: AbsolutePath
    """Checkpoints go to outputDir/checkpoints, the final model or adapter to outputDir/final."""
    engine: Engine = Engine.DEEPSPEED
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    """The DeepSpeed config, exactly as `memfit plan --emit-ds-config` renders it (see DeepSpeedSection); empty
    on the fsdp2 engine."""
    fsdp2: Fsdp2Config | None = None
    """The FSDP2 engine's settings (only, and always, with engine fsdp2)."""
    prediction: PredictionConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    termination_log: AbsolutePath = "/dev/termination-log"
    volumes: VolumesConfig | None = None
    """The roots of data.path, outputDir and a model directory (None: unknown, nothing is checked)."""

    @field_validator("version", mode="before")
    @classmethod
    def _integer_version(cls, version: Any) -> Any:
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be the integer {CONFIG_VERSION}, got {version!r}")
        return version

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed_keys(cls, deepspeed: dict[str, Any]) -> dict[str, Any]:
        try:
            deepspeed_section(deepspeed)
        except ValidationError as error:
            raise ValueError(_describe_part(error)) from None
        return deepspeed

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        problems = self._batch_problems() + self._engine_problems() + self._volume_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _batch_problems(self) -> list[str]:
        t = self.training
        if t.global_batch_size % (t.micro_batch_size * t.gradient_accumulation_steps):
            return ["training.globalBatchSize is not a multiple of microBatchSize x gradientAccumulationSteps"]
        return []

    def _engine_problems(self) -> list[str]:
        if self.engine == Engine.DEEPSPEED:
            if self.fsdp2 is not None:
                return ["fsdp2 settings are given, but engine is deepspeed"]
            if "deepspeed" not in self.model_fields_set:  # it defaults to {} for fsdp2 only: given, as before
                return ["engine deepspeed needs its deepspeed section"]
            return self._deepspeed_problems()
        problems = []
        if self.deepspeed:
            problems.append("engine fsdp2 takes no deepspeed section")
        if self.fsdp2 is None:
            problems.append("engine fsdp2 needs its fsdp2 settings")
        t = self.training
        stage = 3 if self.fsdp2 is None or self.fsdp2.reshard_after_forward else 2
        offload = Offload.CPU if self.fsdp2 is not None and self.fsdp2.cpu_offload else Offload.NONE
        problems += knob_conflicts(
            Knobs(
                method=t.method,
                precision=t.precision,
                zero_stage=stage,
                offload_optimizer=offload,
                offload_parameters=offload,
                optimizer=t.optimizer,
                chunked_loss=t.chunked_loss,
                gradient_checkpointing=t.gradient_checkpointing,
                activation_offloading=t.activation_offloading,
                master_weights=t.master_weights,
                engine=self.engine,
                optimizer_in_backward=self.fsdp2.optimizer_in_backward if self.fsdp2 else None,
                gradient_accumulation_steps=t.gradient_accumulation_steps,
                clips_gradients=t.max_grad_norm > 0,
            )
        )
        return problems

    def _deepspeed_problems(self) -> list[str]:
        t, ds = self.training, deepspeed_section(self.deepspeed)
        problems = []
        for key, value, name in (
            ("train_micro_batch_size_per_gpu", t.micro_batch_size, "training.microBatchSize"),
            ("gradient_accumulation_steps", t.gradient_accumulation_steps, "training.gradientAccumulationSteps"),
            ("train_batch_size", t.global_batch_size, "training.globalBatchSize"),
        ):
            given = getattr(ds, key)
            if given is not None and given != value:
                problems.append(f"deepspeed.{key} ({given}) differs from {name} ({value})")
        if ds.gradient_clipping is not None and not math.isclose(ds.gradient_clipping, t.max_grad_norm):
            problems.append(
                f"deepspeed.gradient_clipping ({ds.gradient_clipping}) differs from training.maxGradNorm "
                f"({t.max_grad_norm})"
            )
        enabled = ds.precision
        if enabled is not None and enabled != t.precision:
            problems.append(f"deepspeed enables {enabled} but training.precision is {t.precision}")
        zero = ds.zero_optimization
        problems += _master_weights_problems(ds, t.master_weights)
        offloads_optimizer = zero.offload_optimizer is not None and zero.offload_optimizer.device != Offload.NONE
        offloads_params = zero.offload_param is not None and zero.offload_param.device != Offload.NONE
        if t.method == Method.QLORA and (zero.stage == 3 or offloads_params):
            problems.append("qlora's 4-bit weights cannot be partitioned or offloaded (ZeRO-3, offload_param)")
        if t.optimizer in EIGHT_BIT_OPTIMIZERS and offloads_optimizer:
            problems.append(f"{t.optimizer} keeps its 8-bit states on the GPU: it cannot be offloaded")
        if t.chunked_loss and zero.stage == 3:
            problems.append("training.chunkedLoss reads the LM head's weight whole: it cannot run under ZeRO-3")
        problems += knob_conflicts(  # the rules of the techniques, as the planner applies them
            Knobs(
                precision=t.precision,
                offload_optimizer=Offload.CPU if offloads_optimizer else Offload.NONE,
                gradient_checkpointing=t.gradient_checkpointing,
                activation_offloading=t.activation_offloading,
                master_weights=t.master_weights,
            )
        )
        if ds.optimizer is not None:
            built = DEEPSPEED_OPTIMIZER_TYPES[ds.optimizer.type.lower()]
            if built != t.optimizer:
                problems.append(f"deepspeed.optimizer is {ds.optimizer.type} but training.optimizer is {t.optimizer}")
            if not math.isclose(ds.optimizer.params.lr, t.learning_rate):
                problems.append(
                    f"deepspeed.optimizer.params.lr ({ds.optimizer.params.lr}) differs from training.learningRate "
                    f"({t.learning_rate})"
                )
            if not math.isclose(ds.optimizer.params.weight_decay, t.weight_decay, abs_tol=1e-12):
                problems.append(
                    f"deepspeed.optimizer.params.weight_decay ({ds.optimizer.params.weight_decay}) differs from "
                    f"training.weightDecay ({t.weight_decay})"
                )
        return problems

    def _volume_problems(self) -> list[str]:
        volumes = self.volumes
        if volumes is None:
            return []
        problems = []
        paths = [("data.path", self.data.path, "data", volumes.data), ("outputDir", self.output_dir, "output",
                 volumes.output)]  # fmt: skip
        if volumes.model is not None:
            paths.append(("model.nameOrPath", self.model.name_or_path, "model", volumes.model))
        for name, path, volume, root in paths:
            if root is not None and not within(path, root):
                problems.append(f"{name} {path!r} is outside the {volume} volume {root!r}")
        return problems

    @property
    def world_size(self) -> int:
        """Ranks the plan was made for (global batch = micro-batch x accumulation x ranks)."""
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.training.gradient_accumulation_steps
        )

    @property
    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage, or the one fsdp2's sharding is like (3: resharded after forward, else 2)."""
        if self.fsdp2 is not None:
            return 3 if self.fsdp2.reshard_after_forward else 2
        return deepspeed_section(self.deepspeed).zero_optimization.stage

    @property
    def layout(self) -> CheckpointLayout:
        """How this run's checkpoints are sharded (memfit.contract.layout)."""
        training = self.training
        return CheckpointLayout.of_run(training.method, training.precision, self.zero_stage, self.world_size,
                                       training.master_weights, self.engine)  # fmt: skip

    @property
    def checkpoint_dir(self) -> Path:
        """One directory per layout: after a re-plan to another layout (say ZeRO-2 to ZeRO-3 after an
        out-of-memory failure) the run converts the other layout's newest checkpoint where a conversion exists
        (memfit.contract.layout ``converts_to``), else starts from the weights, instead of failing on shards it
        cannot load; the first layout's checkpoints stay, and a later return to it resumes them."""
        return Path(self.output_dir) / "checkpoints" / self.layout.directory_name

    @property
    def final_dir(self) -> Path:
        return Path(self.output_dir) / "final"

    def to_json(self) -> str:
        return json.dumps(self.to_api(), indent=2) + "\n"


# --- reading -------------------------------------------------------------------------------------------


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"the key {key!r} appears twice in one object")
        document[key] = value
    return document


def _depth(document: Any) -> int:
    """How deeply objects and arrays nest (without recursion: the document may be hostile)."""
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_CONFIG_DEPTH:
            break
        pending.extend((child, depth + 1) for child in children)
    return deepest


def _read_text(path: str | Path) -> str:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    except ValueError as error:  # a path with a NUL byte
        raise ConfigError(f"{path!r}: cannot read: {error}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes, not a trainer config")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 1]!r})"
        ) from None


def _parse(path: str | Path, text: str) -> dict[str, Any]:
    try:
        document = json.loads(text, parse_float=_finite, parse_constant=_not_a_number, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON: {error}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a trainer config: JSON nested too deeply") from None
    except ValueError as error:  # NaN, Infinity, 1e999, a duplicate key, an integer of thousands of digits
        raise ConfigError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: not a trainer config: expected a JSON object, got {type(document).__name__}")
    if _depth(document) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: not a trainer config: JSON nested deeper than {MAX_CONFIG_DEPTH} levels")
    return document


def _termination_log_of(document: dict[str, Any]) -> str | None:
    """The config's terminationLog, if it is usable although the rest of the config is not."""
    value = document.get("terminationLog")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH_LENGTH:
        return None
    try:
        return _absolute_path(value)
    except ValueError:
        return None


def load_config(path: str | Path) -> TrainerConfig:
    """Read and validate a config file; every problem becomes one ConfigError line.

    JSON types are strict (``"8"`` is not a number, ``8.0`` not an integer, ``true`` neither); NaN,
    infinities, duplicate keys, non-UTF-8 bytes, files over ``MAX_CONFIG_BYTES`` and documents nested deeper
    than ``MAX_CONFIG_DEPTH`` are refused before validation."""
    text = _read_text(path)
    document = _parse(path, text)
    try:
        return TrainerConfig.model_validate_json(text, strict=True)
    except ValidationError as error:
        raise ConfigError(f"{path}: {describe_validation_error(error)}", _termination_log_of(document)) from None
