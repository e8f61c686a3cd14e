"""Ulysses sequence parallelism (memfit_trainer.sequence_parallel) equals the unsplit model.

Unit tests: the batch sharding (padding, labels shifted before slicing, positions of unpacked rows, flash's
boundaries), the refusals, the data position's blocks per step. Two gloo CPU ranks in one spawn (SP 2, one data
rank): the tiny llama's loss of packed documents (a boundary inside a chunk, one at the chunk's edge) and of
right-padded unpacked rows, split against unsplit, within 1e-6, and the group's summed gradients within 1e-5 of
the unsplit ones, full and LoRA; then through the trainer's engines (DeepSpeed ZeRO-1 with the groups as ``mpu``,
DeepSpeed ZeRO-3 built partitioned with the chunked loss in the LM head, fsdp2 with its divide factor) one
optimizer step: the loss, the gradient norm before clipping (a factor of sp shows there) and the weights after the
step equal the unsplit model's under the same AdamW step.

End to end (torchrun, fp32): ``memfit-train`` at SP 2 on 2 ranks logs the losses of 1 unsplit rank, on DeepSpeed
and fsdp2; on DeepSpeed a run killed after a checkpoint resumes bit-identically at SP 2, and at SP 1 on the same
2 ranks (a change of degree keeps DeepSpeed's layout).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memfit.contract.engines import DeepSpeedEngineSection, Fsdp2EngineSection
from memfit.contract.sections import TrainingConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit.model_shape import ModelFamily
from memfit_trainer.blocks import IGNORE_INDEX
from memfit_trainer.chunked_loss import GROUP_TARGETS, SHIFT_LABELS, shift_labels
from memfit_trainer.resume import blocks_per_step
from memfit_trainer.sequence_parallel import config_problems, heads_problem, shard
from tests.trainer.runs import (
    TINY_LLAMA,
    assert_same_final_weights,
    logged_losses,
    make_config,
    resume,
    run_single_process,
    run_trainer,
    run_with_a_copy_held_after,
    write_config,
)

SP = 2
LEARNING_RATE = 1e-3
MAX_GRAD_NORM = 1.0


def _config(
    tmp_path: Path, *, engine: str = "deepspeed", method: str = "full", micro_batch: int = 2, data_ranks: int = 1,
    stage: int = 1, **training: Any,
) -> TrainerConfig:  # fmt: skip
    """The tiny llama in fp32 on ``data_ranks`` groups of SP ranks (``sequence_parallel`` in ``training``, else
    SP); DeepSpeed ZeRO-``stage`` (its batch sizes count data ranks) or fsdp2, no offload."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = {key: training.pop(key) for key in ("max_steps", "checkpoint_every", "name") if key in training}
    config = make_config(tmp_path, engine=engine, method=method, offload=False, stage=stage,
                         max_grad_norm=MAX_GRAD_NORM, learning_rate=LEARNING_RATE, **run)  # fmt: skip
    section: DeepSpeedEngineSection | Fsdp2EngineSection = config.engine  # type: ignore[assignment]
    if engine == "deepspeed":
        ds = {key: value for key, value in config.engine.config.items() if key != "bf16"}  # type: ignore[union-attr]
        ds.update(train_micro_batch_size_per_gpu=micro_batch, train_batch_size=micro_batch * data_ranks)
        section = DeepSpeedEngineSection(config=ds)
    batch = {"micro_batch_size": micro_batch, "global_batch_size": micro_batch * data_ranks}
    fields = {**config.training.model_dump(), "precision": "fp32", "sequence_parallel": SP, **batch, **training}
    return config.model_copy(update={"training": TrainingConfig.model_validate(fields), "engine": section})


# --- the batch's sharding -------------------------------------------------------------------------------


