"""One run per output directory (memfit.contract.output_lock): the lock refuses a second holder, names the
first, and is released by the kernel when its holder dies, however it dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.contract.output_lock import DYING_WAIT_SECONDS, LOCK_FILE, OutputInUse, acquire, lock_holder

HOLD = (
    "import sys, time; from memfit.contract.output_lock import acquire; "
    "acquire(sys.argv[1]); print(flush=True); time.sleep(600)"
)


def hold_in_another_process(output: Path) -> subprocess.Popen[str]:
    """A process that holds the lock of ``output`` (it has taken it once it has printed its line)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "\n"
    return holder


def test_a_second_holder_is_refused_naming_the_first_until_it_is_killed(tmp_path: Path) -> None:
    output = tmp_path / "output"
    holder = hold_in_another_process(output)
    try:
        with pytest.raises(
            OutputInUse, match=rf"in use by another run \(pid {holder.pid} on host {re.escape(socket.gethostname())}\)"
        ):
            acquire(output)
        assert f"pid {holder.pid}" in (lock_holder(output) or "")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_holder(output) is None
    fd = acquire(output)  # the kernel released the killed holder's lock
    assert (output / LOCK_FILE).read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    os.close(fd)


def test_a_probe_creates_nothing(tmp_path: Path) -> None:
    assert lock_holder(tmp_path / "absent") is None
    assert list(tmp_path.iterdir()) == []


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    output = tmp_path / "output"
    output.mkdir()
    (output / LOCK_FILE).symlink_to(victim)
    with pytest.raises(OSError):
        acquire(output)
    assert victim.read_text() == "precious"


DYING = (
    "import subprocess, sys; from memfit.contract.output_lock import acquire; fd = acquire(sys.argv[1]); "
    "subprocess.Popen(['sh', '-c', 'while [ ! -e \"$0\" ]; do sleep 0.05; done', sys.argv[2]], pass_fds=(fd,), "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
    "print(flush=True)"
)


def test_a_probe_waits_for_a_dying_holder_and_refuses_a_live_one(tmp_path: Path) -> None:
    """A run killed a moment ago whose processes are still going (here: its pid gone, a child that inherited the
    lock ending once told to) is waited for; a live holder is refused at once (not after the dying holder's wait)."""
    output, release = tmp_path / "output", tmp_path / "release"
    try:
        holder = subprocess.run(
            [sys.executable, "-c", DYING, str(output), str(release)], capture_output=True, check=True
        )
        assert holder.stdout == b"\n"
        assert lock_holder(output, wait_seconds=0) is not None  # the child holds it, however long this took
    finally:
        release.touch()
    assert lock_holder(output) is None  # waited for the child to end
    live = hold_in_another_process(output)
    try:
        started = time.monotonic()
        assert f"pid {live.pid}" in (lock_holder(output) or "")
        assert time.monotonic() - started < DYING_WAIT_SECONDS / 4
    finally:
        live.kill()
        live.wait()
