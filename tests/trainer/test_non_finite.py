"""No training on garbage: a step whose loss is NaN stops the run before anything of it is written.

A DeepSpeed run (2 CPU ranks, ZeRO-2) is killed after its checkpoint of step 4; NaN is then written into that
checkpoint's fp32 master partitions, what DeepSpeed loads the weights from (as 4 KiB of random bytes in an
optimizer file did in issue 22), and the checkpoint is sealed again, as a run without this guard would have
sealed the NaN it wrote (unsealed edits are set aside by verification: tests/trainer/test_verified_checkpoints.py).
The rerun resumes from step 4, computes NaN a step later and stops there:
exit 2, one line naming the step, the loss and the checkpoint it came from, the NonFinite termination message, and
no checkpoint or export after step 4, so the last good checkpoint is never pruned by garbage.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from memfit.api.vocabulary import TerminationReason
from memfit_trainer.checkpoint import COMPLETE_MARKER, DEEPSPEED_TAG, MANIFEST_KEY
from memfit_trainer.manifest import MANIFEST, checkpoint_files, digest_share, write_manifest
from tests.trainer.runs import make_config, run_held_and_killed, run_trainer, write_config

pytestmark = pytest.mark.distributed

EVERY = 4


def _poison_masters(checkpoint: Path) -> int:
    """NaN in every fp32 master partition of a ZeRO-1/2 checkpoint; how many files it changed."""
    files = sorted((checkpoint / DEEPSPEED_TAG).glob("*optim_states.pt"))
    for path in files:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        partitions = saved["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        saved["optimizer_state_dict"]["single_partition_of_fp32_groups"] = [
            torch.full_like(partition.detach(), float("nan")) for partition in partitions
        ]
        torch.save(saved, path)
    return len(files)


def _reseal(checkpoint: Path) -> None:
    """A new manifest of the checkpoint's files as they are now, and its hash in the marker."""
    files = checkpoint_files(checkpoint, exclude=(MANIFEST, COMPLETE_MARKER))
    digest = write_manifest(checkpoint, digest_share(checkpoint, files, 0, 1))
    marker = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({**marker, MANIFEST_KEY: digest}))


def test_a_nan_loss_stops_the_run_before_it_writes_anything(tmp_path: Path) -> None:
    config = make_config(tmp_path, method="full", stage=2, offload=False, max_steps=3 * EVERY, checkpoint_every=EVERY)
    config_path = write_config(config, tmp_path / "config.json")
    run_held_and_killed(config, config_path, EVERY)
    checkpoint = config.checkpoint_dir / f"step-{EVERY:06d}"
    assert _poison_masters(checkpoint) == 2  # one partition file per rank
    _reseal(checkpoint)

    rerun = run_trainer(config_path)
    assert rerun.returncode != 0
    # The bf16 weights DeepSpeed loads come from the model states: step 5 computes a finite loss, then its update
    # copies the NaN masters into them, and step 6 is the first garbage step.
    said = re.search(
        rf"step (\d+): loss nan[^:]*: stopped before writing anything of it \(the run started from checkpoint "
        rf"step {EVERY}\)", rerun.stderr,
    )  # fmt: skip
    assert said is not None and EVERY < int(said.group(1)) < 2 * EVERY, rerun.stderr[-3000:]
    message = json.loads((Path(config.output_dir).parent / "termination-log").read_text())
    assert message["reason"] == TerminationReason.NON_FINITE and said.group(0) in message["message"]
    assert sorted(p.name for p in config.checkpoint_dir.iterdir()) == [checkpoint.name]
    assert not Path(config.final_dir).exists()
