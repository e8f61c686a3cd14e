"""Render the trainer's config (``memfit.contract.trainer_config.TrainerConfig``) for a job and its plan.

The operator puts the result in the job's ConfigMap; ``memfit run --local`` writes it to a file. Paths
are where the job's volumes are mounted (in the pod, or the local directories standing in for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from memfit.api.finetunejob import FineTuneJob
from memfit.api.plan import PlanCandidate
from memfit.contract.trainer_config import (
    DataConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    PredictionConfig,
    TrainerConfig,
    TrainingConfig,
)
from memfit.render.deepspeed import deepspeed_config, default_learning_rate


@dataclass(frozen=True)
class Mounts:
    """Where the job's volumes are: the roots the sources' ``path`` fields are relative to."""

    model: str | None
    data: str
    output: str


POD_MOUNTS = Mounts(model="/mnt/model", data="/mnt/data", output="/mnt/output")
"""The trainer pods' mount points (the operator's pod template mounts the PVCs there)."""


def inside(root: str, path: str | None) -> str:
    return str(PurePosixPath(root) / (path or "").lstrip("/"))


def render_trainer_config(
    job: FineTuneJob,
    plan: PlanCandidate,
    peak_flops: float | None = None,
    mounts: Mounts = POD_MOUNTS,
    metrics: MetricsConfig | None = None,
    termination_log: str = "/dev/termination-log",
) -> TrainerConfig:
    spec, strategy = job.spec, plan.strategy
    shape = spec.model.architecture.shape()
    source = spec.model.source
    if source is not None and source.pvc is not None and mounts.model is not None:
        name_or_path = inside(mounts.model, source.path)
    else:
        name_or_path = spec.model.name
    training = spec.training
    memory = plan.memory.per_gpu
    return TrainerConfig(
        job=f"{job.metadata.namespace or 'default'}/{job.metadata.name}",
        model=ModelConfig(name_or_path=name_or_path, random_init=spec.model.random_init, architecture=shape),
        data=DataConfig(
            path=inside(mounts.data, spec.dataset.source.path),
            format=spec.dataset.format,
            text_field=spec.dataset.text_field,
            messages_field=spec.dataset.messages_field,
            streaming=spec.dataset.streaming,
        ),
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
            seed=training.seed,
            checkpoint_every_steps=training.checkpoint_every_steps,
            lora=LoraConfig.model_validate(spec.lora.model_dump()),
        ),
        output_dir=inside(mounts.output, spec.output.path),
        deepspeed=deepspeed_config(spec, strategy),
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
    )
