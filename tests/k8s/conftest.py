"""The envtest API server fixture (one per test module), and each test's call report kept on its node so
fixtures can show the operator's log when a test failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.k8s.apiserver import ApiServer, running_apiserver


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    with running_apiserver() as running:
        yield running
