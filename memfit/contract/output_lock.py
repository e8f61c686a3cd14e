"""One run per output directory: an advisory ``flock`` on ``OUTPUT/.memfit-run.lock``.

Two runs writing one output directory delete each other's checkpoints in progress. The trainer's rank 0 takes
an exclusive ``flock`` on the lock file before it reads or writes anything there and holds it for the life of
its process; the kernel releases it when that process ends, however it ends (``kill -9`` included), so a
killed run never blocks its successor. The holder writes its pid and host into the file, so a refusal names
it. ``memfit run --local`` probes the lock (:func:`lock_holder`) before it writes its config, to refuse early;
the trainer's own lock is what counts (a probe and a start racing each other are settled there). A holder that
is dying (a run killed a moment ago, still tearing down) is waited for, as the trainer waits for one.

What is guaranteed: on a local filesystem, a second run on the same machine is refused. On a shared
filesystem (one PVC mounted by several nodes) only where its ``flock`` is cluster-wide: NFSv4 (the Linux NFS
client turns ``flock`` into a byte-range lock the server arbitrates), CephFS, Lustre mounted with ``flock``,
GPFS. Where it is node-local (NFSv3 mounted ``nolock``, ``local_lock=flock``, many FUSE or object-store
mounts) only a second run whose rank 0 is on the same node is refused. On NFS a lock held by a node that
vanished is released only when its lease expires (90 s by default), and a client cut off from the server
past its lease can lose its lock without being told: the lock is advisory protection against the common
mistake, not a fence.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import time
from pathlib import Path

LOCK_FILE = ".memfit-run.lock"
MAX_HOLDER_BYTES = 256


class OutputInUse(Exception):
    """Another live run holds the output directory's lock."""


def lock_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / LOCK_FILE


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file: ``pid N on host H``."""
    written = os.pread(fd, MAX_HOLDER_BYTES, 0).decode("utf-8", errors="replace").split()
    if len(written) != 2:
        return "a run that has not yet said its pid"
    return f"pid {written[0]} on host {written[1]}"


def _in_use(output_dir: str | Path, fd: int) -> OutputInUse:
    return OutputInUse(
        f"output directory {output_dir} is in use by another run ({_holder(fd)}): one run per output directory; "
        "stop that run or give this one another output path"
    )


def acquire(output_dir: str | Path) -> int:
    """Take the lock and write this process's pid and host into it; the file descriptor, to keep open for as
    long as the run goes on (closing it, or the process ending, releases the lock). Raises
    :class:`OutputInUse` when another process holds it, ``OSError`` when the file cannot be opened."""
    os.makedirs(output_dir, exist_ok=True)
    fd = os.open(lock_path(output_dir), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        refusal = _in_use(output_dir, fd)
        os.close(fd)
        raise refusal from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def _probe(output_dir: str | Path) -> tuple[str, str] | None:
    """(the refusal a run would get now, what the holder wrote), or None: nobody holds the lock."""
    try:
        fd = os.open(lock_path(output_dir), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return str(_in_use(output_dir, fd)), os.pread(fd, MAX_HOLDER_BYTES, 0).decode("utf-8", errors="replace")
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return None


PF_EXITING = 0x4
"""``/proc/PID/stat``'s flag of a process tearing itself down (its files, and so its lock, go last)."""
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def _dying(written: str) -> bool:
    """Whether the holder that wrote ``pid host`` is on this host and going: gone (its children still hold the
    inherited lock), a zombie, exiting, or with SIGKILL pending. A live holder elsewhere is never dying."""
    words = written.split()
    if len(words) != 2 or words[1] != socket.gethostname() or not words[0].isdigit():
        return False
    if not Path("/proc/self/stat").exists():
        return False  # no procfs to tell a dying process from a live one: refuse, as before
    proc = Path("/proc") / words[0]
    try:
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        status = (proc / "status").read_text()
    except OSError:
        return True  # gone; whoever still holds its lock inherited it, and goes with it
    state, flags = stat[0], int(stat[6])
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return state in "ZX" or bool(flags & PF_EXITING) or any(mask & SIGKILL_BIT for mask in pending)


DYING_WAIT_SECONDS = 60.0
"""How long a probe waits for a dying holder (a run killed a moment ago, its processes still tearing down)."""


def lock_holder(output_dir: str | Path, wait_seconds: float = DYING_WAIT_SECONDS) -> str | None:
    """The refusal a run of ``output_dir`` would get now, or None (no lock file, or nobody holds it). A holder
    that is dying (:func:`_dying`: a run just killed) is waited for, up to ``wait_seconds``, as the trainer
    waits for it; a live one is refused at once. Creates nothing: it only probes a lock file that exists."""
    deadline = time.monotonic() + wait_seconds
    while (held := _probe(output_dir)) is not None:
        refusal, written = held
        if not _dying(written) or time.monotonic() >= deadline:
            return refusal
        time.sleep(0.1)
    return None
