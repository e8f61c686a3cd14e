"""Out-of-memory handling: the pod ends with a machine-readable reason and a distinctive exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit_trainer.oom import (
    EXIT_CODE_OOM,
    MAX_TERMINATION_MESSAGE_BYTES,
    OomGuard,
    is_oom_error,
    termination_message,
    write_termination_message,
)

CUDA_OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
    "1.02 GiB is free. Of the allocated memory 75.10 GiB is allocated by PyTorch"
)


def test_exit_code_avoids_common_codes() -> None:
    reserved = {0, 1, 2, 120, *range(64, 79), *range(126, 256)}  # incl. 137 (SIGKILL) and 143 (SIGTERM)
    assert EXIT_CODE_OOM == 86 and EXIT_CODE_OOM not in reserved


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError(CUDA_OOM_TEXT), True),
        (RuntimeError(CUDA_OOM_TEXT), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("bad config"), False),
    ],
)
def test_is_oom_error(exc: BaseException, expected: bool) -> None:
    assert is_oom_error(exc) is expected


def test_is_oom_error_follows_wrapped_errors() -> None:
    try:
        try:
            raise torch.OutOfMemoryError(CUDA_OOM_TEXT)
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("step 12 failed") from inner
    except RuntimeError as outer:
        assert is_oom_error(outer)


def test_termination_message_fits_the_kubelet_limit() -> None:
    short = json.loads(termination_message(step=3, planned_peak_bytes=10, measured_peak_bytes=12, message="boom"))
    assert short == {
        "reason": "OutOfMemory",
        "step": 3,
        "plannedPeakBytes": 10,
        "measuredPeakBytes": 12,
        "message": "boom",
    }
    for long_message in ("x" * 10_000, "é\n" * 5_000, '"\\' * 5_000):
        payload = termination_message(step=1, planned_peak_bytes=None, measured_peak_bytes=None, message=long_message)
        assert len(payload.encode("utf-8")) <= MAX_TERMINATION_MESSAGE_BYTES
        decoded = json.loads(payload)
        assert decoded["message"].endswith("...")
        assert long_message.startswith(decoded["message"][:-3])
        assert len(payload.encode("utf-8")) > MAX_TERMINATION_MESSAGE_BYTES - 16  # kept as much as fits
    with pytest.raises(ValueError, match="cannot hold"):
        termination_message(step=1, planned_peak_bytes=1, measured_peak_bytes=1, message="x", limit=50)


def test_guard_writes_the_message_and_exits_86(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    guard = OomGuard(planned_peak_bytes=70 << 30, termination_log=log, measured_peak_bytes=lambda: 81 << 30)
    with pytest.raises(SystemExit) as exit_info, guard.at(step=417):
        raise torch.OutOfMemoryError(CUDA_OOM_TEXT)
    assert exit_info.value.code == EXIT_CODE_OOM
    assert isinstance(exit_info.value.__cause__, torch.OutOfMemoryError)
    assert json.loads(log.read_text()) == {
        "reason": "OutOfMemory",
        "step": 417,
        "plannedPeakBytes": 70 << 30,
        "measuredPeakBytes": 81 << 30,
        "message": f"OutOfMemoryError: {CUDA_OOM_TEXT}",
    }


def test_guard_lets_other_errors_and_success_through(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    guard = OomGuard(termination_log=log)
    with pytest.raises(ValueError, match="not memory"), guard.at(step=1):
        raise ValueError("not memory")
    with guard.at(step=2):
        pass
    assert not log.exists()


def test_guard_as_decorator(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    guard = OomGuard(termination_log=log, measured_peak_bytes=lambda: None)

    @guard
    def train_step() -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")

    guard.step = 9
    with pytest.raises(SystemExit) as exit_info:
        train_step()
    assert exit_info.value.code == EXIT_CODE_OOM
    assert json.loads(log.read_text())["step"] == 9


def test_write_replaces_previous_content(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("x" * 5000)
    write_termination_message('{"reason": "OutOfMemory"}', log)
    assert log.read_text() == '{"reason": "OutOfMemory"}'


def test_unwritable_log_still_exits_86(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    guard = OomGuard(termination_log=tmp_path / "missing-dir" / "termination-log")
    with pytest.raises(SystemExit) as exit_info, guard.at(step=1):
        raise torch.OutOfMemoryError("out of memory")
    assert exit_info.value.code == EXIT_CODE_OOM
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.slow
def test_process_exit_code_is_86(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    script = textwrap.dedent(
        f"""
        import torch
        from memfit_trainer.oom import OomGuard
        with OomGuard(planned_peak_bytes=1, termination_log={str(log)!r}).at(5):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CODE_OOM, result.stderr
    assert json.loads(log.read_text())["step"] == 5
    assert "OutOfMemoryError" in result.stderr  # the original traceback is still printed


def test_an_inner_guard_exiting_is_not_a_second_oom() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as error:
            raise SystemExit(86) from error
    except SystemExit as exiting:
        assert not is_oom_error(exiting)
