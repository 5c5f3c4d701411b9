"""The local wait queue of one client: every lot, by channel, and every waiter, by token.

One queue serves every primitive of the client: `park` a waiter, deliver a grant to it by
token (`unpark`), tell a channel's waiters to re-check. It also remembers the tokens of
acquisitions that left while a grant may still come (`depart`).
"""

from __future__ import annotations

import collections
import secrets
import time
from collections.abc import Callable

from ._lot import Lot, Waiter

__all__ = ["WaitQueue"]


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
        self.tag = secrets.token_hex(4)

    def member(self, token: str, ttl_ms: int, kind: str) -> str:
        """The queue entry of an acquisition made through this client (see _prelude.lua)."""
        return f"{token}:{ttl_ms}:{self.tag}:{kind}"

    def park(
        self,
        channel: bytes,
        token: str,
        ttl_ms: int,
        kind: str,
        shared: bool = False,
        deadline: float | None = None,
    ) -> Waiter:
        """A waiter for `token`, last in its channel's lot; `deadline` (monotonic) is the
        caller's, for the whole acquisition."""
        lot = self._lots.get(channel)
        if lot is None:
            lot = self._lots[channel] = Lot(channel, shared)
        waiter = Waiter(lot, token, ttl_ms, self.member(token, ttl_ms, kind), deadline)
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
        now = time.monotonic()
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
