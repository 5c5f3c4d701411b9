"""Per-client engine state: the script runner with the wait queue, notifier and lease keeper.

There is one `ClientContext` per (client, event loop). Every primitive built on the same
client shares it, so 10,000 waiting tasks share one pub/sub connection, one renewal task
and one auto-pipelined connection for their script calls (or, with auto-pipelining off
and on Cluster, a limited number of in-flight commands). The context is a `ScriptRunner`
(`_runner.py`) that also owns the rest of the bundle and ends it with the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from .._base import _adapter
from .._base._clients import AnyRedis
from .._base._errors import EngineClosed
from .._leases._keeper import LeaseKeeper
from .._transport._runner import ScriptRunner
from .._waiting._notifier import Notifier
from .._waiting._waitqueue import WaitQueue

__all__ = ["ClientContext", "Gate", "context_for", "open_context"]

T = TypeVar("T")

log = logging.getLogger("aiolocks")

# Releases one client has in flight at most: four times the calls the auto-pipeline's
# link carries at once, so it always has the next batches queued.
RELEASES_IN_FLIGHT = 4096

# When the event loop ends (`asyncio.run()` returning, a web server shutting down), what
# is still held is released, waited for this long at most; past it a lease ends by its ttl.
SHUTDOWN_BOUND = 1.0

# Contexts live on the client itself (client <-> context is an ordinary cycle the garbage
# collector frees with the client), one per event loop the client is used from.
_ATTRIBUTE = "_aiolocks_contexts"


def context_for(client: AnyRedis, loop: asyncio.AbstractEventLoop | None = None) -> ClientContext:
    """The engine state of `client` on the running event loop (`loop`, if the caller has
    it: on CPython 3.11 each `get_running_loop()` is a `getpid()`), created on first use."""
    if loop is None:
        loop = asyncio.get_running_loop()
    per_loop: dict[asyncio.AbstractEventLoop, ClientContext] | None = getattr(
        client, _ATTRIBUTE, None
    )
    if per_loop is None:
        per_loop = {}
        setattr(client, _ATTRIBUTE, per_loop)
    context = per_loop.get(loop)
    if context is None or context.closed:
        if context is not None and context.closed_by_user:
            # No fresh engine on a client its user closed (`refuse_calls`): it would open
            # connections the user has just closed, and arm timers past the loop's end.
            raise EngineClosed(_adapter.describe(client))
        _check_other_loops(client, per_loop, loop)
        context = per_loop[loop] = ClientContext(client)
        _adapter.on_aclose(client, _closed_by_user)
    return context


async def _closed_by_user(client: AnyRedis) -> None:
    """The user closes `client` (`aclose()`): the engine's state for it on this loop ends
    first (`ClientContext.client_closed`), and stays: a later call on this loop raises
    `ClientClosed` (`context_for`); a later loop may use the client again."""
    context = open_context(client)
    if context is not None:
        await context.client_closed()


def open_context(client: AnyRedis) -> ClientContext | None:
    """The engine state of `client` on the running event loop if it has one, never created
    (for a callback that may run after the client's engine was closed)."""
    per_loop: dict[asyncio.AbstractEventLoop, ClientContext] | None = getattr(
        client, _ATTRIBUTE, None
    )
    context = None if per_loop is None else per_loop.get(asyncio.get_running_loop())
    return None if context is None or context.closed else context


def _check_other_loops(
    client: AnyRedis,
    per_loop: dict[asyncio.AbstractEventLoop, ClientContext],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Refuse a client whose connections belong to another event loop (redis-py binds each
    connection to the loop that opened it; used from another, it fails at some later call,
    or at `aclose()`). Runs once per client and loop, off the hot path.

    Allowed: a client used again after its loop ended, once `await client.aclose()` has
    closed its connections on that loop (redis-py then opens new ones on the new loop)."""
    for other in list(per_loop):
        if other is loop:
            continue
        if not other.is_closed():
            raise RuntimeError(
                f"this Redis client is in use on another event loop ({_describe(other)}); "
                "redis-py binds a client's connections to one loop: make one client per "
                "event loop (per thread that runs one)"
            )
        if _adapter.holds_connections(client):
            raise RuntimeError(
                "this Redis client was used on an event loop that has ended, and still "
                "holds connections opened on it (redis-py binds them to that loop): "
                "`await client.aclose()` before the loop ends, or make one client per "
                "event loop (per asyncio.run())"
            )
        del per_loop[other]  # a client closed, then reused by a later asyncio.run()


def _describe(loop: asyncio.AbstractEventLoop) -> str:
    state = "running" if loop.is_running() else "not closed"
    return f"{type(loop).__name__} at {id(loop):#x}, {state}"


# The release gate. A burst of exits (100,000 `async with` bodies returning in one loop
# iteration) would otherwise start every release at once: each one's calls, timer and
# coroutines made in that one iteration, so many objects that the garbage collector's full
# collections stall the loop for longer than the leases' validity, and every lease is
# lost. Past the limit an exit waits here, holding only a future, its lease still renewed,
# and goes when a release ahead of it ends (more than the link carries at once are in
# flight meanwhile).
class Gate:
    """At most `limit` holders inside; the others wait in arrival order (a first-come,
    first-served limit on the releases one client has in flight)."""

    __slots__ = ("_empty", "inside", "limit", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inside = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._empty: asyncio.Future[None] | None = None  # (`emptied`)

    def emptied(self) -> asyncio.Future[None] | None:
        """A future done once no release is inside (None: none is now); the ones waiting
        for a place go in first."""
        if not self.inside:
            return None
        if self._empty is None:
            self._empty = asyncio.get_running_loop().create_future()
        return self._empty

    def enter(self) -> Awaitable[None] | None:
        """Take a place: None when one was free and nobody waits, else what to await for
        one. (Not a coroutine: every release asks, and nearly always finds one free.)"""
        if self.inside < self.limit and not self.waiting:
            self.inside += 1
            return None
        return self._wait_for_place()

    async def _wait_for_place(self) -> None:
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
        if not self.inside and self._empty is not None:
            if not self._empty.done():
                self._empty.set_result(None)
            self._empty = None


class ClientContext(ScriptRunner):
    """Everything the engine keeps for one client on one event loop: the script runner it
    is, with the wait queue, the notifier, the lease keeper and the loop's end."""

    def __init__(self, client: AnyRedis) -> None:
        super().__init__(client)
        self.waitqueue = WaitQueue()
        self.notifier = Notifier(self.engine, self.waitqueue, self.weak_run())
        self.keeper = LeaseKeeper(self)
        # Releases in flight at most (a burst of exits queues for a place: see `Gate`).
        self.releases = Gate(RELEASES_IN_FLIGHT)
        # The local hand-off cohorts (`_leasedlock.Cohort`, or a task alone in one's place) by
        # (channel, ttl_ms, local_handoff), idle ones removed: the engine's own, read at
        # every acquisition and release of a cohort's lock.
        self.cohorts: dict[Any, Any] = {}
        # What the layers above keep per client (`keep`), and what stops it with the engine.
        self._kept: dict[str, Any] = {}
        self._on_stop: list[Callable[[], None]] = []
        self.closed = False
        # Clean-ups left to finish in the background (see `_release.withdraw`): the end of
        # the loop waits for them.
        self.cleanups: set[asyncio.Future[Any]] = set()
        # Clean-ups cancelled by the loop's end before they finished (asyncio.run cancels
        # every task it finds, one created in main's last step before its first step):
        # the loop's end runs each again.
        self.interrupted: list[Callable[[], Awaitable[None]]] = []
        self._loop_end: AsyncGenerator[None, None] | None = _watch_loop_end(self)

    def keep(self, key: str, make: Callable[[], T], stop: Callable[[T], None] | None = None) -> T:
        """What a layer above keeps for this client under `key` (the local hand-off cohorts,
        the registries' coalescers, the election observers' hubs): made by `make` on first
        use, freed with the context, and given to `stop` when the engine stops on this
        client (closed, or its loop ending), so that layer ends its timers and tasks with it.
        The one mechanism for per-client state above the engine."""
        if key not in self._kept:
            kept = self._kept[key] = make()
            if stop is not None:
                self._on_stop.append(functools.partial(stop, kept))
        made: T = self._kept[key]
        return made

    async def aclose(self) -> None:
        """Stop the background tasks of this client (held leases are no longer renewed)."""
        await self._stop()
        watcher, self._loop_end = self._loop_end, None
        if watcher is not None:
            await watcher.aclose()

    async def client_closed(self) -> None:
        """Its user closes the client: what began before the close ends first (`_settle`:
        the releases under way and the clean-ups, `SHUTDOWN_BOUND` at most), then the
        engine stops using it. No call is made on it any more (each would open a connection
        the user has just closed); every holding is reported lost (it can be neither
        renewed nor released: its lease ends on the server by its ttl), and every wait
        ends with `ClientClosed`."""
        try:
            await self._settle()
        finally:
            self._refuse()
        await self.aclose()

    async def _settle(self) -> None:
        """Wait, `SHUTDOWN_BOUND` at most, for the releases under way (inside the release
        gate or waiting for a place) and the clean-ups left in the background: a task that
        awaited its holding's release before the close, or whose cancelled acquisition's
        clean-up went on past its grace, leaves no lease behind. Past the bound they are
        cut off, reported: a release by its error (`ClientClosed`), a clean-up here."""
        work: list[asyncio.Future[Any]] = [c for c in self.cleanups if not c.done()]
        gate = self.releases.emptied()
        if gate is not None:
            work.append(gate)
        if not work:
            return
        _, late = await asyncio.wait(work, timeout=SHUTDOWN_BOUND)
        unanswered = len(late - {gate}) + (self.releases.inside if gate in late else 0)
        if unanswered:
            log.warning(
                "aiolocks: the Redis client was closed (aclose()) with %d release(s) or "
                "clean-up(s) unanswered after %g s: their tokens end on the server by their ttl",
                unanswered,
                SHUTDOWN_BOUND,
            )

    def _refuse(self) -> None:
        """The engine stops using its client (`client_closed`)."""
        self.refuse_calls()
        self.closed = True  # (nothing is given back in the background either)
        self.keeper.lose_all(
            "the Redis client was closed (aclose()): the lease can be neither renewed nor "
            "released, and ends on the server by its ttl"
        )
        self.waitqueue.recheck_all()  # each wait's next call raises ClientClosed

    async def _stop(self) -> None:
        self.closed = True
        stopping, self._on_stop = self._on_stop, []
        for stop in stopping:
            stop()
        await self.keeper.aclose()
        await self.notifier.aclose()
        await super()._stop()

    async def _loop_ending(self) -> None:
        """The event loop is ending (its tasks were cancelled, see `_watch_loop_end`):
        release every lease still held and finish the clean-ups under way, within
        `SHUTDOWN_BOUND`, then stop every task and close every connection of the engine."""
        self._loop_end = None
        if self.closed:
            return
        work: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(release()) for release in self.keeper.releases()
        ]
        work += [cleanup for cleanup in self.cleanups if not cleanup.done()]
        interrupted, self.interrupted = self.interrupted, []
        work += [asyncio.ensure_future(again()) for again in interrupted]
        if work:
            _, late = await asyncio.wait(work, timeout=SHUTDOWN_BOUND)
            for future in late:
                future.cancel()
            for outcome in await asyncio.gather(*work, return_exceptions=True):
                if isinstance(outcome, Exception):
                    log.debug("aiolocks: a release at the loop's end failed: %r", outcome)
        await self._stop()
        # redis-py binds a connection to its loop: an idle one is of no use after it
        # (and a client so emptied may be used on another loop).
        await _adapter.close_idle_connections(self.client)


def _watch_loop_end(context: ClientContext) -> AsyncGenerator[None, None] | None:
    """An async generator, started now, whose `finally` runs `context._loop_ending()`.

    asyncio gives a library no callback when its loop ends, but `asyncio.run()` (and every
    runner that ends a loop properly: asyncio.Runner, uvloop, uvicorn, pytest-asyncio)
    first cancels the remaining tasks, then closes every async generator still suspended
    (`loop.shutdown_asyncgens()`), still on the loop: that is when this one's `finally`
    runs. The loop keeps only a weak reference to it, so the context keeps the generator.
    None where the loop registers no async generators (then nothing runs at its end, and
    leases still held end by their ttl)."""
    loop = asyncio.get_running_loop()
    if getattr(loop, "_asyncgens_shutdown_called", False):
        return None  # already past that point: it would only warn
    first_iteration, _ = sys.get_asyncgen_hooks()
    if first_iteration is None:
        return None
    watcher = _until_loop_end(context)
    with contextlib.suppress(StopIteration):
        watcher.asend(None).send(None)  # to its `yield`: the loop's hook registers it
    return watcher


async def _until_loop_end(context: ClientContext) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await context._loop_ending()
