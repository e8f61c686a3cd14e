"""``memfit_trainer.launch_check``: the trainer's start-up refusals (tokenizer, model config, data too small for
one micro-batch per rank) found in one process before torchrun starts the ranks, as the trainer says them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.contract.reader import ConfigError
from memfit.contract.sections import ModelConfig, ValidationConfig
from memfit.contract.trainer_config import TrainerConfig
from memfit_trainer.data import DataError, DatasetTooSmallError
from memfit_trainer.launch_check import launch_check
from memfit_trainer.tokenizer import byte_level_tokenizer
from tests.trainer.runs import make_config, trainer_env, write_config, write_corpus


def with_data(config: TrainerConfig, **data: object) -> TrainerConfig:
    return config.model_copy(update={"data": config.data.model_copy(update=data)})


def test_a_runnable_config_passes(tmp_path: Path) -> None:
    launch_check(make_config(tmp_path))


def test_one_micro_batch_per_rank_of_the_plan(tmp_path: Path) -> None:
    """Four records are 5 blocks of 64 tokens: a micro-batch of 2 blocks for each of 2 ranks, not of 3 (the
    plan's world size counts, not this one process's)."""
    corpus = write_corpus(tmp_path / "small.jsonl", records=4)
    launch_check(make_config(tmp_path, data=corpus, world_size=2))
    with pytest.raises(DatasetTooSmallError) as refused:
        launch_check(make_config(tmp_path, data=corpus, world_size=3))
    assert str(refused.value).startswith(f"dataset {str(corpus)!r} is too small: one micro-batch on each of 3 rank")


def test_the_validation_data_too_small_is_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    held_out = write_corpus(tmp_path / "validation.jsonl", records=1)
    config = with_data(config, validation=ValidationConfig(path=str(held_out), every_steps=10))
    with pytest.raises(
        DatasetTooSmallError, match=rf"^the validation data \({re.escape(str(held_out))}\): dataset .* too small"
    ):
        launch_check(config)


def test_a_streamed_dataset_is_not_read_ahead(tmp_path: Path) -> None:
    """The trainer cannot know a stream's epoch length before training, so the check does not either."""
    config = make_config(tmp_path, data=write_corpus(tmp_path / "small.jsonl", records=1))
    launch_check(with_data(config, streaming=True))


def test_a_data_directory_without_data_files_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match=r"^data.path: no data files .* under"):
        launch_check(make_config(tmp_path, data=tmp_path / "data"))


def test_a_hub_model_offline_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own tokenizer on disk, its config only on the Hub: the config's read fails at once, in one line."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    config = make_config(tmp_path)
    model = ModelConfig(name_or_path="memfit-test/no-such-model", tokenizer=str(tmp_path / "tokenizer"))
    with pytest.raises(ConfigError) as refused:
        launch_check(config.model_copy(update={"model": model}))
    assert str(refused.value).startswith(
        "cannot read the model's config: 'memfit-test/no-such-model' is not a local path and is not in the local "
        "hub cache (offline mode)"
    )
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_refusal_is_the_trainers_one_line_and_exit_2(tmp_path: Path) -> None:
    """What datasets says while failing to parse a file (its progress bars, its own error log) is not said."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": broken\n')
    config = make_config(tmp_path, data=broken)
    done = subprocess.run(
        [sys.executable, "-m", "memfit_trainer.launch_check", "--config",
         str(write_config(config, tmp_path / "config.json"))],
        env=trainer_env(HF_HOME=str(tmp_path / "hf")), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"memfit-train: {broken}:2: record: invalid JSON: Expecting value "
                                        "(column 10)"], done.stderr  # fmt: skip
    assert not Path(config.termination_log).exists()  # no pod: no termination message
