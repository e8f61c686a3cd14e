"""The trainer's config contract: the JSON the operator writes into a ConfigMap and ``memfit-train
--config FILE`` reads.

The trainer owns it (the contract imports only pydantic and memfit's core, never torch, so the operator
can render it). Everything the trainer does is decided here; the environment adds only what Kubernetes
or torchrun know (rank, world size, master address, the Hub token's variable).

The sections check their own fields (memfit.contract.sections, .engines, .paths); :class:`TrainerConfig`
checks that they agree: batch sizes, an engine section that agrees with ``training``, paths inside the job's
volumes (``volumes``). memfit.contract.reader reads a file of it, hostile or not, into one ConfigError line.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, Strict, field_validator, model_validator

from memfit.api.base import ApiModel
from memfit.api.knobs import Knobs, conflicts, knobs_of
from memfit.api.vocabulary import EIGHT_BIT_OPTIMIZERS, Devices, Method, Offload
from memfit.contract.engines import DEEPSPEED_OPTIMIZER_TYPES, DeepSpeedEngineSection, EngineSection
from memfit.contract.layout import CheckpointLayout
from memfit.contract.paths import AbsolutePath, within
from memfit.contract.sections import (
    DataConfig,
    MetricsConfig,
    ModelConfig,
    PredictionConfig,
    TrainingConfig,
    VolumesConfig,
)
from memfit.model_facts import model_facts

CONFIG_VERSION: Final = 1
JOB_NAME = r"^[^/\s]+/[^/\s]+$"
"""namespace/name (labels metrics and logs)."""
SAID_IN_DEEPSPEED_TERMS: Final = ("method", "zero_stage", "offload_parameters", "optimizer", "chunked_loss")
"""The knobs whose rules the DeepSpeed engine's checks state in their own terms (ZeRO-3, offload_param, the 8-bit
optimizer's offload, qlora's precision in the trainer's preflight): left undecided in the knobs checked beside
them, so that each problem is said once, in the words it always had."""


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
    engine: EngineSection
    """What shards and steps the model (DeepSpeed or FSDP2, by ``kind``), with its settings."""
    prediction: PredictionConfig | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    termination_log: AbsolutePath = "/dev/termination-log"
    volumes: VolumesConfig | None = None
    """The roots of data.path, outputDir and a model directory (None: unknown, nothing is checked)."""
    devices: Devices | None = None
    """What the plan's ranks compute on: with ``cuda`` the trainer stops at start-up (ConfigError) where it sees
    no CUDA device, rather than training a GPU plan on the CPU (None: whatever is there)."""

    @field_validator("version", mode="before")
    @classmethod
    def _integer_version(cls, version: Any) -> Any:
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be the integer {CONFIG_VERSION}, got {version!r}")
        return version

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
        if isinstance(self.engine, DeepSpeedEngineSection):
            return self._deepspeed_problems(self.engine)
        return conflicts(self.knobs())

    def _deepspeed_problems(self, section: DeepSpeedEngineSection) -> list[str]:
        t, ds = self.training, section.settings
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
        problems += section.master_weights_problems(t.master_weights)
        if t.method == Method.QLORA and (section.zero_stage == 3 or section.offload_parameters != Offload.NONE):
            problems.append("qlora's 4-bit weights cannot be partitioned or offloaded (ZeRO-3, offload_param)")
        if t.optimizer in EIGHT_BIT_OPTIMIZERS and section.offload_optimizer != Offload.NONE:
            problems.append(f"{t.optimizer} keeps its 8-bit states on the GPU: it cannot be offloaded")
        problems += conflicts(replace(self.knobs(), **dict.fromkeys(SAID_IN_DEEPSPEED_TERMS)))  # the techniques' rules
        if ds.optimizer is not None and section.optimizer_in_backward:
            problems.append(
                "deepspeed.optimizer must be absent with optimizerInBackward (memfit builds one per parameter)"
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

    def knobs(self) -> Knobs:
        """The strategy this config runs, as the rules of memfit.api.knobs read it."""
        engine = self.engine
        return knobs_of(
            self.training,  # the training section holds the rest under the knobs' own names
            engine=engine.kind,
            zero_stage=engine.zero_stage,
            offload_optimizer=engine.offload_optimizer,
            offload_parameters=engine.offload_parameters,
            optimizer_in_backward=engine.optimizer_in_backward,
            clips_gradients=self.training.max_grad_norm > 0,
            # The model's facts where the config types its sizes (a profiled model's are the planner's to check).
            **(model_facts(self.model.architecture) if self.model.architecture is not None else {}),
        )

    @property
    def world_size(self) -> int:
        """Ranks the plan was made for (global batch = micro-batch x accumulation x data-parallel ranks, and
        each data-parallel rank is a group of ``sequence_parallel`` ranks sharing its sequences)."""
        training = self.training
        data_parallel = training.global_batch_size // (training.micro_batch_size * training.gradient_accumulation_steps)
        return data_parallel * training.sequence_parallel

    @property
    def layout(self) -> CheckpointLayout:
        """How this run's checkpoints are sharded (memfit.contract.layout)."""
        training = self.training
        return CheckpointLayout.of_run(training.method, training.precision, self.engine.zero_stage, self.world_size,
                                       training.master_weights, self.engine.kind)  # fmt: skip

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
