"""The trainer's termination message: why it stopped, as JSON the operator reads from the pod's status.

Kubernetes copies the container's termination message file into
``status.containerStatuses[].state.terminated.message`` (at most 4096 bytes). ``torchrun`` reports every
failed worker as exit code 1, so the message, not the exit code, carries the reason:

Its ``reason`` is a ``memfit.api.vocabulary.TerminationReason``:

* ``{"reason": "OutOfMemory", ...}``: a GPU ran out of memory (memfit_trainer.oom); the operator re-plans;
* ``{"reason": "ConfigError", "message": ...}``: the trainer refused its config or data before training
  (exit code 2); restarting cannot help, so the operator fails the job with the message;
* ``{"reason": "NoSpace", "message": ...}``: a checkpoint or the export could not be written, the output
  volume is full (exit code 2); restarting cannot help until someone frees space;
* ``{"reason": "NonFinite", "message": ...}``: a step's loss or gradient norm was NaN or infinite; the run
  stopped before writing anything of it (exit code 2): the message names the step and the checkpoint the
  run had started from; restarting from that checkpoint would train on the same data to the same end;
* ``{"reason": "Completed", "progress": ...}``: rank 0 finished training (exit code 0); its last progress
  (``memfit.contract.progress``), which the operator's periodic reads of its metrics can have missed (a
  job shorter than their interval, the last steps after the last read);
* ``{"reason": "Stopped", "step": N, "message": ...}``: the trainer was stopped by a signal (SIGTERM from
  Kubernetes, Ctrl-C) and wrote a checkpoint of step N first (exit code 0; torchrun, itself signalled, reports
  1); the training is not finished, and a restart resumes from step N.

No torch here: the operator imports the reasons.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Any

from memfit.api.vocabulary import TerminationReason
from memfit.contract.progress import Progress

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_TERMINATION_MESSAGE_BYTES = 4096
CONFIG_ERROR_PREFIX = "memfit-train: "
"""How the trainer's one stderr line about a refused config begins (:func:`report_config_error`)."""


def one_line(error: BaseException) -> str:
    """A library's exception message on one line, as a refusal is said (transformers' and datasets' span
    several); the exception's type where it has no message."""
    return " ".join(str(error).split()) or type(error).__name__


def fitted_message(fields: dict[str, Any], message: str, limit: int = MAX_TERMINATION_MESSAGE_BYTES) -> str:
    """``fields`` plus ``message`` as JSON; a too long ``message`` is cut to the longest prefix (plus ``...``)
    within ``limit`` bytes."""

    def encode(text: str) -> str:
        return json.dumps({**fields, "message": text}, ensure_ascii=False)

    payload = encode(message)
    if len(payload.encode("utf-8")) <= limit:
        return payload
    if len(encode("...").encode("utf-8")) > limit:
        raise ValueError(f"{limit} bytes cannot hold even an empty termination message")
    # JSON escaping and UTF-8 make bytes-per-character uneven: search for the longest prefix that fits.
    fits, too_long = 0, len(message)
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        if len(encode(message[:middle] + "...").encode("utf-8")) <= limit:
            fits = middle
        else:
            too_long = middle
    return encode(message[:fits] + "...")


def write_termination_message(payload: str, path: str | Path = DEFAULT_TERMINATION_LOG) -> None:
    """Replace the file's content with ``payload`` under an exclusive lock.

    Several ranks of one pod may fail at once; the lock makes the result one whole document (the last
    writer's) rather than an interleaving. The file is a kubelet bind mount, so it is rewritten in place,
    never replaced by rename.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, payload.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)  # also releases the lock


def report_config_error(error: str, path: str | Path = DEFAULT_TERMINATION_LOG) -> None:
    """The one stderr line, and the ConfigError termination message where the file can be written (a pod
    has it; a local run outside a container usually cannot create /dev/termination-log, and needs none)."""
    report_refusal(TerminationReason.CONFIG_ERROR, error, path)


def report_refusal(reason: TerminationReason, error: str, path: str | Path = DEFAULT_TERMINATION_LOG) -> None:
    """As :func:`report_config_error`, for another ``reason`` the run cannot go on for (a full disk)."""
    # One write, newline included: stderr writes through, so print's two writes (text, then newline) let two
    # ranks refusing at once run their lines together.
    sys.stderr.write(f"{CONFIG_ERROR_PREFIX}{error}\n")
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        write_termination_message(fitted_message({"reason": reason}, error), path)


def read_termination_message(path: str | Path) -> str | None:
    """The termination message in the file, or None where there is none to read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read(2 * MAX_TERMINATION_MESSAGE_BYTES)
    except (OSError, UnicodeDecodeError):
        return None


def config_error_message(path: str | Path) -> str | None:
    """The message of a ConfigError termination message in the file, or None (no file, another reason)."""
    try:
        payload = json.loads(read_termination_message(path) or "")
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("reason") != TerminationReason.CONFIG_ERROR:
        return None
    message = payload.get("message")
    return message if isinstance(message, str) else None


def completed_message(progress: Progress) -> str:
    """Rank 0's termination message after its last step: the reason and its final progress."""
    return json.dumps({"reason": TerminationReason.COMPLETED, "progress": json.loads(progress.to_json())})


def completed_progress(message: str | None) -> Progress | None:
    """The final progress of a Completed termination message; None for any other message (or none)."""
    try:
        payload = json.loads(message or "")
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or payload.get("reason") != TerminationReason.COMPLETED:
        return None
    try:
        return Progress.model_validate(payload.get("progress"))
    except ValueError:
        return None


def stopped_message(step: int, signal_name: str) -> str:
    """The termination message of a run stopped by a signal after its checkpoint of ``step``."""
    said = f"stopped by {signal_name} at step {step}" + (", its checkpoint written" if step else ", before any step")
    return json.dumps({"reason": TerminationReason.STOPPED, "step": step, "message": said})


def stopped_description(message: str | None) -> str | None:
    """What a Stopped termination message says; None for any other message (or none)."""
    try:
        payload = json.loads(message or "")
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or payload.get("reason") != TerminationReason.STOPPED:
        return None
    return str(payload.get("message"))
