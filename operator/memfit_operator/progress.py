"""Training progress as the operator reads it: rank 0's /metrics, scraped over the pod network.

Trainer pods have no API access (they need none), so the operator fetches the progress series of the
current attempt's rank 0 (the names are the trainer's, memfit.contract.progress) and turns them into
``status.progress``. Tokens per second: rank 0's recent rate times the world size, the same estimate the
trainer's progress file gives. Nothing here invents a number: a series the trainer has not exported yet
stays null.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from memfit.api.finetunejob import Progress
from memfit.contract.progress import (
    CHECKPOINT_STEP_METRIC,
    ETA_METRIC,
    STEP_METRIC,
    TOKENS_PER_SECOND_METRIC,
    TOTAL_STEPS_METRIC,
)

SCRAPE_TIMEOUT_SECONDS = 3.0


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_trainer_metrics(text: str, world_size: int, now: datetime) -> Progress | None:
    """Progress from rank 0's exposition text; None before its first optimizer step."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("rank", "0") == "0":
                values[sample.name] = sample.value
    if STEP_METRIC not in values:
        return None
    step = int(values[STEP_METRIC])
    total = int(values[TOTAL_STEPS_METRIC]) if TOTAL_STEPS_METRIC in values else None
    eta_seconds = values.get(ETA_METRIC)
    rate = values.get(TOKENS_PER_SECOND_METRIC)
    checkpoint = values.get(CHECKPOINT_STEP_METRIC)
    return Progress(
        step=step,
        total_steps=total,
        percent=100 * step // total if total else 0,
        tokens_per_second=round(rate * world_size, 1) if rate is not None else None,
        eta=_rfc3339(now + timedelta(seconds=eta_seconds)) if eta_seconds is not None else None,
        last_checkpoint_step=int(checkpoint) if checkpoint is not None else None,
        updated=_rfc3339(now),
    )


def rank0_address(pods: Sequence[Mapping[str, Any]], rank_label: str) -> str | None:
    """The pod IP of node rank 0 among an attempt's pods, once it has one."""
    for pod in pods:
        if (pod.get("metadata", {}).get("labels") or {}).get(rank_label) == "0":
            return (pod.get("status") or {}).get("podIP")
    return None


async def fetch_progress(session: aiohttp.ClientSession, address: str, port: int, world_size: int) -> Progress | None:
    """GET rank 0's /metrics; None when it does not answer (starting up, or gone)."""
    url = f"http://{address}:{port}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return parse_trainer_metrics(text, world_size, datetime.now(UTC))
