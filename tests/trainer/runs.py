"""Helpers for the trainer's end-to-end tests: a tiny model, generated data, configs, torchrun runs.

The tiny llama (hidden 64, 2 layers, vocabulary 258 = the byte tokenizer) trains in well under a second per
step on two CPU ranks. DeepSpeed compiles its CPU ops on first use (minutes) into ``TORCH_EXTENSIONS_DIR``;
runs reuse the one the environment names, else ``~/.cache/torch_extensions``, so only the first run pays.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

from memfit.api.vocabulary import MasterWeights, Precision
from memfit.contract.engines import DeepSpeedEngineSection, Fsdp2EngineSection, precision_section
from memfit.contract.progress import read_progress
from memfit.contract.sections import DataConfig, LoraConfig, MetricsConfig, ModelConfig, TrainingConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily, ModelShape
from memfit_trainer.loop import HOLD_ENV
from memfit_trainer.protocol_hold import HOLD_AT_ENV

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


HELD_DEADLINE_SECONDS = 600


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and its workers at once, as a pod kill does (torchrun puts each worker in its own
    session, so killing the launcher's process group would orphan them)."""
    launcher = psutil.Process(pid)
    for process in [*launcher.children(recursive=True), launcher]:
        process.send_signal(signal.SIGKILL)


def held_after(config: TrainerConfig, step: int) -> bool:
    """Rank 0 reported ``step`` (and, at a checkpoint step, its checkpoint is complete): the run holds there."""
    assert config.metrics.progress_file is not None, "make_config names a progress file"
    progress = read_progress(config.metrics.progress_file)
    every = config.training.checkpoint_every_steps
    checkpointed = step % every != 0 or (config.checkpoint_dir / f"step-{step:06d}").is_dir()
    return progress is not None and progress.step == step and checkpointed


