"""Figures of the fault-injection suite, shown at the end of the pytest run when asked for.

Each fault test calls `record(...)` with what it counted: trials, violations, orphaned
keys and recovery times. The figures are reported, not asserted (timings depend on the
machine); the tests assert the counts that must be zero themselves.

The table is printed only with `--fault-figures` (or `AIOLOCKS_FAULT_FIGURES=1`), or
written to a file with `--fault-figures=PATH` (`AIOLOCKS_FAULT_FIGURES=PATH`); otherwise a
run says in one line how to get it. A test's records travel in its report's
`user_properties`, so the figures add up the same with pytest-xdist's workers as without.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

__all__ = [
    "Figures",
    "pytest_addoption",
    "pytest_runtest_logreport",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
    "record",
]

_PROPERTY = "aiolocks-fault-figures"
_ENV = "AIOLOCKS_FAULT_FIGURES"
_TERMINAL = "-"


@dataclass
class Figures:
    trials: int = 0
    violations: int = 0
    orphaned: int = 0
    recover: list[float] = field(default_factory=list)  # seconds
    notes: list[str] = field(default_factory=list)


# Records of the test running in this process, not yet in a report.
_PENDING: list[dict[str, Any]] = []
# The run's figures, added up from the reports (in the process that reports: the only one,
# or xdist's controller).
_FIGURES: dict[str, Figures] = {}


def record(
    fault: str,
    *,
    trials: int,
    violations: int = 0,
    orphaned: int = 0,
    recover: list[float] | None = None,
    note: str | None = None,
) -> None:
    """Add one test's counts to the figures of `fault`."""
    _PENDING.append(
        {
            "fault": fault,
            "trials": trials,
            "violations": violations,
            "orphaned": orphaned,
            "recover": list(recover or []),
            "note": note,
        }
    )


def _add(entry: dict[str, Any]) -> None:
    figures = _FIGURES.setdefault(entry["fault"], Figures())
    figures.trials += entry["trials"]
    figures.violations += entry["violations"]
    figures.orphaned += entry["orphaned"]
    figures.recover += entry["recover"]
    if entry["note"]:
        figures.notes.append(entry["note"])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fault-figures",
        nargs="?",
        const=_TERMINAL,
        default=os.environ.get(_ENV) or None,
        metavar="PATH",
        help="print the fault-injection suite's figures at the end, or write them to PATH "
        f"(also: {_ENV}=1 or ={'{PATH}'})",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """Hand the records made in this phase (setup, call or teardown) to its report."""
    if _PENDING:
        item.user_properties.append((f"{_PROPERTY}:{call.when}", list(_PENDING)))
        _PENDING.clear()
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The item's properties go into each of its phases' reports: take this phase's only.
    mine = f"{_PROPERTY}:{report.when}"
    for name, value in report.user_properties:
        if name == mine:
            for entry in cast(list[dict[str, Any]], value):
                _add(entry)


def _ms(value: float) -> str:
    return f"{value * 1000:.0f}"


def _table() -> list[str]:
    lines = [f"{'fault':<44} {'trials':>7} {'viol.':>6} {'orphans':>8} {'recover ms med/max':>19}"]
    for fault, figures in sorted(_FIGURES.items()):
        times = figures.recover
        recover = f"{_ms(statistics.median(times))}/{_ms(max(times))}" if times else "-"
        lines.append(
            f"{fault:<44} {figures.trials:>7} {figures.violations:>6} "
            f"{figures.orphaned:>8} {recover:>19}"
        )
        lines += [f"    {note}" for note in figures.notes]
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not _FIGURES or hasattr(config, "workerinput"):
        return
    where: str | None = config.getoption("--fault-figures")
    if where is None:
        terminalreporter.write_line(
            f"fault injection figures: {len(_FIGURES)} faults recorded; "
            "--fault-figures prints them, --fault-figures=PATH writes them to a file"
        )
        return
    if where in (_TERMINAL, "1"):
        terminalreporter.section("fault injection figures")
        for line in _table():
            terminalreporter.write_line(line)
        return
    Path(where).write_text("\n".join(_table()) + "\n")
    terminalreporter.write_line(f"fault injection figures written to {where}")
