"""The exit codes of every ``memfit`` command (scripts and CI depend on them)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    NO_FIT = 1
    """The job is valid but nothing fits the GPUs it may use."""
    BAD_INPUT = 2
    """The input is wrong: a clear one-line error says where (also argparse's code for a bad command line)."""
    INTERNAL_ERROR = 3
    """A bug in memfit: one line says what went wrong (`memfit --debug ...` prints the traceback too)."""
    INTERRUPTED = 130
    """Stopped with Ctrl-C (128 + SIGINT, as shells report it)."""
