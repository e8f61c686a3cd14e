"""Processes that end with their parent: how no trainer rank outlives what started it.

torchrun starts each rank in a session of its own, so neither a signal to its launcher's process group nor
the launcher's death reaches the ranks. Linux's ``PR_SET_PDEATHSIG`` has the kernel send a signal to a
process when the thread that started it ends, for whatever reason (``kill -9`` included): each rank asks for
SIGTERM when torchrun ends (memfit_trainer.main), and ``memfit run --local`` asks it for torchrun (which then
stops its ranks as it does on any SIGTERM). ``memfit plan`` starts the profiler (``memfit_trainer.profile``) with
:func:`tied_environment`, and the profiler asks for SIGKILL when it ends (:func:`end_with_launcher`); the
profiler's trace workers ask the same of the fork server that forks them, which ends with the profiler
(``memfit_trainer.trace_workers``). Elsewhere than Linux none of this does anything.

A stopped rank finishes its optimizer step and checkpoints it (memfit_trainer.stop). :func:`stop_seconds` is
how long that may take: the pod's ``terminationGracePeriodSeconds`` (plus :data:`TEARDOWN_SECONDS`) and
torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (its wait for the ranks before a SIGKILL). It bounds deletes,
drains and evictions, which honour the grace period; a cloud's spot reclaim gives the notice it gives (often
30 s to 2 min), and a stop it cuts short loses the steps since the last periodic checkpoint, as a kill does.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
from pathlib import Path

from memfit.api.plan import PlanCandidate
from memfit.api.vocabulary import Precision

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""


def signal_when_parent_dies(sig: signal.Signals = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def end_with_parent(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends, and exit at once if ``parent`` (the
    process that started this one) ended before the kernel was asked: this process is another's child by then."""
    signal_when_parent_dies(sig)
    if os.getppid() != parent:
        os._exit(1)


PARENT_PID_ENV = "MEMFIT_PARENT_PID"
"""The launcher's process id, for a child that is to end with it (:func:`end_with_launcher`)."""


def tied_environment() -> dict[str, str]:
    """This process's environment for a child that ends with it: the child calls :func:`end_with_launcher`
    first (a pre-exec hook would run Python between fork and exec, unsafe where this process has threads)."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


def end_with_launcher(sig: signal.Signals = signal.SIGKILL) -> None:
    """End with the process that started this one where it asked for it (:func:`tied_environment`); the
    variable is removed, so that children of this process do not take it for theirs."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None:
        end_with_parent(int(parent), sig)


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux's /proc), None where it has ended (a zombie too: ended, not yet
    reaped) or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    state, parent = stat.rpartition(")")[2].split()[:2]  # after the name, which may hold spaces and parentheses
    return None if state in ("Z", "X") else int(parent)


CHECKPOINT_WRITE_BYTES_PER_SECOND = 100 * 1000**2
"""What one node is assumed to write to the output volume: 100 MB/s, a network volume's (cloud persistent
disks and NFS shares commonly give 100-250 MB/s, local NVMe several GB/s): slow on purpose."""
CHECKPOINT_TIME_MARGIN = 2.0
"""The write time estimated is doubled: the volume is shared with other nodes' shards, fsync waits for it."""
STATE_BYTES_PER_TRAINED_PARAMETER = 12
"""fp32 master weights and Adam's two fp32 moments, the widest states memfit plans (8-bit and Lion write less)."""
STOP_OVERHEAD_SECONDS = 30
"""The agreement on the stop, the checkpoint's barriers and renames, process teardown."""
MIN_STOP_SECONDS = 60
TEARDOWN_SECONDS = 15
"""Between torchrun's SIGKILL of the ranks and the kubelet's of the container: torchrun's own exit."""


def checkpoint_bytes_per_node(plan: PlanCandidate) -> int:
    """The most one node writes for a checkpoint: every weight (in the plan's precision: under ZeRO-1 and 2
    rank 0 saves the whole module) and its share of the trained parameters' optimizer states."""
    weight_bytes = 4 if plan.strategy.precision == Precision.FP32 else 2
    states = plan.trainable_parameter_count * STATE_BYTES_PER_TRAINED_PARAMETER / plan.strategy.nodes
    return math.ceil(plan.parameter_count * weight_bytes + states)


def stop_seconds(plan: PlanCandidate) -> int:
    """How long a graceful stop may take: the step under way, then the checkpoint at the assumed bandwidth with
    its margin, then the overhead; never under :data:`MIN_STOP_SECONDS`."""
    write = checkpoint_bytes_per_node(plan) / CHECKPOINT_WRITE_BYTES_PER_SECOND * CHECKPOINT_TIME_MARGIN
    return max(MIN_STOP_SECONDS, math.ceil(plan.throughput.step_seconds + write + STOP_OVERHEAD_SECONDS))