def run_held_and_killed(
    config: TrainerConfig, config_path: Path, step: int, nproc: int = WORLD_SIZE, point: str | None = None
) -> str:
    """Run the config on ``nproc`` ranks until it holds after ``step`` (the test hook: killed there however fast
    the machine trains), or at the checkpoint protocol's ``point`` for ``step``
    (:mod:`memfit_trainer.protocol_hold`), SIGKILL it as a pod kill does; its output."""
    log = config_path.parent / f"held-{point or 'after'}-{step}.log"
    release = config_path.parent / "never-released"
    if point is None:
        hold, held = {HOLD_ENV: f"{step}:{release}"}, lambda: held_after(config, step)
    else:
        hold, held = {HOLD_AT_ENV: f"{point}:{step}:{release}"}, Path(f"{release}.held").exists
    with log.open("w") as out:
        process = subprocess.Popen(
            torchrun_command(config_path, nproc), env=trainer_env(**hold), start_new_session=True, stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + HELD_DEADLINE_SECONDS
            while not held():
                assert process.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, f"not held at {point or 'after'} {step} in time"
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
            process.wait()
            Path(f"{release}.held").unlink(missing_ok=True)
    assert not Path(config.final_dir).exists(), "the run finished before it could be killed"
    return log.read_text()


def run_with_a_copy_held_after(
    config: TrainerConfig, config_path: Path, step: int, copy_to: Path
) -> subprocess.CompletedProcess[str]:
    """Run the config to the end, holding it after ``step`` (the test hook) while its directory (``make_config``'s
    ``tmp_path / name``) is copied to ``copy_to / name``: on disk, what a SIGKILL there leaves (the ranks idle in
    the hook, nothing in flight). One start serves as the uninterrupted run and as the killed one a resume of
    the copy continues; the completed run (stdout and stderr as text)."""
    directory = Path(config.output_dir).parent
    release = config_path.parent / f"release-{step}"
    with (
        (config_path.parent / f"run-{step}.out").open("w+") as out,
        (config_path.parent / f"run-{step}.err").open("w+") as err,
    ):
        process = subprocess.Popen(
            torchrun_command(config_path), env=trainer_env(**{HOLD_ENV: f"{step}:{release}"}), stdout=out, stderr=err
        )
        try:
            deadline = time.monotonic() + HELD_DEADLINE_SECONDS
            while not held_after(config, step):
                assert process.poll() is None, Path(err.name).read_text()[-4000:]
                assert time.monotonic() < deadline, f"not held after step {step} within {HELD_DEADLINE_SECONDS} s"
                time.sleep(0.1)
            shutil.copytree(directory, copy_to / directory.name)
            release.touch()
            process.wait(timeout=HELD_DEADLINE_SECONDS)
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def uninterrupted_and_resumed(
    reference: TrainerConfig, killed: TrainerConfig, step: int
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """``reference`` run to the end, and ``killed`` (its config in another ``make_config`` directory, under the same
    name) resumed from the copy of the reference's directory taken while it held after ``step``, which is what a
    run killed there leaves: the uninterrupted run and the resumed one, both completed, from two starts."""
    reference_dir, killed_dir = (Path(config.output_dir).parent for config in (reference, killed))
    assert reference_dir.name == killed_dir.name != "", "the same name in two directories"
    done = run_with_a_copy_held_after(
        reference, write_config(reference, reference_dir.parent / "config.json"), step, killed_dir.parent
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done, resume(write_config(killed, killed_dir.parent / "config.json"), step)


def resumed_from(log: str) -> int | None:
    """The step the run's output says it resumed from."""
    found = re.search(r"resumed from checkpoint step (\d+)", log)
    return None if found is None else int(found.group(1))


def resume(config_path: Path, step: int, nproc: int = WORLD_SIZE) -> subprocess.CompletedProcess[str]:
    """Run the config to the end, which must resume from the checkpoint of ``step``."""
    resumed = run_trainer(config_path, nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed_from(resumed.stdout) == step, resumed.stdout
    return resumed


def config_over_a_copy(directory: Path, tmp_path: Path, **options: Any) -> TrainerConfig:
    """``make_config(tmp_path, **options)`` over a copy of ``directory``, where a run of those options ran
    (``make_config(directory, **options)``): its outputs, checkpoints and corpus, for a test to go on from
    without changing the original (the data's fingerprint holds no path)."""
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    return make_config(tmp_path, **options)


class Reference(NamedTuple):
    """An uninterrupted run, and the copy of its directory taken while it held after a checkpoint step."""

    output: Path
    losses: dict[int, float]
    stdout: str
    killed: Path
    """What a run killed after that step leaves: :meth:`killed_copy` gives each test its own copy to resume."""

    def killed_copy(self, tmp_path: Path, **options: Any) -> TrainerConfig:
        """``make_config(tmp_path, **options)``, its directory a copy of what the killed run left."""
        return config_over_a_copy(self.killed, tmp_path, **options)


def reference_run(factory: pytest.TempPathFactory, step: int, **options: Any) -> Reference:
    """``make_config``'s run of ``options`` to the end in a directory of its own, copied while it held after
    ``step`` (:func:`run_with_a_copy_held_after`): one start for the reference and for the killed runs."""
    tmp, killed = factory.mktemp("reference"), factory.mktemp("killed")
    config = make_config(tmp, **options)
    done = run_with_a_copy_held_after(config, write_config(config, tmp / "config.json"), step, killed)
    assert done.returncode == 0, done.stderr[-4000:]
    return Reference(Path(config.output_dir), logged_losses(done.stdout), done.stdout, killed)


class KilledRuns:
    """Runs of :func:`make_config` held after a checkpoint step and killed (SIGKILL), each started once: :meth:`copy`
    hands a test its own copy of one to go on from. Several tests that go on from one kill share its torchrun
    start (about 10 s of imports) and its steps."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._runs: dict[str, Path] = {}

    def copy(self, tmp_path: Path, step: int, nproc: int = WORLD_SIZE, **options: Any) -> TrainerConfig:
        """``make_config(tmp_path, **options)``, its directory a copy of that run killed after ``step``."""
        key = json.dumps([step, nproc, options], sort_keys=True, default=str)
        if key not in self._runs:
            directory = self._factory.mktemp("killed")
            config = make_config(directory, **options)
            run_held_and_killed(config, write_config(config, directory / "killed.json"), step, nproc)
            self._runs[key] = directory
        return config_over_a_copy(self._runs[key], tmp_path, **options)
