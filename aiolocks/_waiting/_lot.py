"""A lot: the waiters of one channel in this process, parked in arrival order.

Each `Waiter` sleeps on its own future and is woken by a grant for its token, a hint that
the server state changed, the caller's deadline, the end of its own short wait, or its
lot's timer. Only the head of a lot keeps the safety-net timer at the current lease's end,
so a long wait costs one re-check per lease per process, not one per waiter: the timer is
the lot's (one per lot, re-armed lazily), so a new head is not woken to take it over.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterator

__all__ = ["Lot", "Waiter", "Wake"]


class Wake(enum.Enum):
    """Why a sleeping waiter woke up."""

    GRANTED = "granted"  # a grant message for its token arrived: it holds the primitive
    RECHECK = "recheck"  # the server state may have changed: re-run acquire
    TIMER = "timer"  # the lot's safety-net timer (the holder's lease may have ended)
    DEADLINE = "deadline"  # the caller's timeout ran out
    UNTIL = "until"  # the sleep's own bound ran out (a back-off)


class Waiter:
    """One parked acquisition: its token, and what it has been told while parked."""

    __slots__ = (
        "_deadline_timer",
        "_future",
        "_recheck",
        "deadline",
        "fence",
        "floor",
        "granted_at",
        "lot",
        "member",
        "queued_at",
        "token",
        "ttl_ms",
    )

    def __init__(
        self, lot: Lot, token: str, ttl_ms: int, member: str, deadline: float | None = None
    ) -> None:
        self.lot = lot
        self.token = token
        self.ttl_ms = ttl_ms
        self.member = member  # its queue entry on the server
        self.deadline = deadline  # the caller's (monotonic), for the whole acquisition
        self.fence: int | None = None
        # The highest fence floor of a server answer that found it not holding (queued,
        # busy): a grant at or below it was made before that answer and has been ended since,
        # so it is never believed (a message or reply that arrives late, issue 24).
        self.floor = 0
        # A moment (monotonic) known to precede any grant it may get: when a call that
        # found it not granted (its queue call, a heartbeat) was sent. A grant's lease is
        # counted from here, never from when the news arrived (a stalled loop reads late).
        self.queued_at = 0.0
        self.granted_at = 0.0
        self._recheck = False
        self._future: asyncio.Future[Wake] | None = None
        # One deadline timer for the whole acquisition (armed by its first sleep).
        self._deadline_timer: asyncio.TimerHandle | None = None

    def still_queued(self, sent_at: float) -> None:
        """A call sent at `sent_at` found this waiter not yet granted."""
        if sent_at > self.queued_at:
            self.queued_at = sent_at

    def not_holding(self, floor: int) -> None:
        """A server answer found it not holding, with the name's fence floor `floor`: a
        grant at or below it (read before this answer, or arriving after it) is stale."""
        if floor > self.floor:
            self.floor = floor
        if self.fence is not None and self.fence <= floor:
            self.fence = None

    def stale(self, fence: int) -> bool:
        """A grant with `fence` was made before an answer that found it not holding."""
        return fence <= self.floor

    def grant(self, fence: int, after: float | None = None) -> None:
        """Its grant arrived; `after` is a moment known to precede it (the granting call's
        sending), if any. A stale grant (`stale`) is dropped."""
        if self.stale(fence):
            return
        if self.fence is None:
            self.fence = fence
            self.granted_at = max(self.queued_at, after or 0.0)
        self._wake(Wake.GRANTED)

    def forget_grant(self) -> None:
        """Drop a grant that is to be confirmed with the server (re-run acquire)."""
        self.fence = None

    def recheck(self) -> None:
        self._recheck = True
        self._wake(Wake.RECHECK)

    def _wake(self, reason: Wake) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(reason)

    def stop(self) -> None:
        """It leaves the queue: no timer of its own outlives it."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    async def sleep(self, until: float | None = None) -> Wake:
        """Sleep until told something (GRANTED, RECHECK), the lot's lease timer if it is the
        head (TIMER), the caller's deadline (DEADLINE) or `until` (UNTIL)."""
        while True:
            if self.fence is not None:
                return Wake.GRANTED
            if self._recheck:
                self._recheck = False
                return Wake.RECHECK
            now = time.monotonic()
            deadline = self.deadline
            if deadline is not None and now >= deadline:
                return Wake.DEADLINE
            end = self.lot.lease_end
            if end is not None and now >= end and self.lot.head() is self:
                return Wake.TIMER  # the lot's timer fired while it was not asleep
            if until is not None and now >= until:
                return Wake.UNTIL
            loop = asyncio.get_running_loop()
            future: asyncio.Future[Wake] = loop.create_future()
            self._future = future
            if deadline is not None and self._deadline_timer is None:
                self._deadline_timer = loop.call_at(
                    loop.time() + (deadline - now), self._wake, Wake.DEADLINE
                )
            until_timer = None
            if until is not None:
                until_timer = loop.call_at(
                    loop.time() + (until - now), _resolve, future, Wake.UNTIL
                )
            try:
                reason = await future
            finally:
                self._future = None
                if until_timer is not None:
                    until_timer.cancel()
            if reason in (Wake.GRANTED, Wake.RECHECK):
                continue  # the flags decide
            if deadline is not None and time.monotonic() >= deadline:
                return Wake.DEADLINE
            return reason


