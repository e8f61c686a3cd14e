"""``memfit operator``: run the handlers of memfit_operator.handlers with kopf."""

from __future__ import annotations

import logging
import random

import kopf

from memfit_operator.handlers import WAKEUP_HANDLERS  # importing registers the handlers with kopf
from memfit_operator.settings import OperatorSettings

PRIORITY_RANGE = (1, 2**31 - 1)
"""kopf peering pauses every replica but the one of highest priority, and freezes all of them when two share
the top priority; a random priority per process makes the second replica a standby, not a freeze."""


class _QuietWakeups(logging.Filter):
    """kopf logs every handler success; the wake-up handlers run on every pod and job event and say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith("succeeded.") and any(name in message for name in WAKEUP_HANDLERS))


def run_operator(settings: OperatorSettings) -> None:
    kopf.configure(verbose=False)  # kopf's log format and levels for every logger
    logging.getLogger("kopf.objects").addFilter(_QuietWakeups())
    kopf.run(
        clusterwide=settings.namespace is None,
        namespaces=[settings.namespace] if settings.namespace else (),
        standalone=settings.standalone,
        # A named peering makes it mandatory: kopf waits for the peering object rather than run unpeered.
        peering_name=None if settings.standalone else settings.peering,
        priority=random.randint(*PRIORITY_RANGE),
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None,
        memo=kopf.Memo(settings=settings),
    )
