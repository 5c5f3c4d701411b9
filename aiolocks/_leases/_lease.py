"""What the lease keeper keeps alive: a held `Lease`, and a `HeartbeatGroup` of waiters.

Each lease keeps a conservative local validity on the monotonic clock, counted from when
the request that granted or last renewed it was *sent* (`validity`); when a renewal finds
another owner, or the validity runs out while Redis cannot be reached, the lease is
reported lost (to its `owner`), never silently dropped.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._scripts import Script

if TYPE_CHECKING:
    from .._waiting._lot import Waiter
    from ._renewbatch import Entry

__all__ = ["Callbacks", "HeartbeatGroup", "Lease", "LeaseOwner", "validity"]

# Validity is shortened by this much of the ttl (plus 2 ms) to allow for clock drift
# between this host and the server, as in the Redlock analysis.
_DRIFT = 0.01


def validity(sent_at: float, ttl: float) -> float:
    """The monotonic time until which a lease granted (or renewed) by a call sent at `sent_at`
    is known to be held."""
    return sent_at + ttl * (1 - _DRIFT) - 0.002


class LeaseOwner(Protocol):
    """Whom a lease tells of its loss, and how it is given back when the event loop ends
    while it is held (a `Holding` is its own lease's owner: no callback objects)."""

    def lease_lost(self, reason: str) -> None: ...

    def give_back(self) -> Awaitable[object]: ...


class Callbacks:
    """A `LeaseOwner` made of two callables (a cohort's lease, a multi-lock's names)."""

    __slots__ = ("give_back", "lease_lost")

    def __init__(
        self, lease_lost: Callable[[str], None], give_back: Callable[[], Awaitable[object]]
    ) -> None:
        self.lease_lost = lease_lost
        self.give_back = give_back


class Lease:
    """One held lease: how to renew it, until when it is known valid, whom to tell if lost."""

    __slots__ = (
        "args",
        "entry",
        "keys",
        "lost",
        "next_due",
        "owner",
        "queued",
        "releasing",
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
        owner: LeaseOwner,
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.ttl = ttl
        self.valid_until = validity(granted_at, ttl)
        self.next_due = granted_at + ttl / 3
        self.owner = owner
        self.lost = False
        # Being released: a loss is the release's to report, not the keeper's.
        self.releasing = False
        self.queued: float | None = None  # the key of its live heap entry (the keeper's)
        self.entry: Entry | None = None  # its part of a batch call, made once

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
