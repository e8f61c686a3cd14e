"""Render the trainer's config (``memfit.contract.trainer_config.TrainerConfig``) for a job and its plan.

The operator puts the result in the job's ConfigMap; ``memfit run --local`` writes it to a file. Paths
are where the job's volumes are mounted (in the pod, or the local directories standing in for them).

Every path stays inside its volume: :func:`inside` refuses a path that climbs out (``..``) whatever the job
object says (the API refuses such paths too, but a job built without validation must not get around it), and
the config names the volumes (``volumes``) so that the trainer can refuse a path a symlink leads out of.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from memfit.api.finetunejob import DatasetSpec, FineTuneJob, ModelSpec
from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Devices, Engine
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.paths import MAX_PATH_LENGTH
from memfit.contract.sections import (
    DataConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    PredictionConfig,
    TrainingConfig,
    ValidationConfig,
    VolumesConfig,
)
from memfit.contract.trainer_config import TrainerConfig
from memfit.planned_model import PlannedModel, lora_dropout
from memfit.render.deepspeed import deepspeed_config, default_learning_rate
from memfit.render.fsdp2 import fsdp2_config


@dataclass(frozen=True)
class Mounts:
    """Where the job's volumes are: the roots the sources' ``path`` fields are relative to."""

    model: str | None
    data: str
    output: str


POD_MOUNTS = Mounts(model="/mnt/model", data="/mnt/data", output="/mnt/output")
"""The trainer pods' mount points (the operator's pod template mounts the PVCs there)."""


class PathOutsideVolumeError(ValueError):
    """A path of the job would lead outside its volume (or is not a path at all)."""


def inside(root: str, path: str | None) -> str:
    """``path`` inside the volume mounted at ``root``: relative to the volume's root, where a leading ``/``
    is that root too (as in the API). A path that climbs (``..``) or holds control characters is refused,
    so the result always lies under ``root``."""
    if not isinstance(root, str) or not root.startswith("/") or ".." in PurePosixPath(root).parts:
        raise PathOutsideVolumeError(f"volume root {root!r} is not an absolute path without `..`")
    if path is not None and not isinstance(path, str):
        raise PathOutsideVolumeError(f"path {path!r} is not a string")
    relative = path or ""
    if not relative.isprintable():
        raise PathOutsideVolumeError(f"path {relative!r} holds control characters")
    parts = PurePosixPath(relative.lstrip("/")).parts
    if ".." in parts:
        raise PathOutsideVolumeError(f"path {relative!r} climbs out of its volume (`..`)")
    joined = str(PurePosixPath(root).joinpath(*parts))
    if len(joined) > MAX_PATH_LENGTH:
        raise PathOutsideVolumeError(f"path {joined[:80]!r}... is longer than {MAX_PATH_LENGTH} characters")
    return joined


def _on_claim(model: ModelSpec) -> bool:
    return model.source is not None and model.source.pvc is not None


def model_config(
    model: ModelSpec, model_volume: str | None, planned_fields: dict[str, bool | int | str] | None = None
) -> ModelConfig:
    """The model as the trainer loads it: weights and tokenizer inside the model volume when they are on a
    claim (mounted at ``model_volume``), else the Hub ids as given; planned for the typed sizes, or for the
    ``planned_fields`` of a profile."""
    name_or_path, tokenizer, typed = model.name, model.tokenizer, model.architecture
    if _on_claim(model) and model_volume is not None:
        assert model.source is not None  # _on_claim
        name_or_path = inside(model_volume, model.source.path)
        tokenizer = inside(model_volume, tokenizer) if tokenizer is not None else None
    return ModelConfig(
        name_or_path=name_or_path,
        random_init=model.random_init,
        architecture=typed.shape() if typed is not None and typed.typed else None,
        planned_fields=planned_fields,
        tokenizer=tokenizer,
    )


def data_config(dataset: DatasetSpec, data_volume: str, packing: bool) -> DataConfig:
    """The dataset as the trainer reads it: paths inside the data volume (validation files on the same one);
    ``packing``: the plan's (the dataset's, or decided for the model where it says none)."""
    validation = dataset.validation
    return DataConfig(
        path=inside(data_volume, dataset.source.path),
        format=dataset.format,
        text_field=dataset.text_field,
        messages_field=dataset.messages_field,
        prompt_field=dataset.prompt_field,
        completion_field=dataset.completion_field,
        train_on=dataset.train_on,
        packing=packing,
        validation=None
        if validation is None
        else ValidationConfig(
            fraction=validation.fraction,
            path=inside(data_volume, validation.path) if validation.path is not None else None,
            every_steps=validation.every_steps,
        ),
        streaming=dataset.streaming,
        on_bad_record=dataset.on_bad_record,
        max_record_mib=dataset.max_record_mib,
        changed=dataset.changed,
    )


def render_trainer_config(
    job: FineTuneJob,
    plan: PlanCandidate,
    peak_flops: float | None = None,
    mounts: Mounts = POD_MOUNTS,
    metrics: MetricsConfig | None = None,
    termination_log: str = "/dev/termination-log",
    planned: PlannedModel | None = None,
    devices: Devices | None = None,
) -> TrainerConfig:
    """The trainer's config for running ``plan``; ``planned``: the profiled model the plan was made for;
    ``devices``: what the plan's pool computes on (the trainer checks it sees them)."""
    spec, strategy = job.spec, plan.strategy
    planned = spec.planned_model(planned)
    model = model_config(spec.model, mounts.model, planned.planned_fields())
    model_volume = mounts.model if _on_claim(spec.model) else None
    training = spec.training
    memory = plan.memory.per_gpu
    dropout = lora_dropout(planned, tuple(spec.lora.target_modules), spec.lora.dropout)
    return TrainerConfig(
        job=f"{job.metadata.namespace or 'default'}/{job.metadata.name}",
        model=model,
        data=data_config(spec.dataset, mounts.data, strategy.packing),
        training=TrainingConfig(
            method=strategy.method,
            sequence_length=training.sequence_length,
            micro_batch_size=strategy.micro_batch_size,
            gradient_accumulation_steps=strategy.gradient_accumulation_steps,
            global_batch_size=training.global_batch_size,
            epochs=training.epochs if training.max_steps is None else None,
            max_steps=training.max_steps,
            learning_rate=training.learning_rate or default_learning_rate(strategy.method),
            warmup_ratio=training.warmup_ratio,
            weight_decay=training.weight_decay,
            max_grad_norm=training.max_grad_norm,
            optimizer=strategy.optimizer,
            precision=strategy.precision,
            gradient_checkpointing=strategy.gradient_checkpointing,
            attention=strategy.attention,
            chunked_loss=strategy.chunked_loss,
            activation_offloading=strategy.activation_offloading,
            master_weights=strategy.master_weights,
            sequence_parallel=strategy.sequence_parallel,
            tiled_mlp=strategy.tiled_mlp,
            seed=training.seed,
            checkpoint_every_steps=training.checkpoint_every_steps,
            lora=LoraConfig.model_validate({**spec.lora.model_dump(), "dropout": dropout}),
        ),
        output_dir=inside(mounts.output, spec.output.path),
        engine=DeepSpeedEngineSection(
            config=deepspeed_config(spec, strategy, planned), optimizer_in_backward=strategy.optimizer_in_backward
        )
        if strategy.engine == Engine.DEEPSPEED
        else fsdp2_config(strategy),
        prediction=PredictionConfig(
            strategy=strategy.summary(),
            peak_allocated_bytes=memory.peak_allocated_bytes,
            total_bytes=memory.total,
            gpu_memory_bytes=plan.gpu_memory_bytes,
            tokens_per_second=plan.throughput.tokens_per_second,
            peak_flops=peak_flops,
        ),
        metrics=metrics or MetricsConfig(),
        termination_log=termination_log,
        volumes=VolumesConfig(model=model_volume, data=mounts.data, output=mounts.output),
        devices=devices,
    )
