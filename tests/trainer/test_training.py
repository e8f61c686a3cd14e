"""End to end: memfit-train under torchrun, 2 CPU ranks, a tiny llama on generated text.

Each method and ZeRO layout must actually learn (the last logged loss clearly below the first), write its
result, and a run killed with SIGKILL must resume from its last checkpoint and end exactly where an
uninterrupted run ends.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from memfit_trainer.loop import HOLD_ENV
from tests.trainer.runs import (
    assert_same_final_weights,
    logged_losses,
    make_config,
    run_trainer,
    torchrun_command,
    trainer_env,
    write_config,
)

pytestmark = pytest.mark.distributed

RESUME_STEPS = 32
RESUME_EVERY = 4


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and its workers at once, as a pod kill does (torchrun puts each worker in its own
    session, so killing the launcher's process group would orphan them)."""
    launcher = psutil.Process(pid)
    for process in [*launcher.children(recursive=True), launcher]:
        process.send_signal(signal.SIGKILL)


def train_ok(tmp_path: Path, **options) -> tuple[Path, dict[int, float], str]:
    config = make_config(tmp_path, **options)
    result = run_trainer(write_config(config, tmp_path / "config.json"))
    assert result.returncode == 0, result.stderr[-4000:]
    return Path(config.output_dir), logged_losses(result.stdout), result.stdout


def assert_learned(losses: dict[int, float], steps: int, margin: float) -> None:
    assert set(losses) >= {1, steps}, losses
    assert losses[steps] < losses[1] - margin, losses


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float], str]:
    """An uninterrupted LoRA run: trains, and is the reference the killed-and-resumed run must match."""
    tmp = tmp_path_factory.mktemp("lora")
    return train_ok(tmp, method="lora", learning_rate=1e-2, max_steps=RESUME_STEPS, checkpoint_every=RESUME_EVERY)


@pytest.mark.parametrize("stage", [2, 3])
def test_full_finetuning_with_optimizer_offload_learns(tmp_path: Path, stage: int) -> None:
    output, losses, _ = train_ok(tmp_path, method="full", stage=stage, offload=True, max_steps=24)
    assert_learned(losses, 24, margin=1.5)
    assert (output / "final" / "model.safetensors").is_file()
    assert (output / "final" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (output / "checkpoints").glob("*/*")) == ["step-000016", "step-000024"]
    if (output.parent / "progress.json").exists():  # written by the metrics exporter, where installed
        assert json.loads((output.parent / "progress.json").read_text())["step"] == 24


def test_lora_under_zero2_learns_and_saves_the_adapter(lora_run: tuple[Path, dict[int, float], str]) -> None:
    output, losses, _ = lora_run
    assert_learned(losses, RESUME_STEPS, margin=0.3)
    assert (output / "final" / "adapter_model.safetensors").is_file()
    assert not (output / "final" / "model.safetensors").exists()


def test_qlora_with_8bit_client_optimizer_learns(tmp_path: Path) -> None:
    output, losses, _ = train_ok(
        tmp_path, method="qlora", stage=2, offload=False, optimizer="adamw8bit", learning_rate=1e-2, max_steps=24
    )
    assert_learned(losses, 24, margin=0.3)
    assert (output / "final" / "adapter_model.safetensors").is_file()


def kill_after_first_checkpoint_and_resume(
    config_path: Path, checkpoints: Path, tmp_path: Path, resume_config: Path | None = None, resume_nproc: int = 2
):
    """Run until the first checkpoint (held there by a test hook), SIGKILL it, run again to the end (with
    ``resume_config`` on ``resume_nproc`` ranks where given: another world size)."""
    never = tmp_path / "never-released"
    process = subprocess.Popen(
        torchrun_command(config_path), env=trainer_env(**{HOLD_ENV: f"{RESUME_EVERY}:{never}"}),
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (checkpoints / f"step-{RESUME_EVERY:06d}").is_dir():
            assert process.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.1)
        kill_tree(process.pid)
    finally:
        process.wait()
    assert not (checkpoints.parent.parent / "final").exists(), "the run finished before it could be killed"
    resumed = run_trainer(resume_config or config_path, nproc=resume_nproc)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    resumed_from = re.search(r"resumed from checkpoint step (\d+)", resumed.stdout)
    assert resumed_from is not None and int(resumed_from.group(1)) == RESUME_EVERY, resumed.stdout
    return resumed


def test_chunked_loss_learns_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """training.chunkedLoss: the LM head inside the chunked cross-entropy; full fine-tuning under ZeRO-2
    learns, and a run killed after its first checkpoint ends exactly where the uninterrupted one ends."""
    options = dict(method="full", stage=2, offload=False, max_steps=16, checkpoint_every=RESUME_EVERY,
                   chunked_loss=True)  # fmt: skip
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference_output, reference_losses, stdout = train_ok(tmp_path / "reference", **options)
    assert "loss: chunked cross-entropy (pytorch)" in stdout
    assert_learned(reference_losses, 16, margin=1.0)

    config = make_config(tmp_path / "killed", **options)
    config_path = write_config(config, tmp_path / "killed" / "config.json")
    resumed = kill_after_first_checkpoint_and_resume(config_path, config.checkpoint_dir, tmp_path)
    assert logged_losses(resumed.stdout)[16] == reference_losses[16]
    assert_same_final_weights(config.output_dir, reference_output)


def test_killed_run_resumes_from_its_last_checkpoint(
    tmp_path: Path, lora_run: tuple[Path, dict[int, float], str]
) -> None:
    reference_output, reference_losses, _ = lora_run
    config = make_config(
        tmp_path, method="lora", learning_rate=1e-2, max_steps=RESUME_STEPS, checkpoint_every=RESUME_EVERY
    )
    config_path = write_config(config, tmp_path / "config.json")
    # The run holds after its first checkpoint (a test hook) until killed: killed there whatever the speed.
    resumed = kill_after_first_checkpoint_and_resume(config_path, config.checkpoint_dir, tmp_path)
    losses = logged_losses(resumed.stdout)
    assert losses[RESUME_STEPS] == reference_losses[RESUME_STEPS]
    adapter = load_file(Path(config.output_dir) / "final" / "adapter_model.safetensors")
    expected = load_file(reference_output / "final" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys()
    assert all(torch.equal(adapter[name], expected[name]) for name in expected)