def _packed(lengths: list[list[int]]) -> dict[str, torch.Tensor]:
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids = torch.randint(3, 250, positions.shape, generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[positions == 0] = IGNORE_INDEX  # each document's first token is not a target
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_shard_shifts_before_slicing_and_the_chunks_rebuild_the_batch() -> None:
    batch = _packed([[20, 12, 32], [40, 24]])
    chunks = [shard(batch, rank, SP) for rank in range(SP)]
    for name in ("input_ids", "position_ids"):
        assert torch.equal(torch.cat([c[name] for c in chunks], dim=1), batch[name])
    shifted = torch.cat([c[SHIFT_LABELS] for c in chunks], dim=1)
    assert torch.equal(shifted, shift_labels(batch["labels"]))
    assert chunks[0][SHIFT_LABELS][0, -1] == batch["labels"][0, 32]  # a chunk's last token predicts the next's first
    assert all(torch.equal(c["labels"], c[SHIFT_LABELS]) for c in chunks)
    targets = int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
    assert [int(c[GROUP_TARGETS]) for c in chunks] == [targets, targets]


def test_shard_pads_to_a_multiple_continuing_the_last_document() -> None:
    batch = _packed([[10, 23], [33]])  # 33 tokens over 2 ranks: one padding token
    chunks = [shard(batch, rank, SP) for rank in range(SP)]
    assert [c["input_ids"].shape[1] for c in chunks] == [17, 17]
    positions = torch.cat([c["position_ids"] for c in chunks], dim=1)
    assert positions[:, -1].tolist() == [23, 33]  # no new document: nothing attends to the padding
    shifted = torch.cat([c[SHIFT_LABELS] for c in chunks], dim=1)
    assert shifted[:, -2:].eq(IGNORE_INDEX).all()
    assert torch.equal(shifted[:, :-1], shift_labels(batch["labels"]))


def test_shard_gives_unpacked_rows_positions_and_drops_their_mask() -> None:
    ids = torch.arange(12).reshape(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    chunks = [shard({"input_ids": ids, "labels": labels, "attention_mask": mask}, rank, SP) for rank in range(SP)]
    assert all("attention_mask" not in c for c in chunks)
    assert torch.equal(torch.cat([c["position_ids"] for c in chunks], dim=1), torch.arange(6).expand(2, 6))
    assert int(chunks[1][GROUP_TARGETS]) == 5 + 2


def test_shard_gives_flash_the_whole_padded_sequence_boundaries() -> None:
    from memfit_trainer.data import flash_varlen_kwargs

    batch = _packed([[5, 10], [15]])
    chunk = shard({**batch, **flash_varlen_kwargs(batch["position_ids"])}, 1, SP)
    assert chunk["cu_seq_lens_q"].tolist() == [0, 5, 16, 32]  # rows padded to 16
    assert chunk["max_length_q"] == 16


# --- refusals and bookkeeping -------------------------------------------------------------------------


def test_what_sequence_parallelism_cannot_run_with_is_refused(tmp_path: Path) -> None:
    assert config_problems(_config(tmp_path)) == []
    assert config_problems(_config(tmp_path, sequence_parallel=1, attention="eager")) == []
    for attention in ("eager", "flex"):
        [problem] = config_problems(_config(tmp_path, attention=attention))
        assert f"needs sdpa or flash attention, not {attention}" in problem
    in_backward = _config(tmp_path).model_copy(
        update={"engine": Fsdp2EngineSection(optimizer_in_backward=True, reduce_dtype="fp32")}
    )
    assert any("optimizerInBackward" in p for p in config_problems(in_backward))
    assert any("qlora" in p for p in config_problems(_config(tmp_path, method="qlora", precision="bf16")))


@pytest.mark.parametrize(
    ("sp", "heads", "kv", "splits"),
    [(2, 4, 2, True), (4, 4, 2, True), (8, 8, 2, True), (4, 4, 3, False), (3, 4, 4, False), (1, 3, 3, True)],
)
def test_heads_must_split_over_the_group(sp: int, heads: int, kv: int, splits: bool) -> None:
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=heads * 16, num_attention_heads=heads, num_key_value_heads=kv)
    assert (heads_problem(sp, hf) is None) == splits


def test_a_step_takes_one_micro_batch_per_data_rank() -> None:
    assert blocks_per_step({"worldSize": 4, "microBatchSize": 2}) == 8  # markers from before sequence parallelism
    assert blocks_per_step({"worldSize": 4, "microBatchSize": 2, "sequenceParallel": 2}) == 4


def test_a_rank_counts_its_share_of_each_sequence(tmp_path: Path) -> None:
    """The samples and tokens metrics, summed over the ranks, count each sequence once."""
    from memfit_trainer.loop import rank_share

    split = _config(tmp_path / "split", micro_batch=2, gradient_accumulation_steps=3)
    assert rank_share(split.training) == (3.0, 3 * split.training.sequence_length)  # 6 sequences over 2 ranks
    unsplit = _config(tmp_path / "unsplit", micro_batch=2, sequence_parallel=1, gradient_accumulation_steps=3)
    assert rank_share(unsplit.training) == (6.0, 6 * unsplit.training.sequence_length)


def test_the_ranks_of_a_group_build_the_same_batches(tmp_path: Path) -> None:
    from memfit_trainer.model import build_tokenizer
    from memfit_trainer.validation import config_data

    config = _config(tmp_path)
    tokenizer = build_tokenizer(config)
    first, second = (config_data(config, tokenizer, rank, SP)[0] for rank in range(SP))
    assert first.blocks_per_step == config.training.micro_batch_size
    (_, a), (_, b) = next(first.iterate()), next(second.iterate())
    assert all(torch.equal(a[name], b[name]) for name in a)


# --- 2 ranks: split against unsplit --------------------------------------------------------------------


def _reference(model: Any) -> Any:
    """A copy of ``model`` on transformers' own SDPA (its packed path builds the document mask itself)."""
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "sdpa"
    return reference


def _tied(config: TrainerConfig) -> TrainerConfig:
    """The tiny model as Qwen2 with the LM head's weight the embedding's (one parameter, two modules)."""
    shape = replace(TINY_LLAMA, family=ModelFamily.QWEN2, tie_word_embeddings=True)
    return config.model_copy(update={"model": config.model.model_copy(update={"architecture": shape})})


def _partitioned(config: TrainerConfig) -> bool:
    return isinstance(config.engine, DeepSpeedEngineSection) and config.engine.zero_stage == 3


def _whole(model: Any) -> Any:
    """Gathers the weights of a model ZeRO-3 built partitioned (a no-op for any other)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def _unsplit_reference(config: TrainerConfig, model: Any) -> Any:
    """:func:`_reference` of ``model`` partitioned by ZeRO-3: its weights gathered into a model built whole."""
    from memfit_trainer.model import build_model

    with _whole(model):
        weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    whole = build_model(config.model_copy(update={"engine": Fsdp2EngineSection()})).model
    whole.load_state_dict(weights)
    return _reference(whole)


def _trainable(model: Any) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _unpacked() -> dict[str, torch.Tensor]:
    """Right-padded rows of an odd length (padded for the split too)."""
    ids = torch.randint(3, 250, (2, 61), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX), "attention_mask": mask}


def _gradient_errors(config: TrainerConfig, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Split against unsplit without an engine: the loss, and the group's summed gradients."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from memfit_trainer.model import build_model
    from memfit_trainer.sequence_parallel import prepare, sequence_mean

    model = build_model(config).model
    reference = _reference(model)
    expected = reference(**batch).loss
    expected.backward()
    prepare(config, model)
    group, rank = parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp.get_sequence_parallel_rank()
    loss = sequence_mean(model(**shard(batch, rank, SP)).loss, group)
    loss.backward()
    worst = 0.0
    references = _trainable(reference)
    for name, param in _trainable(model).items():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        scale = references[name].grad.abs().max().item() + 1e-12
        worst = max(worst, (grad - references[name].grad).abs().max().item() / scale)
    return {"loss": abs(loss.item() / expected.item() - 1), "gradient": worst}


def _engine_step(config: TrainerConfig, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """One optimizer step of the trainer's engine against the unsplit model's AdamW step: the loss, the gradient
    norm (before clipping) and the weights after it."""
    from memfit_trainer import chunked_loss, sequence_parallel
    from memfit_trainer.engine import build_engine
    from memfit_trainer.loop import _model_loss
    from memfit_trainer.model import build_model
    from memfit_trainer.run import Ranks, Run

    model = build_model(config).model
    reference = None if _partitioned(config) else _reference(model)
    engine = build_engine(config, model, 10)
    if reference is None:  # the weights the engine holds: ZeRO-3 took rank 0's adapters
        reference = _unsplit_reference(config, engine.module)
    expected = reference(**batch).loss
    expected.backward()
    params = list(_trainable(reference).values())
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM).item()
    torch.optim.AdamW(params, lr=engine.learning_rate, weight_decay=0.0).step()  # the schedule's first rate
    run = Run(config, Ranks(dist.get_rank(), 0, SP), engine, None, None)  # type: ignore[arg-type]
    chunked = chunked_loss.install(run)
    installed = sequence_parallel.install(run)
    assert installed is not None and installed.around is not None
    loss = installed.around(chunked.loss if chunked is not None and chunked.loss else _model_loss(engine))(batch)
    engine.backward(loss)
    engine.step()
    from memfit_trainer.fsdp2_engine import Fsdp2Engine

    worst = 0.0
    references = _trainable(reference)
    with _whole(engine.module) if _partitioned(config) else contextlib.nullcontext():
        for name, param in _trainable(engine.module).items():
            value = param.full_tensor() if isinstance(engine, Fsdp2Engine) else param  # type: ignore[attr-defined]
            worst = max(worst, (value.detach() - references[name].detach()).abs().max().item())
    assert engine.last_grad_norm is not None
    return {
        "loss": abs(loss.item() / expected.item() - 1),
        "norm": abs(engine.last_grad_norm - norm) / norm,
        "weights": worst,
    }


def _rank(rank: int, directory: Path) -> None:
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(SP))  # as torchrun sets them
    dist.init_process_group("gloo", init_method=f"file://{directory / 'store'}", rank=rank, world_size=SP)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}

    def own(name: str) -> Path:  # each rank's (the configs write their corpus)
        return directory / f"rank{rank}" / name

    try:
        packed = _packed([[20, 12, 32], [40, 24]])  # boundaries inside chunk 0 and 1, one at the chunk edge
        for method in ("full", "lora"):
            config = _config(own(method), method=method)
            results[f"{method} packed"] = _gradient_errors(config, packed)
        results["full unpacked"] = _gradient_errors(_config(own("unpacked")), _unpacked())
        for engine in ("deepspeed", "fsdp2"):
            for method in ("full", "lora"):
                config = _config(own(f"{engine}-{method}"), engine=engine, method=method,
                                 chunked_loss=engine == "fsdp2" and method == "full")  # fmt: skip
                results[f"{engine} {method}"] = _engine_step(config, packed)
        for method, tied in (("full", False), ("lora", False), ("full", True)):  # last: ZeRO-3 builds partitioned
            case = f"deepspeed zero3 chunked-loss {method}{' tied' if tied else ''}"
            zero3 = _config(own(case.replace(" ", "-")), stage=3, method=method, chunked_loss=True)
            results[case] = _engine_step(_tied(zero3) if tied else zero3, packed)
        (directory / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_split_over_two_ranks_equals_the_unsplit_model(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(tmp_path,), nprocs=SP, start_method="spawn")  # type: ignore[no-untyped-call]
    for rank in range(SP):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, errors in results.items():
            assert errors["loss"] < 1e-6, (rank, case, errors)  # relative (NaN fails too)
            assert errors.get("gradient", 0.0) < 1e-5, (rank, case, errors)  # relative to the largest
            assert errors.get("norm", 0.0) < 1e-5, (rank, case, errors)  # relative: a factor of sp is 0.5 or 1
            assert errors.get("weights", 0.0) < 5e-6, (rank, case, errors)  # AdamW's first step moved each by 5e-4


# --- memfit-train end to end ---------------------------------------------------------------------------

STEPS, HELD = 6, 3


def _losses_match(split: dict[int, float], unsplit: dict[int, float]) -> None:
    assert split.keys() == unsplit.keys() and STEPS in split  # the console says some steps when not a terminal
    assert all(abs(split[step] - unsplit[step]) <= 1e-4 for step in unsplit), (split, unsplit)  # 4 decimals logged


@pytest.mark.distributed
def test_deepspeed_run_split_equals_unsplit_resumes_bit_identical_and_across_a_degree_change(tmp_path: Path) -> None:
    """One rank unsplit; two ranks as one SP group, held after step 3 and copied (what a kill there leaves); the
    copy resumed at SP 2 ends bit-identical; another resumed at SP 1 on the same two ranks (two data ranks of one
    row each: the same blocks per step, DeepSpeed's partitions over the same two ranks) goes on from step 3."""
    options: dict[str, Any] = {"max_steps": STEPS, "checkpoint_every": HELD, "name": "sp"}
    unsplit = _config(tmp_path / "unsplit", sequence_parallel=1, **options)
    done = run_single_process(write_config(unsplit, tmp_path / "unsplit" / "config.json"))
    assert done.returncode == 0, done.stderr[-4000:]
    reference, killed = (_config(tmp_path / name, **options) for name in ("reference", "killed"))
    split = run_with_a_copy_held_after(
        reference, write_config(reference, tmp_path / "reference" / "config.json"), HELD, tmp_path / "killed"
    )
    assert split.returncode == 0, split.stderr[-4000:]
    assert "sequence parallel: each sequence split over 2 ranks" in split.stdout
    _losses_match(logged_losses(split.stdout), logged_losses(done.stdout))
    shutil.copytree(tmp_path / "killed" / "sp", tmp_path / "degree" / "sp")  # the kill, twice
    resume(write_config(killed, tmp_path / "killed" / "config.json"), HELD)
    assert_same_final_weights(reference.output_dir, killed.output_dir)

    degree = _config(tmp_path / "degree", sequence_parallel=1, micro_batch=1, data_ranks=2, **options)
    assert degree.layout == reference.layout
    changed = resume(write_config(degree, tmp_path / "degree" / "config.json"), HELD)
    assert "data position" in changed.stdout and STEPS in logged_losses(changed.stdout)


@pytest.mark.distributed
def test_fsdp2_run_split_equals_unsplit(tmp_path: Path) -> None:
    options: dict[str, Any] = {"engine": "fsdp2", "max_steps": STEPS, "checkpoint_every": STEPS}
    unsplit = _config(tmp_path / "unsplit", sequence_parallel=1, **options)
    split = _config(tmp_path / "split", **options)
    done = run_single_process(write_config(unsplit, tmp_path / "unsplit.json"))
    assert done.returncode == 0, done.stderr[-4000:]
    ran = run_trainer(write_config(split, tmp_path / "split.json"))
    assert ran.returncode == 0, ran.stderr[-4000:]
    _losses_match(logged_losses(ran.stdout), logged_losses(done.stdout))
