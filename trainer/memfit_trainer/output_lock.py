"""The run's hold on its output directory (:mod:`memfit.contract.output_lock`), taken before anything there is
read or written: before the stale temporary directories are cleaned up, before resuming, before the data.

One process takes it, rank 0: the checkpoint protocol already needs the output directory to be one shared
volume (rank 0 renames the directories every rank wrote into), so rank 0's lock covers the whole gang, and a
second run has a rank 0 of its own that is refused. A lock per node would refuse the gang's own nodes on a
shared volume. The other ranks wait for rank 0's answer, so every rank of a refused run stops with the same
line and exit 2 before touching anything.
"""

from __future__ import annotations

import torch.distributed as dist

from memfit.contract.output_lock import OutputInUse, acquire
from memfit.contract.reader import ConfigError
from memfit.contract.trainer_config import TrainerConfig


class OutputDirectoryInUse(ConfigError):
    """Another run holds the output directory: refused like a config (one line, exit 2)."""


def _try_lock(config: TrainerConfig) -> str | None:
    """Rank 0: take the lock (held until this process ends); the refusal, or None."""
    try:
        acquire(config.output_dir)  # its descriptor stays open, and the lock held, until the process ends
    except OutputInUse as error:
        return str(error)
    except OSError as error:
        return f"cannot lock the output directory {config.output_dir}: {error.strerror or error}"
    return None


def lock_output_dir(config: TrainerConfig, rank: int) -> None:
    """Collective: rank 0 locks the output directory; every rank raises :class:`OutputDirectoryInUse` when it
    could not."""
    refusal = [_try_lock(config) if rank == 0 else None]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise OutputDirectoryInUse(refusal[0])
