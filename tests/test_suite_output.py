"""The suite's own output stays readable: the fault-injection figures only when asked for
(or in a file), and added up the same across pytest-xdist's workers."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# pytest in subprocesses: not in the quick loop (`-m "not slow ..."`).
pytestmark = pytest.mark.slow

# A suite of two "fault tests" recording figures through the real plugin.
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from _faultreport import pytest_addoption as pytest_addoption
from _faultreport import pytest_runtest_logreport as pytest_runtest_logreport
from _faultreport import pytest_runtest_makereport as pytest_runtest_makereport
from _faultreport import pytest_terminal_summary as pytest_terminal_summary
"""
FAULT_TESTS = """
import pytest
from _faultreport import record

@pytest.mark.parametrize("n", range(4))
def test_a_fault(n):
    record("dropped link", trials=10, recover=[0.010 * (n + 1)], note=f"case {n}")
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("AIOLOCKS_FAULT_FIGURES", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_faults=FAULT_TESTS)
    return pytester


def test_the_figures_are_one_line_unless_asked_for(suite: pytest.Pytester) -> None:
    ran = suite.runpytest_subprocess("-p", "no:cacheprovider")
    ran.assert_outcomes(passed=4)
    out = ran.stdout.str()
    assert "fault injection figures: 1 faults recorded; --fault-figures prints them" in out
    assert "dropped link" not in out


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_asked_for_they_add_up_across_workers(suite: pytest.Pytester, workers: list[str]) -> None:
    ran = suite.runpytest_subprocess("-p", "no:cacheprovider", "--fault-figures", *workers)
    ran.assert_outcomes(passed=4)
    ran.stdout.re_match_lines([r".* fault injection figures .*", r"dropped link +40 +0 +0 +25/40"])
    assert sorted(line.strip() for line in ran.stdout.lines if "case " in line) == [
        f"case {n}" for n in range(4)
    ]


def test_they_go_to_a_file_when_given_one(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = suite.path / "figures.txt"
    monkeypatch.setenv("AIOLOCKS_FAULT_FIGURES", str(target))
    ran = suite.runpytest_subprocess("-p", "no:cacheprovider")
    ran.assert_outcomes(passed=4)
    assert f"fault injection figures written to {target}" in ran.stdout.str()
    assert "dropped link" in target.read_text() and "dropped link" not in ran.stdout.str()
