"""Path fields of the trainer's config: absolute, printable, never climbing out of their volume (``..``).

The trainer runs wherever its pod starts it, so a relative path would depend on the working directory, and a
path that climbs could leave the job's volume; :func:`within` lets the config check a path against its volume.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Final

from pydantic import AfterValidator, Field, Strict

MAX_PATH_LENGTH: Final = 4096
MAX_NAME_LENGTH: Final = 1024


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError("control characters (NUL, newline, ...) are not allowed")
    return text


def absolute_path(path: str) -> str:
    """``path`` if it is an absolute POSIX path that does not climb, else ValueError."""
    _printable(path)
    parts = PurePosixPath(path).parts
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    if ".." in parts:
        raise ValueError(f"{path!r} contains `..`: paths must not climb out of their volume")
    return path


def _model_name(name: str) -> str:
    """A Hub id (``org/name``) or an absolute local directory; never a relative path that climbs."""
    _printable(name)
    if name.startswith("/"):
        return absolute_path(name)
    if ".." in PurePosixPath(name).parts or name.startswith("~"):
        raise ValueError(f"{name!r} is neither a Hub id nor an absolute directory")
    return name


AbsolutePath = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH), AfterValidator(absolute_path)]
"""An absolute path without ``..`` or control characters."""
Name = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_NAME_LENGTH), AfterValidator(_printable)]
"""A non-empty, printable, bounded string (a field name, a revision, a label)."""
ModelName = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_PATH_LENGTH), AfterValidator(_model_name)]
"""A Hub id or an absolute local directory."""


def within(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or below it, lexically (both absolute, without ``..``)."""
    candidate, base = PurePosixPath(path), PurePosixPath(root)
    return candidate == base or base in candidate.parents
