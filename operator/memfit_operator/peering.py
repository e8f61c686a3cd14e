"""Saying what the operator waits for when kopf's peering object is missing.

With a named peering (``memfit operator`` without ``--standalone``; the chart's replicas) kopf pauses every
handler until the peering object exists, and says nothing about it: the log ends at "Initial authentication
has finished". This watches for the object and says, at start and then every ``peering_notice_seconds``
while it is missing, which object that is and the two ways out.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from memfit_operator.cluster_api import CLUSTER_PEERINGS, KOPF_GROUP, KOPF_VERSION, PEERINGS, Peering

log = logging.getLogger("memfit.operator")


def peering_kind(namespace: str | None) -> str:
    return "KopfPeering" if namespace else "ClusterKopfPeering"


def waiting_message(found: Peering, namespace: str | None, name: str) -> str:
    """What is missing and how to get out of it, in one log line."""
    kind = peering_kind(namespace)
    crd = f"{PEERINGS if namespace else CLUSTER_PEERINGS}.{KOPF_GROUP}"
    where = f"in namespace {namespace}" if namespace else "(cluster-scoped)"
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    manifest = json.dumps({"apiVersion": f"{KOPF_GROUP}/{KOPF_VERSION}", "kind": kind, "metadata": metadata})
    missing = f"its CRD {crd} is not installed" if found is Peering.NO_CRD else "it does not exist"
    install_crd = (
        "`memfit crd | kubectl apply -f -` (or `kubectl apply -f crds/`), then " if found is Peering.NO_CRD else ""
    )
    return (
        f"Waiting for the kopf peering object {kind} {name!r} {where}: {missing}, so kopf keeps every handler "
        f"paused and no FineTuneJob is handled. Either create it: {install_crd}"
        f"`echo '{manifest}' | kubectl apply -f -` (the Helm chart creates both), or run a single replica "
        "without peering: `memfit operator --standalone`."
    )


async def announce_missing_peering(
    lookup: Callable[[], Peering], namespace: str | None, name: str, every: float
) -> None:
    """Forever: look the peering object up now and every ``every`` seconds; warn while it is missing, and
    say once when it appears. ``lookup`` is a blocking API call (run in a worker thread)."""
    waiting = False
    while True:
        try:
            found = await asyncio.to_thread(lookup)
        except Exception as error:  # the API server unreachable, or no permission to read the object
            log.warning(f"Cannot check the kopf peering object {peering_kind(namespace)} {name!r}: {error}")
        else:
            if found is not Peering.FOUND:
                log.warning(waiting_message(found, namespace, name))
                waiting = True
            elif waiting:
                log.info(f"The kopf peering object {peering_kind(namespace)} {name!r} exists: handlers resume.")
                waiting = False
        await asyncio.sleep(every)
