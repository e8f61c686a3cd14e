"""A resumed run is bit-identical to the uninterrupted one, on every engine.

DeepSpeed's C++ Adam (DeepSpeedCPUAdam under optimizer offload; FusedAdam on the CPU accelerator) keeps beta1^t
and beta2^t as running float products that no checkpoint holds; a resumed process recomputed them with ``pow``,
which differs in the last bits at many steps (the bias correction of a resume from 2, 5, 13, 15, 18-46, 50-60,
64-67, 80-111 and more, for the default betas, computed in float32).
:func:`~memfit_trainer.deepspeed_engine.replay_bias_correction` rebuilds them after a load. Here one optimizer
resumed from a copy of another's state at such steps must step exactly as the original goes on, and a chain of
kills of the tiny llama (held and killed at checkpoints where the products drift, between checkpoints, and at
each point of the checkpoint protocol: COMPLETE written, renamed, pruning, the final export written) must end
with the uninterrupted run's weights and loss, on DeepSpeed (CPU Adam) and fsdp2, full and LoRA.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit_trainer.deepspeed_engine import replay_bias_correction
from tests.trainer.runs import (
    assert_same_final_weights,
    logged_losses,
    make_config,
    resume,
    resumed_from,
    run_held_and_killed,
    run_with_a_copy_held_after,
    write_config,
)

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
@pytest.mark.slow
def test_cpu_adam_resumed_at_a_drifted_step_steps_as_the_original(optimizer: str, at: int) -> None:
    make = OPTIMIZERS[optimizer]
    expected, without_replay = _resumed(make, at, replay=False)
    assert not torch.equal(without_replay, expected), "the products no longer drift here: choose other steps"
    expected, resumed = _resumed(make, at, replay=True)
    assert torch.equal(resumed, expected)


STEPS = 20
EVERY = 5
FIRST = 5
"""The chain's first link: the uninterrupted run itself, its directory copied while it held after this step (on
disk what a kill there leaves)."""
CHAIN: tuple[tuple[str | None, int, int], ...] = (
    ("marker-written", 10, 5),  # COMPLETE written, not renamed: the next run cleans it up, resumes from 5
    (None, 13, 10),  # after step 13, between checkpoints: steps 11-13 are trained again
    ("renamed", 15, 15),  # the directory renamed, before pruning: complete
    ("pruning", 5, 20),  # while saving 20, checkpoint 5 half pruned (renamed to .deleting, not removed)
    ("final-written", 20, 20),  # the final export complete under its temporary name, not swapped in
)
"""Each further link is killed at a point of the checkpoint protocol (:mod:`memfit_trainer.protocol_hold`) for
a step, or after a step (``None``), and the next run must resume from the third number: the newest checkpoint
the killed run completed. The resumes are at 5 and 15, where the products drifted, and at 10 and 20."""
RUNS: dict[str, dict[str, Any]] = {
    "deepspeed-full": dict(method="full", stage=3, offload=True),  # CPU Adam's step per sub-group
    "fsdp2-lora": dict(engine="fsdp2", method="lora", stage=3, offload=False, learning_rate=1e-2),
}
"""Both engines and both kinds of training, each chain about two minutes on 2 cores: DeepSpeed where the
drift was (full: CPU Adam per ZeRO-3 sub-group), fsdp2 with adapters (its full runs' kill and resume are
bit-identical in tests/trainer/test_fsdp2.py, and DeepSpeed's LoRA step is the same CPU Adam over a partition)."""
FINAL_WEIGHTS = {"full": "model.safetensors", "lora": "adapter_model.safetensors"}


@pytest.mark.distributed
@pytest.mark.parametrize("run", sorted(RUNS))
def test_a_chain_of_kills_ends_bit_identical_to_the_uninterrupted_run(tmp_path: Path, run: str) -> None:
    options = {**RUNS[run], "max_steps": STEPS, "checkpoint_every": EVERY}
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference, config = (make_config(tmp_path / name, **options) for name in ("reference", "killed"))
    # The first kill is the uninterrupted run's directory, copied while it held after FIRST: what a kill leaves.
    done = run_with_a_copy_held_after(
        reference, write_config(reference, tmp_path / "reference" / "config.json"), FIRST, tmp_path / "killed"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference_losses = logged_losses(done.stdout)

    config_path = write_config(config, tmp_path / "killed" / "config.json")
    newest, losses = FIRST, {}  # the checkpoint each run must resume from: the newest the previous one completed
    for point, step, completed in CHAIN:
        log = run_held_and_killed(config, config_path, step, point=point)
        assert resumed_from(log) == newest, log[-3000:]
        losses.update(logged_losses(log))
        newest = completed
    resume(config_path, newest)
    assert losses[STEPS] == reference_losses[STEPS]
    # The half-pruned 5 and the sealed but unrenamed 10 cleaned up (10 saved again); nothing temporary left.
    assert sorted(p.name for p in config.checkpoint_dir.iterdir()) == ["step-000010", "step-000015", "step-000020"]
    assert_same_final_weights(config.output_dir, reference.output_dir, FINAL_WEIGHTS[config.training.method])
