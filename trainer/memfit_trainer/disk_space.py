"""A full output volume said in one line: ``no space left on <mount point>``, not a writer's traceback.

Writers fail on a full disk in their own words: Python's ``OSError`` ENOSPC (or EDQUOT, a quota), safetensors'
``No space left on device (os error 28)``, and ``torch.save`` (DeepSpeed's checkpoints) an opaque
``RuntimeError`` of its zip writer that names no errno. So a write that fails is taken for a full disk when the
error says so, or when the filesystem it wrote to has less than :data:`LOW_SPACE_BYTES` left afterwards (a
write that failed for another reason on a volume with room is left as it is).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

LOW_SPACE_BYTES = 16 * 1024**2
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = ("No space left on device", "Disk quota exceeded")
MIB = 1024**2


class NoSpaceLeft(Exception):
    """A write of the run failed because its volume is full."""


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem ``path`` (or its nearest existing parent) is on."""
    path = path.resolve()
    while not path.exists() or not os.path.ismount(path):
        path = path.parent
    return path


def _free_bytes(path: Path) -> int | None:
    try:
        stats = os.statvfs(mount_point(path))
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _says_full(error: BaseException) -> bool:
    """``error``, or one it was raised from or during, names a full disk or quota."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return True
        if any(words in str(seen) for words in FULL_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_full(error: BaseException, path: Path) -> bool:
    free = _free_bytes(path)
    return _says_full(error) or (free is not None and free < LOW_SPACE_BYTES)


@contextlib.contextmanager
def said_when_full(path: Path, what: str) -> Iterator[None]:
    """Run the writes of ``what`` under ``path``; a failure that is a full disk becomes :class:`NoSpaceLeft`."""
    try:
        yield
    except Exception as error:
        if not _is_full(error, path):
            raise
        free = _free_bytes(path)
        left = f", {free / MIB:.1f} MiB free" if free is not None else ""
        raise NoSpaceLeft(
            f"no space left on {mount_point(path)}{left}: {what} could not be written; free space on that volume "
            "or make it larger, then run again (the run resumes from its last complete checkpoint)"
        ) from error
