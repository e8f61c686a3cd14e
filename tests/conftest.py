"""The suite's collection order: the longest files first (``tests/durations.py``), so that pytest-xdist's two
workers end together instead of one running a long file alone at the end."""

from __future__ import annotations

import json

import pytest

from tests.durations import DURATIONS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files ordered by their last measured seconds, longest first (a new file counts as one second); the tests
    of a file keep their order (the sort is stable), and each file stays whole on one worker."""
    seconds: dict[str, int] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 1))
