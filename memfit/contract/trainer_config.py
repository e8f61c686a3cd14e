"""The trainer's config contract: the JSON the operator writes into a ConfigMap and ``memfit-train
--config FILE`` reads.

The trainer owns it (this module imports only pydantic and memfit's core, never torch, so the operator
can render it). Everything the trainer does is decided here; the environment adds only what Kubernetes
or torchrun know (rank, world size, master address, the Hub token's variable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import Field, PositiveInt, ValidationError, model_validator

from memfit.api.base import ApiModel
from memfit.api.loading import describe_validation_error
from memfit.api.vocabulary import Attention, DatasetFormat, Optimizer, PlannedMethod, PlannedPrecision
from memfit.contract.layout import CheckpointLayout
from memfit.model_shape import ModelShape

CONFIG_VERSION: Final = 1


class ConfigError(ValueError):
    """The config cannot be honoured; raised at start, before any GPU work."""


class ModelConfig(ApiModel):
    name_or_path: str
    """Hub id or local directory given to from_pretrained."""
    random_init: bool = False
    """Build the architecture with random weights instead of loading (smoke tests, examples)."""
    architecture: ModelShape | None = None
    """The model's shape (memfit.model_shape.ModelShape); required with randomInit."""
    revision: str | None = None
    token_env: str = "HF_TOKEN"
    """Environment variable holding the Hub token (the token itself never appears in the config)."""

    @model_validator(mode="after")
    def _architecture_for_random_init(self) -> ModelConfig:
        if self.random_init and self.architecture is None:
            raise ValueError("model.randomInit needs model.architecture")
        return self


class DataConfig(ApiModel):
    path: str
    """A file or a directory of jsonl, parquet or arrow files."""
    format: DatasetFormat | None = None
    text_field: str | None = None
    messages_field: str | None = None
    streaming: bool = False


class LoraConfig(ApiModel):
    rank: PositiveInt = 16
    alpha: float = 32.0
    dropout: float = Field(default=0.05, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])


class TrainingConfig(ApiModel):
    method: PlannedMethod
    sequence_length: PositiveInt
    micro_batch_size: PositiveInt
    gradient_accumulation_steps: PositiveInt
    global_batch_size: PositiveInt
    epochs: PositiveInt | None = None
    max_steps: PositiveInt | None = None
    learning_rate: float = Field(gt=0)
    warmup_ratio: float = Field(default=0.03, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    optimizer: Optimizer = Optimizer.ADAMW
    precision: PlannedPrecision
    gradient_checkpointing: bool = False
    attention: Attention = Attention.SDPA
    seed: int = 42
    checkpoint_every_steps: PositiveInt = 500
    keep_checkpoints: PositiveInt = 2
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _length(self) -> TrainingConfig:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("training needs epochs or maxSteps")
        return self


class PredictionConfig(ApiModel):
    """What the plan predicted, exported beside the measurements (all estimates)."""

    strategy: str
    peak_allocated_bytes: int
    total_bytes: int
    gpu_memory_bytes: int
    tokens_per_second: float
    peak_flops: float | None = None
    """Dense peak FLOP/s of one GPU in the planned precision (for MFU); None where unknown."""


class MetricsConfig(ApiModel):
    port: int = Field(default=9400, ge=0, le=65535)
    """Rank r serves /metrics on port + local rank (0: pick a free port, for tests)."""
    progress_file: str | None = None
    """Rank 0 writes its progress here as JSON after every step (the operator reads it)."""


class TrainerConfig(ApiModel):
    """Everything one training run needs."""

    version: Literal[1] = CONFIG_VERSION
    job: str
    """namespace/name of the FineTuneJob (labels metrics and logs)."""
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    output_dir: str
    """Checkpoints go to outputDir/checkpoints, the final model or adapter to outputDir/final."""
    deepspeed: dict[str, Any]
    """The DeepSpeed config, exactly as `memfit plan --emit-ds-config` renders it."""
    prediction: PredictionConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    termination_log: str = "/dev/termination-log"

    @model_validator(mode="after")
    def _consistent_batches(self) -> TrainerConfig:
        t, ds = self.training, self.deepspeed
        if ds.get("train_micro_batch_size_per_gpu", t.micro_batch_size) != t.micro_batch_size:
            raise ValueError("deepspeed.train_micro_batch_size_per_gpu differs from training.microBatchSize")
        if ds.get("gradient_accumulation_steps", t.gradient_accumulation_steps) != t.gradient_accumulation_steps:
            raise ValueError("deepspeed.gradient_accumulation_steps differs from training.gradientAccumulationSteps")
        if t.global_batch_size % (t.micro_batch_size * t.gradient_accumulation_steps):
            raise ValueError("training.globalBatchSize is not a multiple of microBatchSize x gradientAccumulationSteps")
        return self

    @property
    def world_size(self) -> int:
        """Ranks the plan was made for (global batch = micro-batch x accumulation x ranks)."""
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.training.gradient_accumulation_steps
        )

    @property
    def layout(self) -> CheckpointLayout:
        """How this run's checkpoints are sharded (memfit.contract.layout)."""
        zero = int(self.deepspeed.get("zero_optimization", {}).get("stage", 0))
        return CheckpointLayout(self.training.method, self.training.precision, zero, self.world_size)

    @property
    def checkpoint_dir(self) -> Path:
        """One directory per layout: after a re-plan to another layout (say ZeRO-2 to ZeRO-3 after an
        out-of-memory failure) the run starts from the weights instead of failing on shards it cannot
        load, and a later return to the first layout resumes its checkpoints."""
        return Path(self.output_dir) / "checkpoints" / self.layout.directory_name

    @property
    def final_dir(self) -> Path:
        return Path(self.output_dir) / "final"

    def to_json(self) -> str:
        return json.dumps(self.to_api(), indent=2) + "\n"


def load_config(path: str | Path) -> TrainerConfig:
    """Read and validate a config file; every problem becomes one ConfigError line."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON: {error}") from None
    try:
        return TrainerConfig.model_validate(document)
    except ValidationError as error:
        raise ConfigError(f"{path}: {describe_validation_error(error)}") from None
