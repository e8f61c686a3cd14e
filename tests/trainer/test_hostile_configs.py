"""``memfit-train --config`` refuses every invalid config the same way: exit 2, one ``memfit-train: ...``
line naming the problem, a ConfigError termination message, and no work at all (no traceback, which would
make the operator restart the job instead of failing it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import memfit_trainer.main as trainer_main
from memfit.api.vocabulary import TerminationReason
from memfit.contract.reader import load_config
from tests.trainer.hostile_configs import HOSTILE, Document, Hostile, materialise, valid_document
from tests.trainer.runs import trainer_env

SUBPROCESS_CASES = {
    "not-utf8", "nested-without-end", "integer-of-5000-digits", "zero-heads", "zero-section-a-list",
    "nul-in-output-dir", "fp16-and-bf16", "output-symlink-out-of-its-volume",
}  # fmt: skip
"""Cases that crashed the trainer with a traceback, and a few more, checked in a process of their own."""
ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}  # fmt: skip
WITH_DEFAULT_LOG = """import sys
import memfit_trainer.main as trainer
trainer.DEFAULT_TERMINATION_LOG = sys.argv.pop(1)
sys.exit(trainer.main(sys.argv[1:]))
"""
"""``memfit-train`` with the default termination log (the pod's /dev/termination-log) moved to argv[1]."""


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> Document:
    return valid_document(tmp_path_factory.mktemp("valid"))


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """memfit-train in this process as one rank of one, with ``run`` (the training) replaced by a recorder:
    reaching it means the config was accepted."""
    for name, value in {**ONE_RANK, "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(trainer_main, "DEFAULT_TERMINATION_LOG", str(tmp_path / "default-termination-log"))
    started: list[Any] = []
    monkeypatch.setattr(trainer_main, "run", lambda config: started.append(config) or 0)
    return started


def assert_refused(code: int, stderr: str, case: Hostile, directory: Path, default_log: Path) -> None:
    assert code == 2, f"{case.name}: exit {code}, not 2 (accepted or crashed):\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit-train: "), f"{case.name}: {stderr[-2000:]}"
    assert case.expect in lines[0], f"{case.name}: refused for another reason than {case.expect!r}: {lines[0]}"
    logs = [log for log in (directory / "termination-log", default_log) if log.exists()]
    assert len(logs) == 1, f"{case.name}: termination messages in {logs}"
    message = json.loads(logs[0].read_text())
    assert message["reason"] == TerminationReason.CONFIG_ERROR
    said, line = message["message"], lines[0].removeprefix("memfit-train: ")
    assert said == line or (said.endswith("...") and line.startswith(said[:-3])), (said, line)  # cut to 4 KiB


def test_the_corpus_is_large_and_its_cases_distinct() -> None:
    assert len(HOSTILE) >= 52
    assert len({case.name for case in HOSTILE}) == len(HOSTILE)


@pytest.mark.slow
def test_the_valid_config_loads_and_would_run(
    valid: Document, trainer: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The base of every case is runnable: each case is refused for its one change, not for the base."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**valid, "terminationLog": str(tmp_path / "termination-log")}))
    assert trainer_main.main(["--config", str(path)]) == 0, capsys.readouterr().err
    assert len(trainer) == 1 and trainer[0] == load_config(path)


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
@pytest.mark.slow
def test_hostile_config_is_refused_with_one_line(
    case: Hostile, valid: Document, trainer: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = materialise(case, valid, tmp_path)
    code = trainer_main.main(["--config", str(path)])
    assert not trainer, f"{case.name}: the trainer started on it"
    assert_refused(code, capsys.readouterr().err, case, tmp_path, tmp_path / "default-termination-log")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in HOSTILE if c.name in SUBPROCESS_CASES], ids=lambda c: c.name)
def test_hostile_config_in_a_process_of_its_own(case: Hostile, valid: Document, tmp_path: Path) -> None:
    path = materialise(case, valid, tmp_path)
    default_log = tmp_path / "default-termination-log"
    result = subprocess.run(
        [sys.executable, "-c", WITH_DEFAULT_LOG, str(default_log), "--config", str(path)],
        env=trainer_env(**ONE_RANK),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_refused(result.returncode, result.stderr, case, tmp_path, default_log)
    assert result.stdout == ""
