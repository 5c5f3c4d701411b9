"""Per-client engine state: the script runner, the wait queue, the notifier, the lease keeper.

There is one `ClientContext` per (client, event loop). Every primitive built on the same
client shares it, so 10,000 waiting tasks share one pub/sub connection, one renewal task
and one auto-pipelined connection for their script calls (or, with auto-pipelining off
and on Cluster, a bounded number of in-flight commands).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import _adapter, _cancel
from ._autopipe import AutoPipeline, Staged, command
from ._clients import AnyRedis, is_cluster
from ._coalesce import Coalescer
from ._errors import CONNECTION_ERRORS, NOSCRIPT_ERRORS, TIMEOUT_ERRORS
from ._gate import Gate
from ._keeper import LeaseKeeper
from ._notifier import Notifier
from ._scripts import Script
from ._waitqueue import WaitQueue

if TYPE_CHECKING:
    from ._cohort import Cohort

__all__ = ["ClientContext", "context_for", "open_context"]

log = logging.getLogger("aiolocks")

# Commands the engine keeps in flight per client at most. redis-py's pool fails fast
# ("Too many connections") past its limit rather than waiting, so the engine must queue.
_MAX_IN_FLIGHT = 64
# Releases one client has in flight at most: four times the calls the auto-pipeline's
# link carries at once, so it always has the next batches queued.
RELEASES_IN_FLIGHT = 4096

# "0" (or "off", "false", "no") turns auto-pipelining off (see `_autopipe.py`): every
# script call then goes on its own pooled connection, within the in-flight bound.
AUTOPIPELINE_ENV = "AIOLOCKS_AUTOPIPELINE"

# When the event loop ends (`asyncio.run()` returning, a web server shutting down), what
# is still held is released, waited for this long at most; past it a lease ends by its ttl.
SHUTDOWN_BOUND = 1.0

# Contexts live on the client itself (client <-> context is an ordinary cycle the garbage
# collector frees with the client), one per event loop the client is used from.
_ATTRIBUTE = "_aiolocks_contexts"


def context_for(client: AnyRedis) -> ClientContext:
    """The engine state of `client` on the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    per_loop: dict[asyncio.AbstractEventLoop, ClientContext] | None = getattr(
        client, _ATTRIBUTE, None
    )
    if per_loop is None:
        per_loop = {}
        setattr(client, _ATTRIBUTE, per_loop)
    context = per_loop.get(loop)
    if context is None or context.closed:
        _check_other_loops(client, per_loop, loop)
        context = per_loop[loop] = ClientContext(client)
    return context


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


