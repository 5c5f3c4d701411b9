"""What the lease keeper keeps alive: a held `Lease`, and a `HeartbeatGroup` of waiters.

Each lease keeps a conservative local validity on the monotonic clock, counted from when
the request that granted or last renewed it was *sent* (`validity`); when a renewal finds
another owner, or the validity runs out while Redis cannot be reached, the lease is
reported lost (`on_lost`), never silently dropped.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._scripts import Script

if TYPE_CHECKING:
    from ._lot import Waiter
    from ._renewbatch import Entry

__all__ = ["HeartbeatGroup", "Lease", "validity"]

# Validity is shortened by this much of the ttl (plus 2 ms) to allow for clock drift
# between this host and the server, as in the Redlock analysis.
_DRIFT = 0.01


def validity(sent_at: float, ttl: float) -> float:
    """The monotonic time until which a lease granted (or renewed) by a call sent at `sent_at`
    is known to be held."""
    return sent_at + ttl * (1 - _DRIFT) - 0.002


class Lease:
    """One held lease: how to renew it, until when it is known valid, whom to tell if lost."""

    __slots__ = (
        "args",
        "entry",
        "keys",
        "lost",
        "next_due",
        "on_lost",
        "queued",
        "release",
        "script",
        "ttl",
        "valid_until",
    )

    def __init__(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        ttl: float,
        granted_at: float,
        on_lost: Callable[[str], None],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.ttl = ttl
        self.valid_until = validity(granted_at, ttl)
        self.next_due = granted_at + ttl / 3
        self.on_lost = on_lost
        self.lost = False
        self.queued: float | None = None  # the key of its live heap entry (the keeper's)
        self.entry: Entry | None = None  # its part of a batch call, made once
        # Gives it back, when the event loop ends while it is held (set by its holder).
        self.release: Callable[[], Awaitable[object]] | None = None

    @property
    def remaining(self) -> float:
        return max(0.0, self.valid_until - time.monotonic())


class HeartbeatGroup:
    """The waiters of one primitive's queue (one `waiters` key) in this process; `keys` are
    the waiters key, then the keys heartbeat.lua keeps alive with them."""

    __slots__ = ("keys", "next_due", "period", "queued", "slot", "waiters")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self.waiters: dict[str, Waiter] = {}
        self.next_due = float("inf")
        self.period = float("inf")  # a third of its shortest waiter's ttl
        self.queued: float | None = None
        self.slot = -1  # its Cluster slot, once asked
