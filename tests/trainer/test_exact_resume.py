"""A resumed run is bit-identical to the uninterrupted one, on every engine.

DeepSpeed's C++ Adam (DeepSpeedCPUAdam under optimizer offload; FusedAdam on the CPU accelerator) keeps beta1^t
and beta2^t as running float products that no checkpoint holds; a resumed process recomputed them with ``pow``,
which differs in the last bits at many steps (the bias correction of a resume from 2, 5, 13, 15, 18-46, 50-60,
64-67, 80-111 and more, for the default betas, computed in float32).
:func:`~memfit_trainer.deepspeed_engine.replay_bias_correction` rebuilds them after a load. Here one optimizer
resumed from a copy of another's state at such steps must step exactly as the original goes on, and a chain of
kills of the tiny llama (held and killed at checkpoints where the products drift, and between checkpoints) must
end with the uninterrupted run's weights and loss, on DeepSpeed (CPU Adam) and fsdp2, full and LoRA.
"""

from __future__ import annotations

import copy
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.contract.progress import read_progress
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.deepspeed_engine import replay_bias_correction
from memfit_trainer.loop import HOLD_ENV
from tests.trainer.runs import (
    WORLD_SIZE,
    assert_same_final_weights,
    logged_losses,
    make_config,
    run_trainer,
    torchrun_command,
    trainer_env,
    write_config,
)
from tests.trainer.test_training import kill_tree, train_ok

DRIFTED = (5, 15, 84)
"""Steps after which a process that recomputes beta^t with ``pow`` updates otherwise than the one that
multiplied it. Resuming the tiny llama (full, ZeRO-2, CPU Adam, 20 steps) from each step's checkpoint without
the replay changed its final weights from 2, 5 and 13, not from 4, 8, 10 and 15 (15 moves only the fp32
masters, by less than bf16 keeps); issue 22 saw 84 and 91 change them, 63 and 77 not."""
GOES_ON = 3
"""Steps taken after the resume: the first differs already where the products drifted."""


def _cpu_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-3)


def _fused_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(params, lr=1e-3)


OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "DeepSpeedCPUAdam": _cpu_adam,
    "FusedAdam": _fused_adam,
}


def _gradients(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=generator) for _ in range(steps)]


def _step(optimizer: torch.optim.Optimizer, weight: torch.Tensor, gradient: torch.Tensor) -> None:
    weight.grad = gradient.clone()
    optimizer.step()


def _resumed(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], at: int, replay: bool) -> torch.Tensor:
    """The weight of an optimizer that took ``at`` steps, then one built afresh from a copy of its state (as a
    resumed process is) took ``GOES_ON`` more; the weight the uninterrupted one ended with first."""
    gradients = _gradients(at + GOES_ON)
    weight = torch.zeros(1000, requires_grad=True)
    original = make([weight])
    for gradient in gradients[:at]:
        _step(original, weight, gradient)
    saved_weight, saved_state = weight.detach().clone(), copy.deepcopy(original.state_dict())
    for gradient in gradients[at:]:
        _step(original, weight, gradient)
    expected = weight.detach().clone()

    resumed_weight = saved_weight.clone().requires_grad_(True)
    resumed = make([resumed_weight])
    resumed.load_state_dict(saved_state)
    if replay:
        replay_bias_correction(resumed, torch.device("cpu"))
    for gradient in gradients[at:]:
        _step(resumed, resumed_weight, gradient)
    return torch.stack([expected, resumed_weight.detach()])


@pytest.mark.parametrize("at", DRIFTED)
@pytest.mark.parametrize(
    "optimizer",  # DeepSpeedCPUAdam reads the CPU's description at each construction: seconds
    [pytest.param(name, marks=[pytest.mark.slow] if name == "DeepSpeedCPUAdam" else []) for name in sorted(OPTIMIZERS)],
)
def test_cpu_adam_resumed_at_a_drifted_step_steps_as_the_original(optimizer: str, at: int) -> None:
    make = OPTIMIZERS[optimizer]
    expected, without_replay = _resumed(make, at, replay=False)
    assert not torch.equal(without_replay, expected), "the products no longer drift here: choose other steps"
    expected, resumed = _resumed(make, at, replay=True)
    assert torch.equal(resumed, expected)


STEPS = 20
EVERY = 5
CHAIN = (5, 13, 15)
"""Each run of the chain is held after this step and killed: at checkpoints where the products drifted (5 and
15, resumed there) and between checkpoints (13: resumed from 10, the steps after it trained again)."""
RUNS: dict[str, dict[str, Any]] = {
    "deepspeed-full": dict(method="full", stage=3, offload=True),  # CPU Adam's step per sub-group
    "fsdp2-lora": dict(engine="fsdp2", method="lora", stage=3, offload=False, learning_rate=1e-2),
}
"""Both engines and both kinds of training, each chain about two minutes on 2 cores: DeepSpeed where the
drift was (full: CPU Adam per ZeRO-3 sub-group), fsdp2 with adapters (its full runs' kill and resume are
bit-identical in tests/trainer/test_fsdp2.py, and DeepSpeed's LoRA step is the same CPU Adam over a partition)."""
FINAL_WEIGHTS = {"full": "model.safetensors", "lora": "adapter_model.safetensors"}


def held_after(config: TrainerConfig, step: int) -> bool:
    """Rank 0 reported ``step`` (and, at a checkpoint step, its checkpoint is complete): the run holds there."""
    assert config.metrics.progress_file is not None, "make_config names a progress file"
    progress = read_progress(config.metrics.progress_file)
    every = config.training.checkpoint_every_steps
    checkpointed = step % every != 0 or (config.checkpoint_dir / f"step-{step:06d}").is_dir()
    return progress is not None and progress.step == step and checkpointed


def resumed_from(log: str) -> int | None:
    """The step the run's output says it resumed from."""
    found = re.search(r"resumed from checkpoint step (\d+)", log)
    return None if found is None else int(found.group(1))


def run_held_and_killed(config: TrainerConfig, config_path: Path, step: int, nproc: int = WORLD_SIZE) -> str:
    """Run the config on ``nproc`` ranks until it holds after ``step`` (the test hook), SIGKILL it as a pod kill
    does; its output."""
    log = config_path.parent / f"held-{step}.log"
    release = config_path.parent / "never-released"
    with log.open("w") as out:
        process = subprocess.Popen(
            torchrun_command(config_path, nproc), env=trainer_env(**{HOLD_ENV: f"{step}:{release}"}),
            start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            while not held_after(config, step):
                assert process.poll() is None, log.read_text()[-4000:]
                time.sleep(0.1)
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
            process.wait()
    return log.read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_chain_of_kills_ends_bit_identical_to_the_uninterrupted_run(tmp_path: Path, run: str) -> None:
    options = {**RUNS[run], "max_steps": STEPS, "checkpoint_every": EVERY}
    (tmp_path / "reference").mkdir()
    reference_output, reference_losses, _ = train_ok(tmp_path / "reference", **options)

    config = make_config(tmp_path, **options, name="killed")
    config_path = write_config(config, tmp_path / "killed.json")
    newest = None  # the checkpoint each run must resume from: the newest the previous one completed
    for step in CHAIN:
        assert resumed_from(run_held_and_killed(config, config_path, step)) == newest
        newest = step - step % EVERY
    last = run_trainer(config_path)
    assert last.returncode == 0, last.stderr[-4000:]
    assert resumed_from(last.stdout) == newest
    assert logged_losses(last.stdout)[STEPS] == reference_losses[STEPS]
    assert_same_final_weights(config.output_dir, reference_output, FINAL_WEIGHTS[config.training.method])
