"""`memfit plan` over the hostile corpus of tests/hostile/generate.py: no traceback, no hang, and for every
bad file exit 2 with one printable line naming the file, the object and the field (or the line, for what is
not valid YAML); every valid edge case plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memfit.api.loading
from memfit.api.loading import InputError, PureStrictLoader, load_documents
from memfit.cli.main import main
from tests.hostile.generate import Case, cases, encoding_cases, write, yaml_cases

CASES = cases()
HANG_GUARD_S = 5
"""Per bad case, in-process: generous; each is refused in milliseconds."""
PLAN_GUARD_S = 60
"""Per valid case: a hang guard, not a timing test. Planning a hundred pools takes about 3 s on a free core
and passed 5 s on CI's loaded ones (issue 36 is the search's speed)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {case.name: path for case, path in write(tmp_path_factory.mktemp("hostile"))}


def check_bad(case: Case, path: Path, code: int, out: str, err: str) -> None:
    assert "Traceback" not in err
    assert code == 2, err
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    line = err[:-1]
    assert line.startswith("memfit plan: error: ")
    assert line.isprintable(), f"control characters must be escaped: {line!r}"
    assert len(line) < 2500, "echoed values must be cut short"
    assert str(path) in line, "the line names the file"
    for text in case.expect:
        assert text in line, f"{text!r} missing from {line!r}"


@pytest.mark.slow
def test_the_corpus_is_large_and_deterministic(tmp_path: Path) -> None:
    assert sum(not case.valid for case in CASES) >= 200
    assert sum(case.valid for case in CASES) >= 5
    assert [(c.name, c.content) for c in cases()] == [(c.name, c.content) for c in CASES]


def _guarded(case: Case) -> object:
    """The case under its hang guard (the corpus is written once, outside it); the valid ones are planned."""
    if case.valid:
        return pytest.param(case, marks=[pytest.mark.slow, pytest.mark.timeout(PLAN_GUARD_S, func_only=True)])
    return pytest.param(case, marks=pytest.mark.timeout(HANG_GUARD_S, func_only=True))


@pytest.mark.parametrize("case", [_guarded(case) for case in CASES], ids=[case.name for case in CASES])
def test_memfit_plan(case: Case, corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = corpus[case.name]
    code = main(["plan", str(path), "-o", "json"])
    out, err = capsys.readouterr()
    if case.valid:
        assert code in (0, 1), err
        assert err == ""
        assert "chosen" in json.loads(out)
    else:
        check_bad(case, path, code, out, err)


PARSER_CASES = [case for case in [*yaml_cases(), *encoding_cases()] if case.name not in ("too-many-values",)]


@pytest.mark.slow
@pytest.mark.parametrize("case", PARSER_CASES, ids=[case.name for case in PARSER_CASES])
def test_the_pure_python_parser_refuses_the_same(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where PyYAML is built without libyaml, its pure-Python parser feeds the same limits."""
    monkeypatch.setattr(memfit.api.loading, "new_loader", PureStrictLoader)
    path = tmp_path / f"{case.name}.yaml"
    path.write_bytes(case.content)
    with pytest.raises(InputError) as refused:
        load_documents(path)
    message = str(refused.value)
    assert message.isprintable() and str(path) in message
    assert all(text in message for text in case.expect), message


SAMPLE = [case for index, case in enumerate(CASES) if index % 20 == 0 or case.valid]


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLE, ids=[case.name for case in SAMPLE])
def test_the_console_script(case: Case, corpus: dict[str, Path]) -> None:
    """The installed `memfit` as a shell sees it: its exit code, and stderr."""
    path = corpus[case.name]
    completed = subprocess.run(
        [Path(sys.executable).parent / "memfit", "plan", path, "-o", "json"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    if case.valid:
        assert completed.returncode in (0, 1) and "Traceback" not in completed.stderr, completed.stderr
    else:
        check_bad(case, path, completed.returncode, completed.stdout, completed.stderr)
