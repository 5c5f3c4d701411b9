"""Figures of the fault-injection suite, printed at the end of the pytest run.

Each fault test calls `record(...)` with what it counted: trials, violations, orphaned
keys and recovery times. The figures are reported, not asserted (timings depend on the
machine); the tests assert the counts that must be zero themselves.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Figures", "pytest_terminal_summary", "record"]


@dataclass
class Figures:
    trials: int = 0
    violations: int = 0
    orphaned: int = 0
    recover: list[float] = field(default_factory=list)  # seconds
    notes: list[str] = field(default_factory=list)


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
    figures = _FIGURES.setdefault(fault, Figures())
    figures.trials += trials
    figures.violations += violations
    figures.orphaned += orphaned
    figures.recover += recover or []
    if note:
        figures.notes.append(note)


def _ms(value: float) -> str:
    return f"{value * 1000:.0f}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("fault injection figures")
    write(f"{'fault':<44} {'trials':>7} {'viol.':>6} {'orphans':>8} {'recover ms med/max':>19}")
    for fault, figures in sorted(_FIGURES.items()):
        times = figures.recover
        recover = f"{_ms(statistics.median(times))}/{_ms(max(times))}" if times else "-"
        write(
            f"{fault:<44} {figures.trials:>7} {figures.violations:>6} "
            f"{figures.orphaned:>8} {recover:>19}"
        )
        for note in figures.notes:
            write(f"    {note}")
