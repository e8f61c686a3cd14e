"""The human-readable progress line rank 0 prints: plain text, one line every few seconds, flushed.

Pod logs are files, not terminals, so there are no carriage returns or colours; throttling keeps a
thousand-steps-a-minute run from drowning the log. (The machine-readable progress for the operator is
:mod:`memfit.contract.progress`.)
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

DEFAULT_INTERVAL_SECONDS = 5.0


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class ConsoleProgress:
    """Prints ``step N/T loss ... lr ... tokens/s ... eta ...`` at most every ``interval`` seconds (and at
    the first and last step); silent when ``enabled`` is false (every rank but 0)."""

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        stream: TextIO | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.interval = interval
        self.stream = stream or sys.stdout
        self._last_print = float("-inf")
        self._window_start = time.monotonic()
        self._window_tokens = 0
        self._window_steps = 0

    def step(self, step: int, loss: float, learning_rate: float, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        self._window_tokens += tokens
        self._window_steps += 1
        if now - self._last_print < self.interval and step not in (1, self.total_steps):
            return
        elapsed = max(now - self._window_start, 1e-9)
        eta = (self.total_steps - step) * elapsed / self._window_steps
        self.message(
            f"step {step}/{self.total_steps} loss {loss:.4f} lr {learning_rate:.3e} "
            f"tokens/s {self._window_tokens / elapsed:.0f} eta {format_duration(eta)}"
        )
        self._last_print = now
        self._window_start, self._window_tokens, self._window_steps = now, 0, 0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent on something other than training (a validation pass) out of tokens/s."""
        self._window_start += seconds

    def message(self, text: str) -> None:
        """A line on rank 0 (progress, resume, final save)."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