class ClientContext:
    """Everything the engine keeps for one client on one event loop."""

    def __init__(self, client: AnyRedis) -> None:
        self.client = client
        # redis-py leaves execute_command untyped; the engine only ever awaits its reply.
        self._execute: Callable[..., Awaitable[Any]] = client.execute_command
        if is_cluster(client):
            self._execute = self._cluster_execute
        self.waitqueue = WaitQueue()
        self.notifier = Notifier(client, self.waitqueue, self.run)
        self.keeper = LeaseKeeper(self)
        # Releases in flight at most (a burst of exits queues for a place: see _gate.py).
        self.releases = Gate(RELEASES_IN_FLIGHT)
        # Script calls made in one loop iteration go out as one pipeline, on one connection.
        # Not on Cluster: redis-py routes each command to its slot's node and follows
        # MOVED / ASK there, which a connection of our own would have to redo.
        self.autopipe: AutoPipeline | None = None
        if not is_cluster(client) and autopipelining():
            self.autopipe = AutoPipeline(client.connection_pool, self._count_sent)  # type: ignore[union-attr,arg-type]
        # On Cluster each node has its own pool; the bound then applies per client. The
        # pool also serves the pub/sub connection and the auto-pipeline's one.
        pool = getattr(client, "connection_pool", None)
        pool_limit = int(getattr(pool, "max_connections", _MAX_IN_FLIGHT + 2))
        spare = pool_limit - 2 - (self.autopipe is not None)
        self._slots = asyncio.Semaphore(max(1, min(_MAX_IN_FLIGHT, spare)))
        # Local hand-off cohorts (_cohort.py), by (channel, ttl_ms, bound); idle ones leave.
        self.cohorts: dict[tuple[bytes, int, int], Cohort] = {}
        # Registries' coalesced register() calls, by the registry's ids key.
        self.coalescers: dict[bytes, Coalescer[bytes, int]] = {}
        # redis-py's RedisCluster initialises itself on first use, and concurrent first
        # uses race (a command then fails on a connection the initialisation replaced):
        # the engine initialises it once, alone, before its first command.
        self._initialised: asyncio.Future[None] | None = None
        if not is_cluster(client) or not _adapter.needs_initialise(client):
            self._initialised = asyncio.get_running_loop().create_future()
            self._initialised.set_result(None)
        self.closed = False
        self.commands_sent = 0  # engine commands sent through this client (for tests, bench)
        # Clean-ups left to finish in the background (see `_withdraw.withdraw`): the end of
        # the loop waits for them.
        self.cleanups: set[asyncio.Future[Any]] = set()
        self._loop_end: AsyncGenerator[None, None] | None = _watch_loop_end(self)

    async def run(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        retry: bool = True,
        sent: Callable[[float], None] | None = None,
    ) -> Any:
        """EVALSHA `script`; EVAL it (which also caches it) if the server does not know it.
        `sent` is told the monotonic time whenever the call is written (a call queued
        behind a burst goes out later than it is made).

        EVAL rather than SCRIPT LOAD: it goes where the keys are (on Cluster, the node
        owning their slot; SCRIPT LOAD has no key to route by), in one round trip.

        A connection error is retried once (unless `retry` is false), on a fresh
        connection: a connection dropped by the server or the network fails the command
        in flight (and a client made by `from_url` retries nothing by itself), and every
        engine script is idempotent, so running one again after a lost reply is safe.

        With auto-pipelining (the default, not on Cluster), the call joins the others made
        in the same loop iteration, in one pipeline on the context's one connection.
        """
        await self._ready()
        before = _cancel.pending()
        if self.autopipe is not None:
            reply = await self.autopipe.call(script, keys, args, retry, sent)
        else:
            async with self._slots:
                try:
                    reply = await self._evalsha(script, keys, args, sent)
                except (*CONNECTION_ERRORS, *TIMEOUT_ERRORS):
                    if not retry:
                        raise
                    reply = await self._evalsha(script, keys, args, sent)
        _cancel.redeliver(before)
        return reply

    def _count_sent(self, commands: int) -> None:
        self.commands_sent += commands

    async def _evalsha(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        sent: Callable[[float], None] | None = None,
    ) -> Any:
        if sent is not None:
            sent(time.monotonic())
        self.commands_sent += 1
        try:
            return await self._execute(*command(script, keys, args, by_source=False))
        except NOSCRIPT_ERRORS:
            self.commands_sent += 1
            return await self._execute(*command(script, keys, args, by_source=True))

    async def run_then_wait(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        replicas: int,
        timeout_ms: int,
    ) -> tuple[Any, int]:
        """Run `script`, then `WAIT replicas timeout_ms`, on one connection (WAIT covers the
        writes of its own connection only): (the script's reply, replicas that acked)."""
        await self._ready()
        for by_source in (False, True):
            async with self._slots:
                pipe = self.client.pipeline(transaction=False)
                pipe.execute_command(*command(script, keys, args, by_source=by_source))
                pipe.execute_command("WAIT", replicas, timeout_ms)
                self.commands_sent += 2
                reply, acked = await pipe.execute(raise_on_error=False)
            if not isinstance(reply, NOSCRIPT_ERRORS):
                break
        for result in (reply, acked):
            if isinstance(result, Exception):
                raise result
        return reply, int(acked)

    async def call(self, *args: Any) -> Any:
        """Send one plain command within the in-flight bound; bulk replies stay bytes."""
        await self._ready()
        async with self._slots:
            return await self._execute(*args, **{_adapter.NEVER_DECODE: True})

    async def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send plain commands in one round trip within the in-flight bound (bytes replies)."""
        await self._ready()
        async with self._slots:
            pipe = self.client.pipeline(transaction=False)
            for args in commands:
                pipe.execute_command(*args, **{_adapter.NEVER_DECODE: True})
            results: list[Any] = await pipe.execute()
        return results

    async def pipeline(self, calls: list[Staged]) -> list[Any]:
        """Run several scripts in one round trip; each result is a value or an exception.

        Calls the server answers NOSCRIPT are sent again, by EVAL, in a second round trip.
        """
        before = _cancel.pending()
        results = await self._send(calls, by_source=False)
        missing = [
            index for index, result in enumerate(results) if isinstance(result, NOSCRIPT_ERRORS)
        ]
        if missing:
            retried = await self._send([calls[index] for index in missing], by_source=True)
            for index, result in zip(missing, retried, strict=True):
                results[index] = result
        _cancel.redeliver(before)
        return results

    async def _send(self, calls: list[Staged], *, by_source: bool) -> list[Any]:
        await self._ready()
        async with self._slots:
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command(*command(*call, by_source=by_source))
            self.commands_sent += len(calls)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    async def _cluster_execute(self, *args: Any, **options: Any) -> Any:
        """`RedisCluster.execute_command`, sent again when redis-py 8.1 fails it with
        AttributeError ('NoneType' has no 'writelines'): a topology refresh closed the
        connection from a background task while it was connecting. Nothing was written
        then, so sending again is safe whatever the command."""
        execute: Callable[..., Awaitable[Any]] = self.client.execute_command
        try:
            return await execute(*args, **options)
        except AttributeError as exc:
            if "writelines" not in str(exc):
                raise
            log.debug("aiolocks: redis-py closed a connection under a command; sending again")
            return await execute(*args, **options)

    async def _ready(self) -> None:
        initialised = self._initialised
        if (
            initialised is not None
            and initialised.done()
            and not initialised.cancelled()
            and initialised.exception() is None
        ):
            return
        if initialised is None or initialised.done():  # first use, or the last try failed
            initialised = self._initialised = asyncio.ensure_future(self._initialise())
        await asyncio.shield(initialised)

    async def _initialise(self) -> None:
        assert is_cluster(self.client)
        with contextlib.suppress(AttributeError):  # no such step in this redis-py
            await self.client.initialize()

    async def aclose(self) -> None:
        """Stop the background tasks of this client (held leases are no longer renewed)."""
        await self._stop()
        watcher, self._loop_end = self._loop_end, None
        if watcher is not None:
            await watcher.aclose()

    async def _stop(self) -> None:
        self.closed = True
        await self.keeper.aclose()
        await self.notifier.aclose()
        if self.autopipe is not None:
            await self.autopipe.aclose()

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


def autopipelining() -> bool:
    """Whether new contexts auto-pipeline (`AIOLOCKS_AUTOPIPELINE`, on unless "0"/"off")."""
    value = os.environ.get(AUTOPIPELINE_ENV, "1").strip().lower()
    return value not in ("0", "off", "false", "no")