def _resolve(future: asyncio.Future[Wake], reason: Wake) -> None:
    if not future.done():
        future.set_result(reason)


class Lot:
    """The waiters of one channel in this process, in arrival order, and their one
    safety-net timer at the first lease end in the way."""

    __slots__ = ("_timer", "_timer_at", "_waiters", "channel", "lease_end", "shared")

    def __init__(self, channel: bytes, shared: bool = False) -> None:
        self.channel = channel
        self._waiters: dict[str, Waiter] = {}
        # When the first lease in the way ends, as far as we know (monotonic).
        self.lease_end: float | None = None
        # Several holders at once (a semaphore, a read-write lock): a grant adds a lease
        # and ends none, so it can only bring the first lease end closer.
        self.shared = shared
        # The safety-net timer, armed (while there are waiters) at `_timer_at`, which is
        # never later than `lease_end`: a lease end that moves later is followed when the
        # timer fires, not by re-arming on each grant.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        return iter(list(self._waiters.values()))

    def head(self) -> Waiter | None:
        return next(iter(self._waiters.values()), None)

    def note_lease(self, remaining_ms: int, *, grant: bool = False) -> None:
        """Record that the first lease in the way has `remaining_ms` left (an acquire
        script's answer), or (`grant`) that a lease of `remaining_ms` was just granted."""
        end = time.monotonic() + max(remaining_ms, 0) / 1000.0 + 0.002
        if grant and self.shared and self.lease_end is not None:
            end = min(end, self.lease_end)
        self.lease_end = end
        if self._waiters and (self._timer is None or end < self._timer_at):
            self._arm(end)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_at = at
        self._timer = loop.call_at(loop.time() + (at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        end, head = self.lease_end, self.head()
        if end is None or head is None:
            return
        if end > time.monotonic():
            self._arm(end)  # the lease end moved later meanwhile: no wake
        else:
            head._wake(Wake.TIMER)  # if it is not asleep, its next sleep sees the end passed

    def add(self, waiter: Waiter) -> None:
        """`waiter` parks last."""
        self._waiters[waiter.token] = waiter

    def discard(self, waiter: Waiter) -> bool:
        """`waiter` leaves (see `WaitQueue.remove`); False if it was not parked here."""
        return self._waiters.pop(waiter.token, None) is not None

    def promoted(self) -> None:
        """Its head left: a timer that already fired is re-armed, so the new head re-checks
        a lease end nobody has re-checked since."""
        if self._timer is None and self.lease_end is not None:
            self._arm(self.lease_end)

    def emptied(self) -> None:
        """Its last waiter left: no timer outlives it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
