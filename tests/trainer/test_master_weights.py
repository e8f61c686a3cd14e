"""training.masterWeights bf16 end to end: memfit-train under torchrun (2 CPU ranks) learns with pure bf16
weights, gradients and optimizer states at ZeRO-0 (DeepSpeed's optimizer steps the bf16 weights themselves)
and ZeRO-2 (DeepSpeed's bf16 masters), and a run killed after its first checkpoint resumes to exactly where
the uninterrupted run ends. What each stage allocates: tests/test_states_vs_deepspeed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit.contract.engines import DeepSpeedEngineSection
from tests.trainer.runs import logged_losses, make_config, uninterrupted_and_resumed
from tests.trainer.test_training import RESUME_EVERY, assert_learned

pytestmark = pytest.mark.distributed

STEPS = 16


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_masters_learn_and_resume_from_their_checkpoint(tmp_path: Path, stage: int) -> None:
    options = dict(method="full", stage=stage, offload=False, max_steps=STEPS, checkpoint_every=RESUME_EVERY,
                   master_weights="bf16")  # fmt: skip
    (tmp_path / "reference").mkdir()
    (tmp_path / "killed").mkdir()
    reference, config = (make_config(tmp_path / name, **options) for name in ("reference", "killed"))
    assert isinstance(config.engine, DeepSpeedEngineSection)
    assert (stage == 0) == ("bf16" not in config.engine.config)  # ZeRO-0: no mixed precision, the weights step
    done, resumed = uninterrupted_and_resumed(reference, config, RESUME_EVERY)
    reference_losses = logged_losses(done.stdout)
    assert_learned(reference_losses, STEPS, margin=1.0)
    weights = load_file(Path(reference.output_dir) / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}

    assert logged_losses(resumed.stdout)[STEPS] == reference_losses[STEPS]
    resumed_weights = load_file(Path(config.output_dir) / "final" / "model.safetensors")
    assert resumed_weights.keys() == weights.keys()
    assert all(torch.equal(resumed_weights[name], weights[name]) for name in weights)
