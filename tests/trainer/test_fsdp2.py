"""``engine: fsdp2`` end to end: memfit-train under torchrun (2 CPU ranks, gloo) shards the tiny llama with
``fully_shard`` and checkpoints with ``torch.distributed.checkpoint``.

Full fine-tuning learns with the parameters resharded after the forward pass (zeroStage 3), with CPU
offload, and kept gathered (zeroStage 2) with the chunked loss, all to the same losses (sharding and offload
do not change the arithmetic); LoRA and QLoRA (its 4-bit base sharded in bf16 storage) learn and save only
their adapter; bf16 masters keep bf16 parameters
and optimizer states. A run killed after its first checkpoint ends exactly where the uninterrupted one ends,
and one checkpointed at 2 ranks resumes at 1 rank at the same step and the same place in the data. With the
optimizer step in backward (one AdamW per parameter, stepped from FSDP2's post-accumulate-grad hooks) the
run learns as one without clipping does (the same arithmetic, stepped earlier), and resumes the same ways.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from memfit.contract.termination import completed_progress
from tests.trainer.runs import (
    TINY_LLAMA,
    Reference,
    assert_same_final_weights,
    logged_losses,
    make_config,
    reference_run,
    resume,
    resumed_from,
    run_single_process,
    write_config,
)
from tests.trainer.test_training import RESUME_EVERY, assert_learned, train_ok

pytestmark = pytest.mark.distributed

STEPS = 16
FULL = dict(engine="fsdp2", method="full", stage=3, offload=False, max_steps=STEPS, checkpoint_every=RESUME_EVERY)
IN_BACKWARD = {**FULL, "optimizer_in_backward": True, "max_grad_norm": 0.0}
QLORA = {**FULL, "method": "qlora", "learning_rate": 1e-2}
EIGHT_BIT: dict[str, Any] = {
    **IN_BACKWARD,
    "optimizer": "paged_adamw8bit",
    "master_weights": "bf16",
    "chunked_loss": True,
}
"""torchtune's single-GPU full fine-tune: pure bf16, bitsandbytes' paged 8-bit AdamW stepped in backward, the
chunked loss (here under ZeRO-3: the root, the head's group, gathered again for the loss)."""
FINAL_WEIGHTS = {"full": "model.safetensors", "qlora": "adapter_model.safetensors"}
LAYOUT = {"engine": "fsdp2", "method": "full", "precision": "bf16", "worldSize": 0, "zeroStage": 0}


def dcp_dtypes(checkpoint: Path) -> dict[str, torch.dtype]:
    """Tensor name -> dtype, from the DCP metadata of a step directory."""
    metadata = FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata
    return {name: entry.properties.dtype for name, entry in metadata.items() if hasattr(entry, "properties")}


def marker(output: Path, layout: str, step: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((output / "checkpoints" / layout / f"step-{step:06d}" / "COMPLETE").read_text())
    return result


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Full fine-tuning resharded after the forward pass: the reference of the other full runs."""
    return reference_run(tmp_path_factory, RESUME_EVERY, **FULL)


@pytest.fixture(scope="module")
def in_backward_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Full fine-tuning with the optimizer step in backward (no clipping, accumulation 1)."""
    return reference_run(tmp_path_factory, RESUME_EVERY, **IN_BACKWARD)


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """QLoRA (its 4-bit base sharded in bf16 storage) resharded after the forward pass."""
    return reference_run(tmp_path_factory, RESUME_EVERY, **QLORA)


@pytest.fixture(scope="module")
def eight_bit_run(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """bf16 parameters, paged 8-bit AdamW per parameter stepped in the backward pass."""
    return reference_run(tmp_path_factory, RESUME_EVERY, **EIGHT_BIT)


RESHARDABLE = {
    "full": ("full_run", FULL),
    "in-backward": ("in_backward_run", IN_BACKWARD),
    "qlora": ("qlora_run", QLORA),
}
"""A reference run's fixture and options, by test id: runs whose checkpoints load into any world size."""
RUNS = {**RESHARDABLE, "8-bit-in-backward": ("eight_bit_run", EIGHT_BIT)}


def test_optimizer_in_backward_learns_as_an_unclipped_run_does(tmp_path: Path, in_backward_run: Reference) -> None:
    """Per-parameter AdamW steps in the backward pass compute what one AdamW over all parameters computes after
    it, clipping off: the same losses and final weights up to float rounding, with fp32 states in the
    checkpoint for every parameter."""
    output, losses, _, _ = in_backward_run
    assert_learned(losses, STEPS, margin=1.0)
    reference_output, reference, _ = train_ok(tmp_path, **{**FULL, "max_grad_norm": 0.0})
    assert all(abs(losses[s] - reference[s]) < 1e-3 for s in reference), (losses, reference)
    ours, theirs = (
        load_file(output / "final" / "model.safetensors"),
        load_file(reference_output / "final" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[n].float(), theirs[n].float(), atol=1e-2, rtol=0) for n in ours)
    dtypes = dcp_dtypes(output / "checkpoints" / "full-bf16-fsdp2" / f"step-{STEPS:06d}")
    params = {n for n in dtypes if n.startswith("model.")}
    moments = {n: d for n, d in dtypes.items() if n.endswith((".exp_avg", ".exp_avg_sq"))}
    assert params and len(moments) == 2 * len(params) and set(moments.values()) == {torch.float32}


def test_full_finetuning_learns_and_checkpoints_fp32_masters(full_run: Reference) -> None:
    output, losses, _, _ = full_run
    assert_learned(losses, STEPS, margin=1.0)
    weights = load_file(output / "final" / "model.safetensors")
    assert "lm_head.weight" in weights and {t.dtype for t in weights.values()} == {torch.bfloat16}
    checkpoints = output / "checkpoints" / "full-bf16-fsdp2"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000012", "step-000016"]
    # Rank 0's final progress, for the operator (a job can end before any read of its metrics).
    final = completed_progress((output.parent / "termination-log").read_text())
    assert final is not None and (final.step, final.total_steps, final.last_checkpoint_step) == (STEPS, STEPS, STEPS)
    written = marker(output, "full-bf16-fsdp2", STEPS)
    assert written["layout"] == LAYOUT
    assert written["dataShape"] == {"worldSize": 2, "microBatchSize": 2, "sequenceParallel": 1}
    dtypes = dcp_dtypes(checkpoints / "step-000016")
    params = {n: d for n, d in dtypes.items() if n.startswith("model.")}
    moments = {n: d for n, d in dtypes.items() if n.endswith((".exp_avg", ".exp_avg_sq"))}
    assert "model.lm_head.weight" in params and len(moments) == 2 * len(params)
    assert set(params.values()) == set(moments.values()) == {torch.float32}  # fp32 masters and states


@pytest.mark.parametrize(
    "options",
    [dict(offload=True), dict(stage=2, chunked_loss=True), dict(activation_offloading=True)],
    ids=["zero3-cpu-offload", "zero2-chunked-loss", "zero3-activation-offloading"],
)
def test_offload_and_zero2_with_chunked_loss_compute_the_same_losses(
    tmp_path: Path, full_run: Reference, options: dict[str, Any]
) -> None:
    """CPU offload moves where the sharded states live, reshard_after_forward False when parameters are
    gathered, the chunked loss how the head's logits are formed, activation offloading (with gradient
    checkpointing) where the layers' inputs wait: the losses stay the reference's."""
    _, reference, _, _ = full_run
    _, losses, stdout = train_ok(tmp_path, **{**FULL, **options})
    assert_learned(losses, STEPS, margin=1.0)
    assert all(abs(losses[s] - reference[s]) < 0.02 for s in (1, STEPS)), (losses, reference)
    if options.get("chunked_loss"):
        assert "loss: chunked cross-entropy (pytorch)" in stdout
    if options.get("activation_offloading"):
        assert f"the saved inputs of {TINY_LLAMA.num_layers} checkpointed layers wait in cpu memory" in stdout


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3-cpu-offload"])
def test_lora_learns_and_saves_only_the_adapter(tmp_path: Path, stage: int, method: str) -> None:
    output, losses, _ = train_ok(
        tmp_path, engine="fsdp2", method=method, stage=stage, offload=stage == 3, learning_rate=1e-2,
        max_steps=8, checkpoint_every=4,
    )  # fmt: skip
    assert_learned(losses, 8, margin=0.2)
    adapter = load_file(output / "final" / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert not (output / "final" / "model.safetensors").exists()
    dtypes = dcp_dtypes(output / "checkpoints" / f"{method}-bf16-fsdp2" / "step-000008")
    params = {n: d for n, d in dtypes.items() if n.startswith("model.")}
    assert params and all("lora_" in n for n in params)  # the frozen base is not in the checkpoint
    assert set(params.values()) == {torch.float32}  # fp32 masters of the adapters


def test_bf16_masters_keep_bf16_parameters_and_optimizer_states(tmp_path: Path) -> None:
    output, losses, _ = train_ok(tmp_path, **{**FULL, "stage": 2, "max_steps": 8, "master_weights": "bf16"})
    assert_learned(losses, 8, margin=0.5)
    weights = load_file(output / "final" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    dtypes = dcp_dtypes(output / "checkpoints" / "full-bf16-fsdp2-bf16masters" / "step-000008")
    states = {d for n, d in dtypes.items() if n.startswith("model.") or n.endswith((".exp_avg", ".exp_avg_sq"))}
    assert states == {torch.bfloat16}
    assert marker(output, "full-bf16-fsdp2-bf16masters", 8)["layout"] == {**LAYOUT, "masterWeights": "bf16"}


def test_8bit_adamw_in_backward_computes_what_its_step_after_backward_does(
    tmp_path: Path, eight_bit_run: Reference
) -> None:
    """bitsandbytes' kernel on each local shard, stepped from the hooks, is the same arithmetic per parameter
    as one 8-bit AdamW stepped after the backward: the same losses and bit-identical weights. The checkpoint
    holds 8-bit states (and their absmaxes) for shards of at least 4096 elements, fp32 ones below."""
    output, losses, _, _ = eight_bit_run
    assert_learned(losses, STEPS, margin=1.0)
    after_output, after, _ = train_ok(tmp_path, **{**EIGHT_BIT, "optimizer_in_backward": False})
    assert losses == after
    assert_same_final_weights(output, after_output)
    dtypes = dcp_dtypes(output / "checkpoints" / "full-bf16-fsdp2-bf16masters" / f"step-{STEPS:06d}")
    state = "optimizer.state.model.{}.weight.__bnb_optimizer_quant_state__.{}"
    for name in ("embed_tokens", "layers.0.mlp.up_proj"):  # shards of 129 x 64 and 64 x 64 elements
        assert {dtypes[state.format(name, s)] for s in ("state1", "state2")} == {torch.uint8}
        assert {dtypes[state.format(name, s)] for s in ("absmax1", "absmax2")} == {torch.float32}
    assert dtypes[state.format("layers.0.self_attn.q_proj", "state1")] == torch.float32  # 32 x 64: fp32 states
    assert state.format("layers.0.self_attn.q_proj", "absmax1") not in dtypes


def test_8bit_states_quantized_at_two_ranks_refuse_one_with_the_reason(
    tmp_path: Path, eight_bit_run: Reference
) -> None:
    """Their blocks are of each rank's shard: at another world size the run stops before training, with why.
    The one rank is a process of its own, without torchrun (a world of one: the same trainer, no launcher)."""
    output, _, _, _ = eight_bit_run
    one = make_config(tmp_path, **{**EIGHT_BIT, "max_steps": STEPS + 4}, world_size=1, micro_batch=4)
    shutil.copytree(output / "checkpoints", Path(one.output_dir) / "checkpoints")
    result = run_single_process(write_config(one, tmp_path / "one.json"))
    assert result.returncode != 0
    said = "8-bit optimizer states were quantized in blocks of 2 rank(s)' shards and do not reshard to 1"
    assert said in result.stdout + result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_killed_run_resumes_to_the_uninterrupted_result(
    tmp_path: Path, request: pytest.FixtureRequest, run: str
) -> None:
    fixture, options = RUNS[run]
    reference: Reference = request.getfixturevalue(fixture)
    reference_output, reference_losses, _, _ = reference
    config = reference.killed_copy(tmp_path, **options)  # also resumed at 1 rank below
    resumed = resume(write_config(config, tmp_path / "config.json"), RESUME_EVERY)
    assert logged_losses(resumed.stdout)[STEPS] == reference_losses[STEPS]
    assert_same_final_weights(config.output_dir, reference_output, FINAL_WEIGHTS[config.training.method])


@pytest.mark.parametrize("run", sorted(RESHARDABLE))
def test_checkpoint_of_two_ranks_resumes_on_one_at_the_same_step_and_data(
    tmp_path: Path, request: pytest.FixtureRequest, run: str
) -> None:
    """Killed after step 4 at 2 ranks x micro-batch 2 (16 blocks consumed: data position 4), resumed at 1 rank
    with the same global batch: 2 accumulated micro-batches (position 8 of 2-block micro-batches) or, with the
    optimizer in backward (accumulation 1), one micro-batch of 4 (position 4); the same blocks from there on,
    so it ends with the reference's data position and (up to reduction order) its loss. The one rank runs as a
    process of its own, without torchrun (a world of one: the same trainer, no launcher to import torch)."""
    fixture, options = RESHARDABLE[run]
    reference: Reference = request.getfixturevalue(fixture)
    reference_output, reference_losses, _, _ = reference
    micro_batches = 1 if options.get("optimizer_in_backward") else 2  # per step on one rank
    two = reference.killed_copy(tmp_path, **options)
    one = make_config(tmp_path, **options, world_size=1, accumulation=micro_batches, micro_batch=4 // micro_batches)
    assert one.checkpoint_dir == two.checkpoint_dir  # fsdp2's layout names no world size
    resumed = run_single_process(write_config(one, tmp_path / "one.json"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed_from(resumed.stdout) == RESUME_EVERY, resumed.stdout
    said = re.search(r"resumed from checkpoint step 4 \(data position (.*)\)$", resumed.stdout, re.MULTILINE)
    assert said is not None, resumed.stdout
    carried = " written at 2 rank(s) x micro-batch 2, here {'epoch': 0, 'microBatch': 8} (0 block(s) skipped)"
    carried = carried if micro_batches == 2 else ""  # the same blocks per step: the position carries as it is
    assert said.group(1) == "{'epoch': 0, 'microBatch': 4}" + carried
    final = marker(Path(one.output_dir), f"{two.training.method}-bf16-fsdp2", STEPS)
    reference = marker(reference_output, f"{two.training.method}-bf16-fsdp2", STEPS)
    assert final["dataShape"] == {"worldSize": 1, "microBatchSize": 4 // micro_batches, "sequenceParallel": 1}
    assert reference["dataPosition"] == {"epoch": 0, "microBatch": STEPS}  # 16 steps x 4 blocks
    assert final["dataPosition"] == {"epoch": 0, "microBatch": micro_batches * STEPS}  # of 4 // micro_batches blocks
    losses = logged_losses(resumed.stdout)
    assert STEPS in losses
    assert abs(losses[STEPS] - reference_losses[STEPS]) < 0.02, (losses, reference_losses)
