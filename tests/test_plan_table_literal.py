"""`memfit plan`'s table prints what users wrote literally: no rich markup, emoji codes or terminal escapes."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from memfit.api.finetunejob import FineTuneJob
from memfit.api.gpupool import GPUPool
from memfit.api.plan import PlanResult
from memfit.cli.plan_table import literal, print_plan_table
from memfit.planner.search import plan_job
from tests.planning_fixtures import pool

HOSTILE = [
    "closes[/]",  # a closing tag with nothing open: rich raises MarkupError
    "[link=https://example.com]hidden[/link]",  # a hyperlink: the text is hidden behind it
    "[bold red]loud[/bold red]",
    ":smile:",  # an emoji code
    "\x1b[2J\x1b[H",  # clear the screen
    "\x1b]8;;https://example.com\x1b\\\\link\x1b]8;;\x1b\\\\",  # an OSC 8 hyperlink
    "bell\x07 csi\x9b31m rtl\u202eolleh",  # BEL, an 8-bit CSI, a right-to-left override
    "two\nlines\ttab",
]
RICH_STYLES = re.compile("\x1b\\[[0-9;]*m")
"""The SGR codes rich itself writes for colours and bold."""


def hostile_job(text: str, method: str = "lora", preset: str = "qwen2.5-0.5b") -> FineTuneJob:
    job = FineTuneJob.model_validate({"metadata": {"name": "plain"}, "spec": {
        "model": {"name": "plain", "architecture": {"preset": preset}}, "dataset": {"source": {"pvc": "data"}},
        "output": {"pvc": "out"}, "method": method,
        "training": {"globalBatchSize": 8, "sequenceLength": 512}}})  # fmt: skip
    # Names as a user could write them (bypassing whatever validation the API models may add later).
    model = job.spec.model.model_copy(update={"name": f"org/{text}"})
    return job.model_copy(update={
        "metadata": job.metadata.model_copy(update={"name": f"job-{text}"}),
        "spec": job.spec.model_copy(update={"model": model})})  # fmt: skip


def hostile_pool(text: str) -> GPUPool:
    base = pool("p", "NVIDIA-A100-SXM4-80GB", 2, 1, 500)
    return base.model_copy(update={"metadata": base.metadata.model_copy(update={"name": f"pool-{text}"})})


def render(job: FineTuneJob, result: PlanResult) -> str:
    out = io.StringIO()
    # A terminal with colours: rich writes its own escape codes, so only the user's are looked for.
    print_plan_table(job, result, Console(file=out, width=400, force_terminal=True, color_system="truecolor"))
    return out.getvalue()


def plain(text: str) -> str:
    """``text`` as ``literal`` shows it (each control character as its escape)."""
    return literal(text).plain


@pytest.mark.parametrize("text", HOSTILE)
def test_names_with_markup_and_escape_codes_print_literally(text: str) -> None:
    job, pools = hostile_job(text), [hostile_pool(text)]
    result = plan_job(job.spec, pools)
    assert result.chosen is not None
    out = render(job, result)
    shown = plain(text)
    assert f"job-{shown}" in out and f"org/{shown}" in out and f"pool-{shown}" in out
    assert "😄" not in out
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", RICH_STYLES.sub("", out))


@pytest.mark.parametrize("text", HOSTILE)
@pytest.mark.slow
def test_nothing_fits_prints_advice_and_misses_literally(text: str) -> None:
    job, pools = hostile_job(text, method="full", preset="llama-2-70b"), [hostile_pool(text)]
    result = plan_job(job.spec, pools)
    assert result.chosen is None and result.rejected
    out = render(job, result)
    assert f"pool-{plain(text)}" in out
    assert "Nothing fits." in out


def test_control_characters_become_their_escapes() -> None:
    assert literal("a\x1b[31mb\x07c\x9bd\u202ee\nf").plain == "a\\x1b[31mb\\x07c\\x9bd\\u202ee\\nf"
    assert literal("[/] [link=x]y[/link] :smile:").plain == "[/] [link=x]y[/link] :smile:"
    assert literal("naïve 模型 🙂").plain == "naïve 模型 🙂"  # printable text is kept as it is
