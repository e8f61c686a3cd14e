"""The processes the activation profiler traces its setups in (``memfit_trainer.activation_profile``).

Each trace is single-threaded Python dispatch, so two cores halve a profile's wall time. By the time it traces,
the profiler has started threads (OpenBLAS's pool when numpy is imported, the executor's own), and a child
forked from a threaded process can wait forever on a lock another thread held when it forked (profiles were
seen hanging so, their workers asleep on a futex). The workers are forked instead by multiprocessing's fork
server: a fresh interpreter started once per process, single-threaded (``OMP_NUM_THREADS=1`` and its kin in
its environment, so that importing numpy and torch starts no thread pool in it), with the modules a trace
needs imported before it forks anyone. A worker is so ready at once, where a spawned one would import torch,
transformers and peft again (seconds each).

The fork server asks the kernel for SIGKILL when the profiler that started it ends (``memfit_trainer.trace_server``,
imported there first), and each worker asks the same when the fork server ends, exiting at once if the server
or the profiler already has: no worker outlives the profiler, however it ends (``kill -9`` included;
``memfit.contract.lifetime``). Ctrl-C is the profiler's to act on: the workers ignore SIGINT.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any

from memfit.contract.lifetime import PARENT_PID_ENV, parent_of, signal_when_parent_dies

PRELOADED = (
    "memfit_trainer.trace_server",
    "memfit_trainer.activation_profile",
    "memfit_trainer.activation_offload",
    "memfit_trainer.chunked_loss",
    "memfit_trainer.data",
    "memfit_trainer.fake_trace",
    "memfit_trainer.model",
    "memfit_trainer.tiled_mlp",
    "transformers.models.auto.modeling_auto",
    "peft",
)
"""What every trace imports, imported once in the fork server (after tying the server to this process)."""
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The fork server's thread pools (torch's OpenMP, numpy's BLAS): one thread, none started beside the main one."""


def default_workers() -> int:
    """Two where this process may run on two CPUs (each trace runs on one), else one."""
    return min(2, len(os.sched_getaffinity(0)))


def start_early(workers: int) -> None:
    """Start the fork server now where ``workers`` would need it: its imports then run beside this process's own
    work before it traces (building the model, resolving its LoRA targets), not after."""
    if _forked(workers):
        _fork_server()


@contextmanager
def trace_workers(workers: int) -> Iterator[Executor]:
    """``workers`` processes forked by the fork server (where fewer than two are asked, or there is no fork
    server, each call runs here at once); on leaving, the calls not started yet are cancelled (after an error,
    only those under way are waited for)."""
    if not _forked(workers):
        yield _InProcess()
        return
    pool = ProcessPoolExecutor(
        workers, mp_context=_fork_server(), initializer=_end_with_server, initargs=(os.getpid(),)
    )
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _forked(workers: int) -> bool:
    return workers >= 2 and "forkserver" in multiprocessing.get_all_start_methods()


SOCKET_PATH_LIMIT = 107
"""The longest path a Unix socket may have on Linux (``sun_path`` holds 108 bytes, its NUL included)."""
SOCKET_NAMES = len("/pymp-12345678/listener-12345678")
"""What multiprocessing adds to its temporary directory's parent for the fork server's socket."""
SYSTEM_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")
"""Python's own choices after the environment's (``tempfile``), for a ``TMPDIR`` too long to hold a socket."""


def _socket_directory() -> None:
    """multiprocessing's temporary directory, where the fork server's socket is made, in ``TMPDIR`` where a socket
    path there fits, else in the first system temporary directory that does and is writable (Python 3.11 does not
    fall back by itself: its fork server fails with "AF_UNIX path too long" under a deep ``TMPDIR``, a pod's or a
    test's). Nothing changes where multiprocessing made its directory already."""
    usual = tempfile.gettempdir()
    if len(usual) + SOCKET_NAMES <= SOCKET_PATH_LIMIT:
        return
    fits = [
        d for d in SYSTEM_TEMP_DIRS if len(d) + SOCKET_NAMES <= SOCKET_PATH_LIMIT and os.access(d, os.W_OK | os.X_OK)
    ]
    if not fits:
        return  # the fork server then says why it cannot start
    saved, tempfile.tempdir = tempfile.tempdir, fits[0]
    try:
        multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def _fork_server() -> BaseContext:
    """The forkserver context, its server started single-threaded with :data:`PRELOADED` imported (a server
    already running, started by an earlier call in this process, is used as it is)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    environment = {**SINGLE_THREADED, PARENT_PID_ENV: str(os.getpid())}  # the server ends with this process
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        _socket_directory()
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return context


def _end_with_server(profiler: int) -> None:
    """Each worker's initializer: SIGKILL when the fork server ends; exit at once where the server ended before
    the kernel was asked (this worker's parent is then no child of ``profiler``), or the profiler did."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal_when_parent_dies(signal.SIGKILL)
    if sys.platform.startswith("linux") and parent_of(os.getppid()) != profiler:
        os._exit(1)


class _InProcess(Executor):
    """An executor that runs each call at once, here (one worker, or no fork server to fork others)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:
            future.set_exception(error)
        return future
