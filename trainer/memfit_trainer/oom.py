"""Turn a GPU out-of-memory error into a termination message the operator can act on.

When a step runs out of GPU memory the plan was wrong, and the operator should learn that (and by how much)
rather than see an anonymous crash. The trainer writes a small JSON document to the container's termination
message file (Kubernetes copies it into ``status.containerStatuses[].state.terminated.message``, at most
4096 bytes) and exits with :data:`EXIT_CODE_OOM`.

``EXIT_CODE_OOM = 86``: below 126 so it is never read as a shell or signal code (126/127 command not
runnable/found, 128+N killed by signal N: 137 SIGKILL/kernel OOM killer, 143 SIGTERM), not 1 (any uncaught
Python exception) or 2 (argparse usage), and outside BSD ``sysexits.h`` (64-78) and Python's own 120. When a
launcher sits between the container and the trainer (``torchrun`` reports any failed worker as exit code 1),
the exit code is lost but the termination message is not: the operator should key on the message's
``reason`` and treat the exit code as a second signal.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from contextlib import ContextDecorator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from memfit.api.vocabulary import TerminationReason
from memfit.contract.termination import (
    DEFAULT_TERMINATION_LOG,
    MAX_TERMINATION_MESSAGE_BYTES,
    fitted_message,
    write_termination_message,
)

EXIT_CODE_OOM = 86
_OOM_PHRASES = ("cuda out of memory", "out of memory")


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a device out-of-memory error.

    Libraries wrap errors (DeepSpeed, ``accelerate``), so the cause/context chain is searched too, but
    not past a ``SystemExit``: that is an inner guard that already reported the OOM and is exiting.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and not isinstance(current, SystemExit):
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            return True
        if isinstance(current, RuntimeError) and any(p in str(current).lower() for p in _OOM_PHRASES):
            return True
        current = current.__cause__ or current.__context__
    return False


def cuda_peak_bytes() -> int | None:
    """Peak bytes the CUDA caching allocator reserved on this process's device (what the plan must fit)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_reserved())


def termination_message(
    *,
    step: int | None,
    planned_peak_bytes: int | None,
    measured_peak_bytes: int | None,
    message: str,
    limit: int = MAX_TERMINATION_MESSAGE_BYTES,
) -> str:
    """The OOM document; a too long ``message`` is cut to fit ``limit`` bytes (see termination.fitted_message)."""
    fields = {"reason": TerminationReason.OUT_OF_MEMORY, "step": step, "plannedPeakBytes": planned_peak_bytes,
              "measuredPeakBytes": measured_peak_bytes}  # fmt: skip
    return fitted_message(fields, message, limit)


class OomGuard(ContextDecorator):
    """Wrap a training step: on an out-of-memory error, record it and exit with :data:`EXIT_CODE_OOM`.

    Usage: ``guard = OomGuard(planned_peak_bytes=plan_peak)`` once, then ``with guard.at(step): ...`` around
    each step (or decorate the step function with ``@guard`` and set ``guard.step``). Other exceptions pass
    through untouched. The original traceback is printed to stderr (the pod log) before exiting, because the
    interpreter exits silently on ``SystemExit``; raising it (chained to the error) lets ``finally`` blocks run.
    """

    def __init__(
        self,
        *,
        planned_peak_bytes: int | None = None,
        termination_log: str | Path = DEFAULT_TERMINATION_LOG,
        measured_peak_bytes: Callable[[], int | None] = cuda_peak_bytes,
    ) -> None:
        self.planned_peak_bytes = planned_peak_bytes
        self.termination_log = Path(termination_log)
        self.measured_peak_bytes = measured_peak_bytes
        self.step: int | None = None

    def at(self, step: int) -> OomGuard:
        self.step = step
        return self

    def __enter__(self) -> OomGuard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any:
        if exc is None or not is_oom_error(exc):
            return False
        payload = termination_message(
            step=self.step,
            planned_peak_bytes=self.planned_peak_bytes,
            measured_peak_bytes=self.measured_peak_bytes(),
            message=f"{type(exc).__name__}: {exc}",
        )
        try:
            write_termination_message(payload, self.termination_log)
        except OSError as write_error:  # the exit code must still say OOM
            print(f"memfit: cannot write {self.termination_log}: {write_error}", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
        print(f"memfit: out of memory at step {self.step}; exiting with code {EXIT_CODE_OOM}", file=sys.stderr)
        raise SystemExit(EXIT_CODE_OOM) from exc
