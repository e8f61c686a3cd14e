"""What the operator says while kopf waits for a missing peering object (memfit_operator.peering); the real
thing, against an API server, is tests/k8s/test_peering.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from memfit_operator.cluster_api import Peering
from memfit_operator.peering import announce_missing_peering, waiting_message


def test_the_message_names_the_object_and_both_ways_out() -> None:
    message = waiting_message(Peering.NO_OBJECT, None, "memfit")
    assert "ClusterKopfPeering 'memfit' (cluster-scoped)" in message and "does not exist" in message
    manifest = json.loads(message.split("`echo '")[1].split("'")[0])
    assert manifest == {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "memfit"}}
    assert "--standalone" in message and "memfit crd" not in message


def test_a_namespaced_operator_waits_for_a_kopfpeering_in_its_namespace() -> None:
    message = waiting_message(Peering.NO_CRD, "research", "memfit-prod")
    assert "KopfPeering 'memfit-prod' in namespace research" in message
    assert "its CRD kopfpeerings.kopf.dev is not installed" in message
    assert "`memfit crd | kubectl apply -f -`" in message and "--standalone" in message
    manifest = json.loads(message.split("`echo '")[1].split("'")[0])
    assert manifest["metadata"] == {"name": "memfit-prod", "namespace": "research"}


def test_the_notice_comes_at_start_repeats_while_missing_and_ends_when_found(caplog: pytest.LogCaptureFixture) -> None:
    answers = [Peering.NO_CRD, Peering.NO_OBJECT, Peering.NO_OBJECT, Peering.FOUND, Peering.FOUND]

    def lookup() -> Peering:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async def run() -> None:
        task = asyncio.create_task(announce_missing_peering(lookup, None, "memfit", every=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="memfit.operator"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if line.startswith("Waiting for the kopf peering object")]) == 3
    assert "is not installed" in lines[0] and "does not exist" in lines[1]
    assert lines[3:] == ["The kopf peering object ClusterKopfPeering 'memfit' exists: handlers resume."]


def test_a_failed_lookup_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def lookup() -> Peering:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("connection refused")
        return Peering.FOUND

    async def run() -> None:
        task = asyncio.create_task(announce_missing_peering(lookup, "research", "memfit", every=0.01))
        await asyncio.sleep(0.1)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="memfit.operator"):
        asyncio.run(run())
    assert len(calls) > 2
    assert [r.getMessage() for r in caplog.records] == [
        "Cannot check the kopf peering object KopfPeering 'memfit': connection refused"
    ]
