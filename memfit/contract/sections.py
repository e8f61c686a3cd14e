"""The trainer config's sections other than the engine: the model, the data, the training, what the plan
predicted, the metrics and the volumes; each checks its own fields (strict types, documented bounds)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

from pydantic import Field, Strict, ValidatorFunctionWrapHandler, field_validator, model_validator

from memfit.api.base import ApiModel
from memfit.api.vocabulary import (
    ALL_LINEAR,
    DEFAULT_MAX_RECORD_MIB,
    MAX_RECORD_MIB,
    Attention,
    DatasetFormat,
    MasterWeights,
    OnBadRecord,
    Optimizer,
    PlannedMethod,
    PlannedPrecision,
    TrainOn,
)
from memfit.contract.paths import MAX_PATH_LENGTH, AbsolutePath, ModelName, Name
from memfit.model_shape import ModelShape

# Bounds: each at least the FineTuneJob API's own (memfit.api), so every config the renderer makes is
# valid, and small enough that the trainer's arithmetic stays finite and its loops bounded.
MAX_SEQUENCE_LENGTH: Final = 4 * 1024 * 1024
MAX_BATCH: Final = 1024 * 1024
"""Micro-batch size and gradient accumulation steps."""
MAX_SEQUENCE_PARALLEL: Final = 64
"""Ranks one sequence may be split over (a node or a few: the all-to-alls cross them every layer)."""
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
    name_or_path: ModelName
    """Hub id or local directory given to from_pretrained."""
    random_init: Annotated[bool, Strict()] = False
    """Build the architecture with random weights instead of loading (smoke tests, examples)."""
    architecture: ModelShape | None = None
    """The model's shape (memfit.model_shape.ModelShape) the plan was made for; required with randomInit.
    Optional for a model directory or Hub id (families without a typed shape): without it the loaded model
    is compared with no planned shape (memfit.contract.model_match), and its own config builds it."""
    planned_fields: (
        dict[
            Annotated[str, Strict(), Field(min_length=1, max_length=64)],
            Annotated[bool, Strict()] | Annotated[int, Strict()] | Annotated[str, Strict(), Field(max_length=256)],
        ]
        | None
    ) = Field(default=None, max_length=32)
    """config.json fields of the model the plan profiled (``model_type``, the sizes): the trainer refuses a
    model that states any of them otherwise (memfit.contract.model_match). None for typed sizes
    (``architecture``)."""
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
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    """A bad record stops the run naming its file, line and field, or is skipped and counted."""
    max_record_mib: Annotated[int, Strict(), Field(ge=1, le=MAX_RECORD_MIB)] = DEFAULT_MAX_RECORD_MIB
    changed: Annotated[bool, Strict()] = False
    """The data changed on purpose: resume on it although the checkpoint's fingerprint is another."""


class LoraConfig(ApiModel):
    rank: Annotated[int, Strict(), Field(ge=1, le=MAX_LORA_RANK)] = 16
    alpha: Annotated[float, Strict(), Field(gt=0, le=MAX_LORA_ALPHA, allow_inf_nan=False)] = 32.0
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.05
    target_modules: Annotated[
        list[Annotated[str, Strict(), Field(min_length=1, max_length=256, pattern=LORA_TARGET)]],
        Field(min_length=1, max_length=256),
    ] = Field(default_factory=lambda: [ALL_LINEAR])

    @field_validator("target_modules")
    @classmethod
    def _all_linear_alone(cls, targets: list[str]) -> list[str]:
        if ALL_LINEAR in targets and len(targets) > 1:
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
    """The LM head and the cross-entropy chunk by chunk (memfit_trainer.chunked_loss)."""
    activation_offloading: Annotated[bool, Strict()] = False
    """Checkpointed layers' saved inputs wait in pinned host memory (memfit_trainer.activation_offload)."""
    master_weights: MasterWeights = MasterWeights.FP32
    """bf16: pure bf16 weights, gradients and optimizer states (no fp32 master copy)."""
    sequence_parallel: Annotated[int, Strict(), Field(ge=1, le=MAX_SEQUENCE_PARALLEL)] = 1
    """Ranks one sequence is split over (memfit_trainer.sequence_parallel); 1: none."""
    tiled_mlp: Annotated[bool, Strict()] = False
    """Each MLP runs tile by tile along the sequence, recomputed in backward (memfit_trainer.tiled_mlp)."""
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
    """Rank 0 writes its progress here as JSON after every step (for ``memfit run --local``; the operator
    scrapes /metrics instead)."""


class VolumesConfig(ApiModel):
    """Where the job's volumes are (mounted in the pod, or the local directories standing in for them): the
    roots its paths stay inside. The trainer refuses, before any work, a data path, output directory or
    model directory outside its volume, symlinks resolved."""

    model: AbsolutePath | None = None
    """The model volume (only when the weights come from one)."""
    data: AbsolutePath | None = None
    output: AbsolutePath | None = None
