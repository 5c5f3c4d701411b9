"""What the lease keeper keeps alive: a held `Lease` (and the `Holding` that owns it: one
acquisition of one task), and a `HeartbeatGroup` of waiters.

Each lease keeps a conservative local validity on the monotonic clock, counted from when
the request that granted or last renewed it was *sent* (`validity`); when a renewal finds
another owner, or the validity runs out while Redis cannot be reached, the lease is
reported lost (to its `owner`), never silently dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._scripts import Script

if TYPE_CHECKING:
    from .._waiting._lot import Waiter
    from ._renewbatch import Entry

__all__ = [
    "Callbacks",
    "HeartbeatGroup",
    "Holding",
    "Lease",
    "LeaseOwner",
    "Owner",
    "current_task",
    "validity",
]

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


class Owner(Protocol):
    """What a holding calls on the lock it belongs to (its lease's two callbacks)."""

    def _lease_lost(self, holding: Holding, reason: str) -> None: ...

    async def _give_back_holding(self, holding: Holding) -> bool | None: ...


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease.

    Kept small, as a process may hold 100,000 at once and the garbage collector goes
    through every one at each full collection: the `lost` event is made only when asked
    for, and the `async with` body is cancelled through its task, without a cancel scope.
    """

    __slots__ = (
        "body",
        "cancelled",
        "cap",
        "fence",
        "lease",
        "lock",
        "lost_event",
        "lost_reason",
        "task",
        "token",
    )

    def __init__(self, lock: Owner, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.lock = lock
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost_reason: str | None = None  # set once: the holding is lost
        self.lost_event: asyncio.Event | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`
        self.body = False  # its task is in the body of `async with`: a loss cancels it
        self.cancelled = False  # a loss cancelled its task (to be taken back at the exit)

    @property
    def is_lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def lost(self) -> asyncio.Event:
        """Set when the holding is lost; made when first asked for."""
        if self.lost_event is None:
            self.lost_event = asyncio.Event()
            if self.lost_reason is not None:
                self.lost_event.set()
        return self.lost_event

    def mark_lost(self, reason: str) -> None:
        """Record the loss and set the `lost` event, if one was made."""
        self.lost_reason = reason
        if self.lost_event is not None:
            self.lost_event.set()

    def cancel_body(self) -> None:
        """Cancel the task's `async with` body at the loss, as a cancel scope would: at
        once if the task waits, else at its next wait (never the task's own clean-up)."""
        if not self.body or self.cancelled:
            return
        if self.task is asyncio.current_task():
            asyncio.get_running_loop().call_soon(self.cancel_body)
            return
        self.cancelled = True
        self.task.cancel()

    def end_body(self) -> None:
        """The body has ended: the cancellation `cancel_body` asked for is taken back (as
        a cancel scope's exit does), so that only others' requests stay counted."""
        self.body = False
        if self.cancelled:
            self.cancelled = False
            self.task.uncancel()

    # As its lease's owner (`LeaseOwner`): the lease calls these on the holding
    # itself, so no callback object is made per holding (a burst of 100,000 holdings would
    # be that many more objects for every full collection of the garbage collector).
    def lease_lost(self, reason: str) -> None:
        self.lock._lease_lost(self, reason)

    async def give_back(self) -> bool | None:
        return await self.lock._give_back_holding(self)


def current_task() -> asyncio.Task[Any]:
    """The task that acquires, releases or hands over: holdings belong to it."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("aiolocks must be used from inside an asyncio task")
    return task


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
