"""The local wait queue of one client: every lot, by channel, and every waiter, by token.

One queue serves every primitive of the client: `park` a waiter, deliver a grant to it by
token (`unpark`), tell a channel's waiters to re-check. It also remembers the tokens of
acquisitions that left while a grant may still come (`depart`).

A `Lot` (first, below) is the waiters of one channel in this process, parked in arrival
order. Each `Waiter` sleeps on its own future and is woken by a grant for its token, a hint that
the server state changed, the caller's deadline, the end of its own short wait, or its
lot's timer. Only the head of a lot keeps the safety-net timer at the current lease's end,
so a long wait costs one re-check per lease per process, not one per waiter: the timer is
the lot's (one per lot, re-armed lazily), so a new head is not woken to take it over.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Callable, Iterator

from .._base import _clock

__all__ = ["Lot", "WaitQueue", "Waiter", "Wake"]


# -- a lot: the waiters of one channel -----------------------------------------------------


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
            now = _clock.monotonic()
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
                self._deadline_timer = loop.call_later(deadline - now, self._wake, Wake.DEADLINE)
            until_timer = None
            if until is not None:
                until_timer = loop.call_later(until - now, _resolve, future, Wake.UNTIL)
            try:
                reason = await future
            finally:
                self._future = None
                if until_timer is not None:
                    until_timer.cancel()
            if reason in (Wake.GRANTED, Wake.RECHECK):
                continue  # the flags decide
            if deadline is not None and _clock.monotonic() >= deadline:
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
        end = _clock.monotonic() + max(remaining_ms, 0) / 1000.0 + 0.002
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
        self._timer = loop.call_later(at - _clock.monotonic(), self._fire)

    def _fire(self) -> None:
        self._timer = None
        end, head = self.lease_end, self.head()
        if end is None or head is None:
            return
        if end > _clock.monotonic():
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


# -- the wait queue: every lot of one client -----------------------------------------------


class WaitQueue:
    """All lots of one client: park / unpark(token) / recheck_first / recheck_all / remove."""

    __slots__ = ("_by_token", "_departed", "_lots", "tag")

    def __init__(self) -> None:
        self._lots: dict[bytes, Lot] = {}
        self._by_token: dict[str, Waiter] = {}
        # Tokens of acquisitions that left with the server maybe holding state for them
        # (cancelled, timed out): token -> (until when a grant may still come, what hands
        # such a grant on). See `depart`.
        # Oldest first, so expired ones are dropped from the front in O(1) each.
        self._departed: collections.OrderedDict[str, tuple[float, Callable[[], object]]] = (
            collections.OrderedDict()
        )
        # Names this client's queue entries on the server (see _prelude.lua).
        self.tag = _clock.token_hex(4)

    def member(self, token: str, ttl_ms: int, side: str) -> str:
        """The queue entry of an acquisition made through this client (see _prelude.lua)."""
        return f"{token}:{ttl_ms}:{self.tag}:{side}"

    def park(
        self,
        channel: bytes,
        token: str,
        ttl_ms: int,
        side: str,
        shared: bool = False,
        deadline: float | None = None,
    ) -> Waiter:
        """A waiter for `token`, last in its channel's lot; `deadline` (monotonic) is the
        caller's, for the whole acquisition."""
        lot = self._lots.get(channel)
        if lot is None:
            lot = self._lots[channel] = Lot(channel, shared)
        waiter = Waiter(lot, token, ttl_ms, self.member(token, ttl_ms, side), deadline)
        lot.add(waiter)
        self._by_token[token] = waiter
        return waiter

    def remove(self, waiter: Waiter) -> None:
        lot = waiter.lot
        was_head = lot.head() is waiter
        if not lot.discard(waiter):
            return
        self._by_token.pop(waiter.token, None)
        waiter.stop()
        if not lot:
            lot.emptied()
            del self._lots[lot.channel]
        elif was_head:
            lot.promoted()  # the lot's timer serves the new head: no wake

    def unpark(
        self, token: str, fence: int, after: float | None = None, channel: bytes | None = None
    ) -> bool:
        """Deliver a grant to the waiter holding `token` (`after`: a moment known to precede
        the grant); False if it is not ours. A stale grant (`Waiter.stale`) is dropped.
        `channel`: the name's the grant is for; a multi-lock's one token waits on one name
        at a time, and a late grant of another of its names must not wake that waiter."""
        waiter = self._by_token.get(token)
        if waiter is None:
            departed = self._departed.pop(token, None)
            if departed is None:
                return False
            departed[1]()  # granted after it left: handed on at once
            return True
        if channel is not None and waiter.lot.channel != channel:
            return False
        if waiter.stale(fence):
            return True
        waiter.grant(fence, after)
        return True

    def depart(self, token: str, within: float, hand_on: Callable[[], object]) -> None:
        """An acquisition of `token` left while the server may still hold state for it; its
        clean-up is on its way. That clean-up may overtake a call that grants or queues the
        token (on another connection: without auto-pipelining or on Cluster), so a grant
        read for `token` in the next `within` seconds calls `hand_on` (which releases it)
        instead of being ignored for a whole lease."""
        now = _clock.monotonic()
        departed = self._departed
        # Oldest first (near enough: a longer ttl just stays a little longer); no copy of
        # the whole map per departure, which made a cancellation storm quadratic.
        while departed and next(iter(departed.values()))[0] <= now:
            departed.popitem(last=False)
        departed[token] = (now + within, hand_on)

    def lot(self, channel: bytes) -> Lot | None:
        return self._lots.get(channel)

    def stale(self, token: str, fence: int) -> bool:
        """A grant to a waiter of ours that a later answer found not holding (it tells
        nothing of the lease in the way either)."""
        waiter = self._by_token.get(token)
        return waiter is not None and waiter.stale(fence)

    def recheck_first(self, channel: bytes) -> None:
        """The holder may be gone: the first local waiter re-runs acquire for everyone here."""
        lot = self._lots.get(channel)
        head = lot.head() if lot is not None else None
        if head is not None:
            head.recheck()

    def recheck_all(self, channel: bytes | None = None) -> None:
        """Messages may have been lost: every waiter (of `channel`, or of all) re-checks."""
        lots = [self._lots[channel]] if channel in self._lots else []
        if channel is None:
            lots = list(self._lots.values())
        for lot in lots:
            for waiter in lot:
                waiter.recheck()

    def __len__(self) -> int:
        return len(self._by_token)
