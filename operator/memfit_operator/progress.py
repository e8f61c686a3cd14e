"""Training progress as the operator reads it: rank 0's /metrics, scraped over the pod network.

Trainer pods have no API access (they need none), so the operator fetches the progress series of the
current attempt's rank 0 (the names are the trainer's, memfit.contract.progress) and turns them into
``status.progress``. Tokens per second: rank 0's recent rate times the world size, the same estimate the
trainer's progress file gives; the validation loss is already the mean over all ranks. Nothing here invents
a number: a series the trainer has not exported yet (or a NaN validation loss) stays null.

Where the process resumed from (the checkpoint step, and how many newer checkpoints it set aside as unusable)
belongs to the attempt, not to ``status.progress``: it travels beside the progress (:class:`TrainerReport`),
read only once rank 0 has made its first step (its resume is over by then; before, no resumed step could
mean "not yet" as well as "from the weights") and only from a trainer that exports
``memfit_checkpoints_set_aside`` (one without it says nothing about its resume).

A pod's address is only as trustworthy as the pod: only a pod the job controls (its owner reference carries
the job's uid; labels alone can be copied by anyone who may create pods) is scraped, the reply is bounded in
time (``SCRAPE_TIMEOUT_SECONDS``, connection to last byte) and size (``SCRAPE_MAX_BYTES``, after
decompression), redirects are not followed, and the text is parsed in a worker thread, never on the event
loop that serves every job, watch and probe of the operator.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from memfit.api.finetunejob import Progress
from memfit.api.vocabulary import TIMESTAMP_FORMAT
from memfit.contract import progress as metric
from memfit_operator.objects import RANK_LABEL, owned_by
from memfit_operator.status import Resumption, resumption

SCRAPE_TIMEOUT_SECONDS = 3.0
SCRAPE_MAX_BYTES = 1024**2
"""Rank 0's exposition is a few KiB (its own series and the process collector's); a MiB parses in tens of
milliseconds. A larger reply is refused unread past this."""
CHUNK_BYTES = 64 * 1024
log = logging.getLogger("memfit.operator")


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(TIMESTAMP_FORMAT)


@dataclass(frozen=True)
class TrainerReport:
    """What rank 0's metrics say: the progress (``status.progress``) and where this process resumed from."""

    progress: Progress
    resumption: Resumption | None
    """None from a trainer that does not export ``memfit_checkpoints_set_aside``."""


def parse_trainer_metrics(text: str, world_size: int, now: datetime) -> TrainerReport | None:
    """Progress and resumption from rank 0's exposition text; None before its first optimizer step."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("rank", "0") == "0":
                values[sample.name] = sample.value
    if metric.STEP_METRIC not in values:
        return None
    step = int(values[metric.STEP_METRIC])
    total = int(values[metric.TOTAL_STEPS_METRIC]) if metric.TOTAL_STEPS_METRIC in values else None
    eta_seconds = values.get(metric.ETA_METRIC)
    rate = values.get(metric.TOKENS_PER_SECOND_METRIC)
    checkpoint = values.get(metric.CHECKPOINT_STEP_METRIC)
    validation_loss = values.get(metric.VALIDATION_LOSS_METRIC)
    validation_step = values.get(metric.VALIDATION_STEP_METRIC)
    resumed = resumption(values.get(metric.RESUMED_FROM_STEP_METRIC), values.get(metric.SET_ASIDE_METRIC))
    progress = Progress(
        step=step,
        total_steps=total,
        percent=100 * step // total if total else 0,
        tokens_per_second=round(rate * world_size, 1) if rate is not None else None,
        eta=_rfc3339(now + timedelta(seconds=eta_seconds)) if eta_seconds is not None else None,
        last_checkpoint_step=int(checkpoint) if checkpoint is not None else None,
        validation_loss=validation_loss if validation_loss is not None and math.isfinite(validation_loss) else None,
        validation_step=int(validation_step) if validation_step is not None else None,
        updated=_rfc3339(now),
    )
    return TrainerReport(progress, resumed)


def rank0_address(pods: Sequence[Mapping[str, Any]], job_uid: str | None) -> str | None:
    """The pod IP of node rank 0 among an attempt's pods, once it has one; only a pod the job with
    ``job_uid`` controls counts."""
    for pod in pods:
        if (pod.get("metadata", {}).get("labels") or {}).get(RANK_LABEL) == "0" and owned_by(pod, job_uid):
            return (pod.get("status") or {}).get("podIP")
    return None


class ScrapeRefused(Exception):
    """The reply is not one the operator reads (too large)."""


async def _read_bounded(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise ScrapeRefused(f"Content-Length {response.content_length} is over {max_bytes} bytes")
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise ScrapeRefused(f"the reply is over {max_bytes} bytes")
    return bytes(body)


def _parse(body: bytes, world_size: int) -> TrainerReport | None:
    try:
        return parse_trainer_metrics(body.decode("utf-8", errors="replace"), world_size, datetime.now(UTC))
    except ValueError as error:  # not the exposition format
        raise ScrapeRefused(f"not Prometheus text: {str(error)[:200]}") from error


async def fetch_progress(
    session: aiohttp.ClientSession,
    address: str,
    port: int,
    world_size: int,
    *,
    timeout: float = SCRAPE_TIMEOUT_SECONDS,
    max_bytes: int = SCRAPE_MAX_BYTES,
) -> TrainerReport | None:
    """GET rank 0's /metrics; None when it does not answer in ``timeout`` seconds (starting up, or gone) or
    answers with something the operator does not read (over ``max_bytes``, not the exposition format)."""
    url = f"http://{address}:{port}/metrics"
    try:
        async with asyncio.timeout(timeout):  # the whole exchange, however slowly the bytes trickle in
            async with session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
            ) as response:
                if response.status != 200:
                    return None
                body = await _read_bounded(response, max_bytes)
        # Parsing is CPU work (bounded by max_bytes): in a worker thread, so the event loop stays live.
        return await asyncio.to_thread(_parse, body, world_size)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    except ScrapeRefused as refused:
        log.warning(f"rank 0's metrics at {url} ignored: {refused}")
        return None
