"""The optimizer step in backward on the DeepSpeed engine (ZeRO-0, the model's own bf16 weights): memfit-train
under torchrun (2 CPU ranks, gloo) with bitsandbytes' paged 8-bit AdamW, one per parameter, each stepped
from its parameter's hook after an all-reduce of its gradient, as torchtune's single-GPU full fine-tunes do.

It computes what the same optimizer stepped after the backward (DeepSpeed's all-reduce, then its step)
computes, and a run killed after its first checkpoint ends bit-identical to the uninterrupted one: the
per-parameter optimizers' 8-bit states and the schedule are in DeepSpeed's checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.runs import (
    Reference,
    assert_same_final_weights,
    logged_losses,
    make_config,
    reference_run,
    resume,
    write_config,
)
from tests.trainer.test_training import RESUME_EVERY, assert_learned

pytestmark = pytest.mark.distributed

STEPS = 16
EIGHT_BIT: dict[str, Any] = dict(
    engine="deepspeed", method="full", stage=0, offload=False, max_steps=STEPS, checkpoint_every=RESUME_EVERY,
    optimizer="paged_adamw8bit", optimizer_in_backward=True, max_grad_norm=0.0, master_weights="bf16",
    chunked_loss=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def in_backward_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory, RESUME_EVERY, **EIGHT_BIT)


@pytest.fixture(scope="module")
def after_backward_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The same optimizer stepped after the backward pass."""
    return reference_run(tmp_path_factory, RESUME_EVERY, **{**EIGHT_BIT, "optimizer_in_backward": False})


def test_it_computes_what_the_step_after_the_backward_does(
    in_backward_run: Reference, after_backward_run: Reference
) -> None:
    output, losses, _, _ = in_backward_run
    assert_learned(losses, STEPS, margin=1.0)
    after_output, after, _, _ = after_backward_run
    assert all(abs(losses[step] - after[step]) < 1e-3 for step in after), (losses, after)
    assert_same_final_weights(output, after_output)


def test_the_checkpoint_holds_each_parameters_8bit_states(in_backward_run: Reference) -> None:
    output, _, _, _ = in_backward_run
    (states,) = (output / "checkpoints").glob(f"*/step-{STEPS:06d}/*/mp_rank_00_model_states.pt")
    saved = torch.load(states, map_location="cpu", weights_only=False)["optimizer"]
    assert len(saved["param_groups"]) == 1  # one optimizer's state dict, as the step after the backward saves
    quantized = [state["__bnb_optimizer_quant_state__"] for state in saved["state"].values()]
    assert len(quantized) == len(saved["param_groups"][0]["params"])
    assert any(q["state1"].dtype == torch.uint8 and "absmax1" in q for q in quantized)  # 8-bit where large enough
    assert all(state["step"] == STEPS for state in saved["state"].values())


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path, in_backward_run: Reference) -> None:
    reference_output, reference_losses, _, _ = in_backward_run
    config = in_backward_run.killed_copy(tmp_path, **EIGHT_BIT)  # also resumed without the step in backward below
    resumed = resume(write_config(config, tmp_path / "config.json"), RESUME_EVERY)
    assert logged_losses(resumed.stdout)[STEPS] == reference_losses[STEPS]
    assert_same_final_weights(config.output_dir, reference_output)


@pytest.mark.parametrize("in_backward", [True, False], ids=["from-in-backward", "to-in-backward"])
def test_a_replan_that_turns_it_on_or_off_resumes_from_the_others_checkpoint(
    tmp_path: Path, in_backward_run: Reference, after_backward_run: Reference, in_backward: bool
) -> None:
    """The same layout either way (ZeRO-0, bf16 weights): killed after the first checkpoint with the step in
    backward on (off), resumed with it off (on), the run ends where the uninterrupted one does (the same
    arithmetic, up to the order of the gradients' reduction)."""
    _, reference_losses, _, _ = in_backward_run
    killed_run = in_backward_run if in_backward else after_backward_run
    killed = killed_run.killed_copy(tmp_path, **{**EIGHT_BIT, "optimizer_in_backward": in_backward})
    resumed_config = make_config(tmp_path, **{**EIGHT_BIT, "optimizer_in_backward": not in_backward})
    assert killed.checkpoint_dir == resumed_config.checkpoint_dir
    resumed = resume(write_config(resumed_config, tmp_path / "resumed.json"), RESUME_EVERY)
    assert abs(logged_losses(resumed.stdout)[STEPS] - reference_losses[STEPS]) < 1e-3
