"""`statistics()`: a cheap local snapshot of one primitive instance (no Redis call).

What this process knows of an instance (its holdings and waiting tasks here, the current
task's lease) and its cumulative counters (kept by `_telemetry`'s hooks); `inspect()` is
the call that asks the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lockcore import LockCore

__all__ = ["LockStatistics", "snapshot"]


@dataclass(frozen=True, slots=True)
class LockStatistics:
    """A cheap local snapshot of one primitive instance (no Redis call)."""

    name: str
    held_here: int  # holdings of this instance in this process
    tasks_waiting: int  # tasks of this instance waiting to acquire
    lease_remaining: float | None  # seconds the current task's lease is known valid, if held
    lost: bool  # the current task's holding was lost
    # Cumulative, for this instance since it was made (every task, this process):
    acquisitions: int = 0  # acquire() calls that got it
    timeouts: int = 0  # acquire() calls whose timeout ran out (LockTimeout included)
    leases_lost: int = 0  # holdings whose lease was lost
    handoffs: int = 0  # waiters its releases let in (each a grant made by the release)


def snapshot(lock: LockCore) -> LockStatistics:
    """`lock`'s statistics as the current task sees them."""
    holding = lock._current()
    lease = None if holding is None else holding.lease
    counters = lock._spec.counters
    return LockStatistics(
        name=lock._name,
        held_here=len(lock._holdings),
        tasks_waiting=lock._waiting,
        lease_remaining=None if lease is None or lease.lost else lease.remaining,
        lost=holding is not None and holding.is_lost,
        acquisitions=counters.acquisitions,
        timeouts=counters.timeouts,
        leases_lost=counters.leases_lost,
        handoffs=counters.handoffs,
    )
