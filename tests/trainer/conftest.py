import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "distributed: starts memfit-train under torchrun with 2 CPU ranks (about 20-60 s each)"
    )
