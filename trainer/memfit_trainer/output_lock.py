"""The run's hold on its output directory (:mod:`memfit.contract.output_lock`), taken before anything there is
read or written: before the stale temporary directories are cleaned up, before resuming, before the data.

One process takes it, rank 0: the checkpoint protocol already needs the output directory to be one shared
volume (rank 0 renames the directories every rank wrote into), so rank 0's lock covers the whole gang, and a
second run has a rank 0 of its own that is refused. A lock per node would refuse the gang's own nodes on a
shared volume. The other ranks wait for rank 0's answer, so every rank of a refused run stops with the same
line and exit 2 before touching anything.

Rank 0 waits for a held lock for up to ``MEMFIT_LOCK_WAIT_SECONDS`` (:data:`DEFAULT_WAIT_SECONDS`) before it
refuses: a gang restarted after its node was lost can find the lock of its own dead predecessor still held on
NFS until the server's lease expires (90 s by default), and that restart must go on, not fail the job.
``memfit run --local`` refuses a live duplicate at once, before the trainer starts
(:func:`memfit.contract.output_lock.lock_holder`).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from memfit.contract.output_lock import OutputInUse, acquire
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig


class OutputDirectoryInUse(ConfigError):
    """Another run holds the output directory: refused like a config (one line, exit 2)."""


WAIT_ENV = "MEMFIT_LOCK_WAIT_SECONDS"
DEFAULT_WAIT_SECONDS = 120.0
"""NFS's default lease (90 s), with room: how long a dead predecessor's lock can outlive it."""
POLL_SECONDS = 1.0


def _try_lock(config: TrainerConfig) -> str | None:
    """Rank 0: take the lock (held until this process ends), waiting up to the wait for a holder to go; the
    refusal, or None."""
    deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_SECONDS))
    said = False
    while True:
        try:
            acquire(config.output_dir)  # its descriptor stays open, and the lock held, until the process ends
            return None
        except OutputInUse as error:
            if time.monotonic() >= deadline:
                return str(error)
            if not said:
                print(f"memfit-train: waiting for the lock: {error}", file=sys.stderr, flush=True)
                said = True
        except OSError as error:
            return f"cannot lock the output directory {config.output_dir}: {error.strerror or error}"
        time.sleep(POLL_SECONDS)


def lock_output_dir(config: TrainerConfig, rank: int) -> None:
    """Collective: rank 0 locks the output directory; every rank raises :class:`OutputDirectoryInUse` when it
    could not."""
    refusal = [_try_lock(config) if rank == 0 else None]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise OutputDirectoryInUse(refusal[0])
