"""A graceful stop: on SIGTERM or SIGINT the run finishes its optimizer step, checkpoints it and exits.

SIGTERM is what Kubernetes sends a pod it evicts, preempts, drains or deletes (torchrun, the container's
first process, forwards it to every rank, then waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds before a
SIGKILL; the operator sets both from the plan's checkpoint time: memfit.contract.lifetime); SIGINT is Ctrl-C
(``memfit run --local`` forwards it). The handler only records the signal; the loop asks before each optimizer
step whether any rank has one (:meth:`StopRequest.agreed`, an all-reduce of one flag: a collective, so every
rank stops after the same step even when the signal reached them at different moments). A second signal
ends the process at once (the signal's default action): the way out when a stop itself cannot finish (a rank
gone, a collective that never returns).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The first stop signal this process received, if any."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    def install(self) -> None:
        """Handle :data:`STOP_SIGNALS` from now on (main thread only)."""
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # the second one: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def agreed(self, device: torch.device) -> bool:
        """Collective: whether any rank was asked to stop (on the device: NCCL reduces only device tensors)."""
        flag = torch.tensor(1.0 if self.requested else 0.0, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def describe(self) -> str:
        """The signal, as the stop is said."""
        return self.signal.name if self.signal is not None else "another rank's signal"
