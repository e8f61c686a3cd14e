"""The README's `memfit plan` and `memfit profile` examples are what memfit prints (regenerate them:
python -m tests.readme_outputs)."""

from __future__ import annotations

import pytest

from tests.readme_outputs import README, blocks, comparable, run

TEXT = README.read_text()


def test_the_readme_has_its_examples() -> None:
    assert len(blocks(TEXT)) >= 4


EXAMPLES = [
    # `memfit profile` builds a model in a subprocess that imports torch (seconds)
    pytest.param(*block, marks=[pytest.mark.slow] if block[0].startswith("memfit profile") else [])
    for block in blocks(TEXT)
]


@pytest.mark.parametrize(("command", "start", "end"), EXAMPLES, ids=lambda value: str(value)[:60])
@pytest.mark.slow
def test_each_example_is_the_output_of_its_command(command: str, start: int, end: int) -> None:
    assert comparable(TEXT[start:end]) == comparable(run(command)), (
        f"the README's output of `{command}` is stale: python -m tests.readme_outputs"
    )
