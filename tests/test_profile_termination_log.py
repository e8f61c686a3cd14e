"""``python -m memfit_trainer.profile ... --termination-log FILE``, as the operator's profiling pod runs it: the
profile, encoded, in the file (memfit.contract.profile_message), or the one-line refusal as a ConfigError
termination message (memfit.contract.termination)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.contract.profile_message import decode_profile_message
from memfit.contract.termination import config_error_message
from memfit.profile import ModelProfile
from memfit_trainer import profile as profiler
from tests.trainer.new_families import tiny_config


@pytest.mark.slow  # profiles a model: about 9 s
def test_the_profile_goes_to_the_termination_log_encoded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(tiny_config("qwen3_moe").to_json_string(), encoding="utf-8")
    log = tmp_path / "termination-log"
    argv = [str(model), "--activations", "--lora-targets", "q_proj,v_proj", "--termination-log", str(log)]
    assert profiler.main(argv) == 0
    printed = ModelProfile.model_validate_json(capsys.readouterr().out)
    message = log.read_text(encoding="ascii")
    assert len(message.encode()) <= 4096
    decoded = decode_profile_message(message)
    assert decoded == printed and decoded.activations is not None and decoded.model_type == "qwen3_moe"
    assert [r.target_modules for r in decoded.lora] == ["all-linear", ("q_proj", "v_proj")]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (None, "no config.json in this directory"),
        ({"model_type": 7}, "no model_type"),
    ],
)
def test_bad_input_is_a_config_error_message_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object] | None, says: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    log = tmp_path / "termination-log"
    assert profiler.main([str(model), "--activations", "--termination-log", str(log)]) == 2
    message = config_error_message(log)
    assert message is not None and says in message and "\n" not in message
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_hub_model_offline_is_a_one_line_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    log = tmp_path / "termination-log"
    assert profiler.main(["someone/no-such-model", "--hub", "--activations", "--termination-log", str(log)]) == 2
    message = config_error_message(log)
    assert message is not None and message.startswith("someone/no-such-model: cannot reach the Hub")


def test_a_profile_too_large_for_a_termination_message_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(tiny_config("qwen3").to_json_string(), encoding="utf-8")
    monkeypatch.setattr("memfit.contract.profile_message.MAX_TERMINATION_MESSAGE_BYTES", 100)
    log = tmp_path / "termination-log"
    assert profiler.main([str(model), "--termination-log", str(log)]) == 2
    message = config_error_message(log)
    assert message is not None and "more than the 100 bytes a termination message holds" in message
