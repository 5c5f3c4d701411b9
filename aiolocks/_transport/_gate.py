"""A first-come, first-served bound on the releases one client has in flight.

A burst of exits (100,000 `async with` bodies returning in one loop iteration) would
otherwise start every release at once: each one's calls, timer and coroutines made in
that one iteration, so many objects that the garbage collector's full collections stall
the loop for longer than the leases' validity, and every lease is lost. Past the bound an
exit waits here, holding only a future, its lease still renewed, and goes when a release
ahead of it ends (more than the link carries at once are in flight meanwhile).
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["Gate"]


class Gate:
    """At most `limit` holders inside; the others wait in arrival order."""

    __slots__ = ("inside", "limit", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inside = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def enter(self) -> None:
        """Wait for a place (at once if one is free and nobody waits)."""
        if self.inside < self.limit and not self.waiting:
            self.inside += 1
            return
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        try:
            await place  # the place is handed over by `leave`, counted in `inside`
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():
                self.leave()  # handed over as the cancellation came: pass it on
            raise

    def leave(self) -> None:
        """Give a place back: to the first waiter still waiting, if any."""
        while self.waiting:
            place = self.waiting.popleft()
            if not place.done():
                place.set_result(None)
                return
        self.inside -= 1
