"""The validation loss (memfit_trainer.validation): the held-out split, its batches, one evaluation, and
whole runs with it, which must end with exactly the weights they would have reached without it."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from memfit.contract.reader import ConfigError
from memfit.contract.sections import ValidationConfig, VolumesConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.blocks import IGNORE_INDEX
from memfit_trainer.chunked_loss import shift_labels
from memfit_trainer.data import BatchShape, DataError, DatasetTooSmallError, DataSource, load_records
from memfit_trainer.model import build_model
from memfit_trainer.preflight import check
from memfit_trainer.tokenizer import byte_level_tokenizer
from memfit_trainer.validation import (
    HeldOut,
    Validation,
    one_pass,
    split_records,
    training_and_validation,
)
from tests.trainer.runs import (
    assert_same_final_weights,
    logged_losses,
    make_config,
    run_trainer,
    uninterrupted_and_resumed,
    write_config,
    write_corpus,
)
from tests.trainer.test_training import RESUME_EVERY

VALIDATION_LINE = re.compile(r"^validation step (\d+)/(\d+) loss ([0-9.]+) tokens (\d+)", re.MULTILINE)
MARKER = re.compile(r"<(\d{4})>")


def numbered_corpus(path: Path, records: int = 200) -> Path:
    """Records whose text names them (``<0042>`` repeated), so that a block tells which records it holds."""
    with path.open("w") as f:
        for i in range(records):
            f.write(json.dumps({"text": f"<{i:04d}> " * 6}) + "\n")
    return path


def record_numbers(ids: torch.Tensor) -> set[int]:
    """The records whose marker appears whole in these token ids (byte-level tokenizer: id == byte value)."""
    text = bytes(int(i) for i in ids.reshape(-1) if int(i) < 256).decode("latin-1")
    return {int(m) for m in MARKER.findall(text)}


def shape(rank: int = 0, world_size: int = 1, micro_batch_size: int = 2) -> BatchShape:
    return BatchShape(sequence_length=64, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=3)


def one_epoch_ids(held_out: HeldOut) -> list[torch.Tensor]:
    return [batch["input_ids"] for batch in one_pass(held_out.batches)]


# --- the split ------------------------------------------------------------------------------------------


def test_split_is_drawn_by_the_seed_and_disjoint() -> None:
    records = Dataset.from_list([{"text": str(i)} for i in range(100)])
    kept, held = split_records(records, 0.1, seed=7)
    again_kept, again_held = split_records(records, 0.1, seed=7)
    assert held["text"] == again_held["text"] and kept["text"] == again_kept["text"]
    assert len(held) == 10 and len(kept) == 90
    assert set(held["text"]).isdisjoint(kept["text"]) and set(held["text"]) | set(kept["text"]) == set(records["text"])
    assert held["text"] != list(map(str, range(10)))  # drawn, not the first records
    assert set(split_records(records, 0.1, seed=8)[1]["text"]) != set(held["text"])


@pytest.mark.parametrize("fraction", [0.001, 0.999])
def test_a_fraction_that_leaves_a_side_empty_is_refused(fraction: float) -> None:
    with pytest.raises(DataError, match=r"validation.fraction .* of 100 record\(s\) holds out"):
        split_records(Dataset.from_list([{"text": str(i)} for i in range(100)]), fraction, seed=0)


def test_held_out_records_are_never_trained_on_and_the_same_at_any_world_size(tmp_path: Path) -> None:
    source = DataSource(path=str(numbered_corpus(tmp_path / "corpus.jsonl")), text_field="text")
    validation = ValidationConfig(fraction=0.2, every_steps=5)
    _, expected = split_records(load_records(source), 0.2, seed=3)
    held_numbers = {int(MARKER.search(text).group(1)) for text in expected["text"]}  # type: ignore[union-attr]

    training, one = training_and_validation(source, byte_level_tokenizer(), validation, shape())
    assert one is not None and one.every_steps == 5
    trained = set().union(*(record_numbers(block[0]) for block in training.blocks()))
    assert trained and trained.isdisjoint(held_numbers)
    alone = one_epoch_ids(one)
    assert set().union(*map(record_numbers, alone)) <= held_numbers

    # Two ranks: each its own slice of every global step, unshuffled, the same blocks in the same order.
    ranks = [training_and_validation(source, byte_level_tokenizer(), validation, shape(r, 2))[1] for r in (0, 1)]
    steps = [one_epoch_ids(held) for held in ranks if held is not None]
    together = [torch.cat(pair) for pair in zip(*steps, strict=True)]
    assert len(together) >= 1
    assert torch.equal(torch.cat(together), torch.cat(alone)[: 4 * len(together)])


def test_validation_files_of_their_own(tmp_path: Path) -> None:
    source = DataSource(path=str(numbered_corpus(tmp_path / "train.jsonl")), text_field="text")
    own = numbered_corpus(tmp_path / "validation.jsonl", records=40)
    training, held = training_and_validation(source, byte_level_tokenizer(), ValidationConfig(path=str(own)), shape())
    assert held is not None and held.batches.source.path == str(own) and not held.batches.shuffle
    assert training.source.path == source.path
    assert set().union(*map(record_numbers, one_epoch_ids(held))) <= set(range(40))


def test_missing_validation_files_are_a_data_error_naming_the_field(tmp_path: Path) -> None:
    source = DataSource(path=str(numbered_corpus(tmp_path / "train.jsonl")), text_field="text")
    missing = ValidationConfig(path=str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(DataError, match=r"^data.validation.path: dataset path .*nowhere.jsonl.* does not exist"):
        training_and_validation(source, byte_level_tokenizer(), missing, shape())


def test_validation_files_leading_out_of_the_data_volume_are_refused(tmp_path: Path) -> None:
    volume, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    volume.mkdir()
    elsewhere.mkdir()
    (volume / "validation").symlink_to(elsewhere)
    config = make_config(tmp_path, data=numbered_corpus(volume / "train.jsonl"))
    config = with_validation(config, ValidationConfig(path=str(volume / "validation")))
    config = config.model_copy(update={"volumes": VolumesConfig(data=str(volume), output=str(tmp_path))})
    with pytest.raises(ConfigError, match=r"^data.validation.path .* outside its volume"):
        check(config, {"WORLD_SIZE": "2"})


def test_validation_data_too_small_for_one_step_says_so(tmp_path: Path) -> None:
    source = DataSource(path=str(numbered_corpus(tmp_path / "corpus.jsonl", records=40)), text_field="text")
    with pytest.raises(DatasetTooSmallError, match=r"^the validation data \(validation.fraction 0.05 of"):
        training_and_validation(source, byte_level_tokenizer(), ValidationConfig(fraction=0.05), shape(0, 1, 4))


# --- one evaluation -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_evaluation_is_the_mean_over_target_tokens_and_leaves_the_model_and_rng_alone(tmp_path: Path) -> None:
    config = make_config(tmp_path, method="lora", data=numbered_corpus(tmp_path / "corpus.jsonl"))
    model = build_model(config).model
    model.train()
    source = DataSource(path=config.data.path, text_field="text")
    _, held = training_and_validation(source, byte_level_tokenizer(), ValidationConfig(fraction=0.2), shape())
    assert held is not None
    modes: list[bool] = []

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        modes.append(model.training)
        torch.rand(())  # were the evaluation to draw from the training's stream, this would move it
        return model(**batch).loss  # type: ignore[no-any-return]

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    result = Validation(held, model, loss_of, torch.device("cpu")).evaluate(step=5)

    assert modes and not any(modes)  # eval mode throughout
    assert model.training and all(m.training for m in model.modules())  # and train mode again after
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())

    # The definition, computed another way: every target token of every batch in one cross-entropy sum.
    total, targets = 0.0, 0
    model.eval()
    with torch.no_grad():
        for _, batch in itertools.islice(held.batches.iterate(), held.batches.micro_batches_per_epoch):
            labels = shift_labels(batch["labels"])
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()  # fmt: skip
            targets += int((labels != IGNORE_INDEX).sum())
    assert result.step == 5 and result.tokens == targets > 0
    assert result.loss == pytest.approx(total / targets, rel=1e-4)


# --- whole runs (2 CPU ranks under torchrun) ------------------------------------------------------------

STEPS, EVERY = 12, 3


def with_validation(config: TrainerConfig, validation: ValidationConfig | None) -> TrainerConfig:
    return config.model_copy(update={"data": config.data.model_copy(update={"validation": validation})})


def validation_lines(stdout: str) -> dict[int, tuple[float, int]]:
    return {int(m.group(1)): (float(m.group(3)), int(m.group(4))) for m in VALIDATION_LINE.finditer(stdout)}


def run_ok(config: TrainerConfig, path: Path) -> str:
    result = run_trainer(write_config(config, path))
    assert result.returncode == 0, result.stderr[-4000:]
    return str(result.stdout)


@pytest.mark.distributed
def test_a_run_with_validation_ends_with_the_weights_of_one_without(tmp_path: Path) -> None:
    """LoRA with dropout (the training draws random numbers): validating every 3 steps and at the end changes
    neither the weights nor the random stream; the reference trains on exactly the records the split kept."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    options = dict(method="lora", learning_rate=1e-2, max_steps=STEPS, checkpoint_every=RESUME_EVERY, data=corpus)
    validated = with_validation(make_config(tmp_path, name="validated", **options),  # type: ignore[arg-type]
                                ValidationConfig(fraction=0.1, every_steps=EVERY))  # fmt: skip
    lora = validated.training.lora.model_copy(update={"dropout": 0.1})
    validated = validated.model_copy(update={"training": validated.training.model_copy(update={"lora": lora})})
    stdout = run_ok(validated, tmp_path / "validated.json")
    losses = validation_lines(stdout)
    assert sorted(losses) == [3, 6, 9, 12]
    assert losses[12][0] < losses[3][0]  # it learns, and the validation loss says so
    assert len({tokens for _, tokens in losses.values()}) == 1  # the same held-out tokens every time
    progress = json.loads(Path(validated.metrics.progress_file or "").read_text())
    assert (progress["validationStep"], progress["validationLoss"]) == (12, pytest.approx(losses[12][0], abs=1e-4))

    kept, _ = split_records(load_records(DataSource(path=str(corpus), text_field="text")), 0.1, validated.training.seed)
    kept.to_json(tmp_path / "kept.jsonl", lines=True)
    reference = validated.model_copy(update={
        "data": validated.data.model_copy(update={"path": str(tmp_path / "kept.jsonl"), "validation": None}),
        "output_dir": str(tmp_path / "reference" / "output"),
    })  # fmt: skip
    reference_stdout = run_ok(reference, tmp_path / "reference.json")
    assert not validation_lines(reference_stdout)
    assert logged_losses(reference_stdout)[STEPS] == logged_losses(stdout)[STEPS]
    assert_same_final_weights(validated.output_dir, reference.output_dir, weights="adapter_model.safetensors")


@pytest.mark.distributed
def test_fsdp2_with_the_chunked_loss_validates_and_resumes_bit_identically(tmp_path: Path) -> None:
    """The other engine and the other loss: a run killed after its first checkpoint and resumed reports the
    same validation losses and ends with the same weights as the uninterrupted run."""
    options = dict(engine="fsdp2", stage=2, offload=False, chunked_loss=True, max_steps=STEPS,
                   checkpoint_every=RESUME_EVERY, data=write_corpus(tmp_path / "corpus.jsonl"))  # fmt: skip
    validation = ValidationConfig(fraction=0.1, every_steps=EVERY)
    uninterrupted, killed = (
        with_validation(make_config(tmp_path / name, **options), validation)  # type: ignore[arg-type]
        for name in ("uninterrupted", "killed")
    )
    done, resumed = uninterrupted_and_resumed(uninterrupted, killed, RESUME_EVERY)
    expected = validation_lines(done.stdout)
    assert sorted(expected) == [3, 6, 9, 12]
    after = validation_lines(resumed.stdout)
    assert sorted(after) == [6, 9, 12] and all(after[step] == expected[step] for step in after)
    assert_same_final_weights(killed.output_dir, uninterrupted.output_dir)
