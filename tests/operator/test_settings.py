"""The operator's settings from the environment, as the chart's Deployment sets them."""

from __future__ import annotations

import json

import pytest

from memfit.units import GIB
from memfit_operator.settings import OperatorSettings

PEERS = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]


def test_defaults_make_no_network_policies_and_announce_peering_every_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MEMFIT_NETWORK_POLICY", "MEMFIT_NETWORK_POLICY_METRICS_FROM", "MEMFIT_PEERING_NOTICE_SECONDS",
                 "MEMFIT_TRAINER_CACHE_GIB"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    settings = OperatorSettings.from_environment()
    assert settings.peering_notice_seconds == 60 and not settings.network_policy
    options = settings.trainer_options()
    assert (options.network_policy, options.metrics_peers, options.cache_bytes) == (False, (), 50 * GIB)


def test_the_charts_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_NETWORK_POLICY", "true")
    monkeypatch.setenv("MEMFIT_NETWORK_POLICY_METRICS_FROM", json.dumps(PEERS))
    monkeypatch.setenv("MEMFIT_TRAINER_CACHE_GIB", "120")
    monkeypatch.setenv("MEMFIT_PEERING_NOTICE_SECONDS", "1")
    settings = OperatorSettings.from_environment()
    options = settings.trainer_options()
    assert options.network_policy and list(options.metrics_peers) == PEERS and options.cache_bytes == 120 * GIB
    assert settings.peering_notice_seconds == 1


@pytest.mark.parametrize("value", ['{"podSelector": {}}', "[1]", "not json"])
def test_peers_that_are_not_a_list_of_objects_are_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MEMFIT_NETWORK_POLICY_METRICS_FROM", value)
    with pytest.raises(ValueError):
        OperatorSettings.from_environment()


def test_a_setting_that_is_not_a_number_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a Service named memfit-metrics puts in a pod whose enableServiceLinks is left on.
    monkeypatch.setenv("MEMFIT_METRICS_PORT", "tcp://10.96.0.191:8080")
    with pytest.raises(ValueError, match=r"MEMFIT_METRICS_PORT='tcp://10.96.0.191:8080' is not a number"):
        OperatorSettings.from_environment()
