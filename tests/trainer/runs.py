"""Helpers for the trainer's end-to-end tests: a tiny model, generated data, configs, torchrun runs.

The tiny llama (hidden 64, 2 layers, vocabulary 258 = the byte tokenizer) trains in well under a second per
step on two CPU ranks. DeepSpeed compiles its CPU ops on first use (minutes) into ``TORCH_EXTENSIONS_DIR``;
runs reuse the one the environment names, else ``~/.cache/torch_extensions``, so only the first run pays.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from memfit.api.vocabulary import MasterWeights, Precision
from memfit.contract.engines import DeepSpeedEngineSection, Fsdp2EngineSection, precision_section
from memfit.contract.sections import DataConfig, LoraConfig, MetricsConfig, ModelConfig, TrainingConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily, ModelShape

WORLD_SIZE = 2
MICRO_BATCH = 2
SEQUENCE_LENGTH = 64
TINY_LLAMA = ModelShape(ModelFamily.LLAMA, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=258)  # fmt: skip
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss ([0-9.]+)", re.MULTILINE)


def write_corpus(path: Path, records: int = 400) -> Path:
    """Repetitive, learnable English-like text: a tiny model's loss falls quickly on it."""
    subjects = ["the cat", "a dog", "my friend", "the teacher", "our neighbour"]
    verbs = ["sees", "likes", "paints", "follows", "finds"]
    objects = ["the red ball", "a green tree", "the old house", "a small boat", "the blue sky"]
    with path.open("w") as f:
        for i in range(records):
            text = f"{subjects[i % 5]} {verbs[(i // 5) % 5]} {objects[(i // 25) % 5]}. " * 3
            f.write(json.dumps({"text": text}) + "\n")
    return path


def deepspeed_config(
    stage: int,
    *,
    offload: bool,
    optimizer: str,
    learning_rate: float,
    world_size: int = WORLD_SIZE,
    master_weights: str = "fp32",
    max_grad_norm: float = 1.0,
    client_optimizers: bool = False,
) -> dict[str, Any]:
    """As memfit.render.deepspeed renders it; ``client_optimizers``: the trainer builds every optimizer (one per
    parameter with the step in backward), DeepSpeed none."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": MICRO_BATCH * world_size,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": zero,
    }
    precision = precision_section(Precision.BF16, MasterWeights(master_weights), stage)
    if precision is not None:  # none for bf16 masters at ZeRO-0: the optimizer updates the bf16 weights
        config["bf16"] = precision
    if optimizer == "adamw" and not client_optimizers:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": learning_rate, "weight_decay": 0.0}}
    else:
        config["zero_allow_untested_optimizer"] = True
    return config


def make_config(
    tmp_path: Path,
    *,
    method: str = "full",
    stage: int = 2,
    offload: bool = True,
    optimizer: str = "adamw",
    learning_rate: float = 3e-3,
    max_steps: int = 24,
    checkpoint_every: int = 8,
    name: str = "run",
    data: Path | None = None,
    world_size: int = WORLD_SIZE,
    chunked_loss: bool = False,
    master_weights: str = "fp32",
    engine: str = "deepspeed",
    reshard_after_forward: bool | None = None,
    accumulation: int = 1,
    activation_offloading: bool = False,
    optimizer_in_backward: bool = False,
    max_grad_norm: float = 1.0,
    micro_batch: int = MICRO_BATCH,
) -> TrainerConfig:
    """A config of the tiny llama. ``engine="fsdp2"`` renders an fsdp2 engine section instead of a DeepSpeed one:
    resharded after the forward pass as ``stage`` 3 is (or as ``reshard_after_forward`` says), CPU offload
    with ``offload``, gradients reduced in bf16 with bf16 masters (as memfit.render.fsdp2 renders them).
    ``micro_batch`` other than MICRO_BATCH is for fsdp2 only (the DeepSpeed section renders MICRO_BATCH)."""
    data = data or write_corpus(tmp_path / "corpus.jsonl")
    section: DeepSpeedEngineSection | Fsdp2EngineSection
    if engine == "fsdp2":
        section = Fsdp2EngineSection(
            reshard_after_forward=stage == 3 if reshard_after_forward is None else reshard_after_forward,
            cpu_offload=offload,
            reduce_dtype=Precision.BF16 if master_weights == "bf16" else Precision.FP32,
            optimizer_in_backward=optimizer_in_backward,
        )
    else:
        deepspeed = deepspeed_config(stage, offload=offload, optimizer=optimizer, learning_rate=learning_rate,
                                     world_size=world_size, master_weights=master_weights, max_grad_norm=max_grad_norm,
                                     client_optimizers=optimizer_in_backward)  # fmt: skip
        section = DeepSpeedEngineSection(config=deepspeed, optimizer_in_backward=optimizer_in_backward)
    return TrainerConfig(
        job=f"test/{name}",
        model=ModelConfig(name_or_path="tiny-llama", random_init=True, architecture=TINY_LLAMA),
        data=DataConfig(path=str(data), text_field="text"),
        training=TrainingConfig(
            method=method,
            sequence_length=SEQUENCE_LENGTH,
            micro_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation,
            global_batch_size=micro_batch * world_size * accumulation,
            max_steps=max_steps,
            learning_rate=learning_rate,
            warmup_ratio=0.1,
            optimizer=optimizer,
            precision="bf16",
            checkpoint_every_steps=checkpoint_every,
            keep_checkpoints=2,
            lora=LoraConfig(rank=8, alpha=16, dropout=0.0),
            chunked_loss=chunked_loss,
            master_weights=master_weights,
            gradient_checkpointing=activation_offloading,  # activation offloading needs it
            activation_offloading=activation_offloading,
            max_grad_norm=max_grad_norm,
        ),
        output_dir=str(tmp_path / name / "output"),
        engine=section,
        metrics=MetricsConfig(port=0, progress_file=str(tmp_path / name / "progress.json")),
        termination_log=str(tmp_path / name / "termination-log"),
    )


def write_config(config: TrainerConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json())
    return path


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions"),
    )
    env.update(extra)
    return env


def torchrun_command(config_path: Path, nproc: int = WORLD_SIZE) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "memfit_trainer.main", "--config", str(config_path),
    ]  # fmt: skip


def run_trainer(config_path: Path, timeout: float = 300, nproc: int = WORLD_SIZE, **env: str):
    """Run ``memfit-train`` under torchrun to the end; the CompletedProcess (stdout and stderr as text)."""
    return subprocess.run(
        torchrun_command(config_path, nproc), env=trainer_env(**env), capture_output=True, text=True, timeout=timeout
    )


def assert_same_final_weights(
    output_dir: str | Path, reference_dir: str | Path, weights: str = "model.safetensors"
) -> None:
    """Two runs ended with bit-identical final weights (or adapter, ``weights``)."""
    import torch
    from safetensors.torch import load_file

    final = load_file(Path(output_dir) / "final" / weights)
    expected = load_file(Path(reference_dir) / "final" / weights)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def logged_losses(stdout: str) -> dict[int, float]:
    """Step -> loss from rank 0's progress lines."""
    return {int(m.group(1)): float(m.group(3)) for m in STEP_LINE.finditer(stdout)}


def run_single_process(config_path: Path, timeout: float = 300, **env: str):
    """Run ``python -m memfit_trainer.main`` without torchrun (a world of one): its own exit code."""
    return subprocess.run(
        [sys.executable, "-m", "memfit_trainer.main", "--config", str(config_path)],
        env=trainer_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
