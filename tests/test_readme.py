"""The README's `memfit plan` examples are what memfit prints (regenerate: python tests/readme_outputs.py)."""

from __future__ import annotations

import pytest

from tests.readme_outputs import README, blocks, comparable, run

TEXT = README.read_text()


def test_the_readme_has_plan_examples() -> None:
    assert len(blocks(TEXT)) >= 2


@pytest.mark.parametrize(("command", "start", "end"), blocks(TEXT), ids=lambda value: str(value)[:60])
def test_each_plan_example_is_the_output_of_its_command(command: str, start: int, end: int) -> None:
    assert comparable(TEXT[start:end]) == comparable(run(command)), (
        f"the README's output of `{command}` is stale: python tests/readme_outputs.py"
    )
