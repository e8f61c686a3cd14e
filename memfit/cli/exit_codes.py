"""The exit codes of every ``memfit`` command (scripts and CI depend on them)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    NO_FIT = 1
    """The job is valid but nothing fits the GPUs it may use."""
    BAD_INPUT = 2
    """The input is wrong: a clear one-line error says where."""
