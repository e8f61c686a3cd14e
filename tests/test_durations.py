"""The file times the suite is ordered by (tests/durations.py), read from a JUnit report."""

from __future__ import annotations

from pathlib import Path

from tests.durations import file_durations, file_of

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_durations" name="test_a" time="1.4" />
<testcase classname="tests.trainer.test_fsdp2" name="test_b[x]" time="30.2" />
<testcase classname="tests.trainer.test_fsdp2" name="test_b[y]" time="12.5" />
<testcase classname="tests.test_no_such_file" name="test_c" time="99" />
</testsuite></testsuites>"""


def test_each_file_sums_its_tests_longest_first_and_unknown_classnames_are_left_out(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    assert list(file_durations(report).items()) == [("tests/trainer/test_fsdp2.py", 43), ("tests/test_durations.py", 1)]


def test_a_class_in_a_module_names_the_module() -> None:
    assert file_of("tests.test_durations.SomeClass") == "tests/test_durations.py"
    assert file_of("tests.nothing_here") is None
