"""The per-client script runner: every script and command the engine sends goes through it.

One `ScriptRunner` per client and event loop (the `ClientContext` is one): it runs scripts
by EVALSHA (EVAL when the server does not know them), auto-pipelines the calls of one loop
iteration on one connection (not on Cluster), and keeps the commands it has in flight
within a bound the client's pool can serve. It knows nothing of locks, waiters or leases,
so everything above it can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._base import _adapter
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import (
    CONNECTION_ERRORS,
    NOSCRIPT_ERRORS,
    TIMEOUT_ERRORS,
    pending_cancels,
    redeliver_cancel,
)
from .._scripts import Script
from ._autopipe import AutoPipeline, Staged, command

__all__ = ["AUTOPIPELINE_ENV", "ScriptRunner", "autopipelining"]

log = logging.getLogger("aiolocks")

# Commands the engine keeps in flight per client at most. redis-py's pool fails fast
# ("Too many connections") past its limit rather than waiting, so the engine must queue.
_MAX_IN_FLIGHT = 64

# "0" (or "off", "false", "no") turns auto-pipelining off (see `_autopipe.py`): every
# script call then goes on its own pooled connection, within the in-flight bound.
AUTOPIPELINE_ENV = "AIOLOCKS_AUTOPIPELINE"


def autopipelining() -> bool:
    """Whether new runners auto-pipeline (`AIOLOCKS_AUTOPIPELINE`, on unless "0"/"off")."""
    value = os.environ.get(AUTOPIPELINE_ENV, "1").strip().lower()
    return value not in ("0", "off", "false", "no")


class ScriptRunner:
    """Sends the engine's scripts and commands on one client, on one event loop."""

    def __init__(self, client: AnyRedis) -> None:
        self.client = client
        # The engine's own connections, made like the client's but in a pool of their own
        # (not on Cluster): never the user's budget (see `_adapter.engine_client`).
        self.engine: AnyRedis = _adapter.engine_client(client)
        # redis-py leaves execute_command untyped; the engine only ever awaits its reply.
        self._execute: Callable[..., Awaitable[Any]] = self.engine.execute_command
        if is_cluster(client):
            self._execute = self._cluster_execute
        # Script calls made in one loop iteration go out as one pipeline, on one connection.
        # Not on Cluster: redis-py routes each command to its slot's node and follows
        # MOVED / ASK there, which a connection of our own would have to redo.
        self.autopipe: AutoPipeline | None = None
        if not is_cluster(client) and autopipelining():
            self.autopipe = AutoPipeline(self.engine.connection_pool, self._count_sent)
        # On Cluster each node has its own pool; the bound then applies per client. The
        # engine's pool serves the pub/sub connection and the auto-pipeline's one too.
        pool = getattr(self.engine, "connection_pool", None)
        pool_limit = int(getattr(pool, "max_connections", _MAX_IN_FLIGHT + 2))
        spare = pool_limit - 2 - (self.autopipe is not None)
        self._slots = asyncio.Semaphore(max(1, min(_MAX_IN_FLIGHT, spare)))
        # redis-py's RedisCluster initialises itself on first use, and concurrent first
        # uses race (a command then fails on a connection the initialisation replaced):
        # the engine initialises it once, alone, before its first command.
        self._initialised: asyncio.Future[None] | None = None
        if not is_cluster(client) or not _adapter.needs_initialise(client):
            self._initialised = asyncio.get_running_loop().create_future()
            self._initialised.set_result(None)
        self.commands_sent = 0  # engine commands sent through this client (for tests, bench)

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
        in the same loop iteration, in one pipeline on the runner's one connection.
        """
        await self._ready()
        before = pending_cancels()
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
        redeliver_cancel(before)
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
                pipe = self.engine.pipeline(transaction=False)
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
            pipe = self.engine.pipeline(transaction=False)
            for args in commands:
                pipe.execute_command(*args, **{_adapter.NEVER_DECODE: True})
            results: list[Any] = await pipe.execute()
        return results

    async def pipeline(self, calls: list[Staged]) -> list[Any]:
        """Run several scripts in one round trip; each result is a value or an exception.

        Calls the server answers NOSCRIPT are sent again, by EVAL, in a second round trip.
        """
        before = pending_cancels()
        results = await self._send(calls, by_source=False)
        missing = [
            index for index, result in enumerate(results) if isinstance(result, NOSCRIPT_ERRORS)
        ]
        if missing:
            retried = await self._send([calls[index] for index in missing], by_source=True)
            for index, result in zip(missing, retried, strict=True):
                results[index] = result
        redeliver_cancel(before)
        return results

    async def _send(self, calls: list[Staged], *, by_source: bool) -> list[Any]:
        await self._ready()
        async with self._slots:
            pipe = self.engine.pipeline(transaction=False)
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
            if not _adapter.closed_under_us(exc):
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

    async def _stop(self) -> None:
        """Close the auto-pipeline's connection and the engine's own (calls made later
        fail)."""
        if self.autopipe is not None:
            await self.autopipe.aclose()
        await _adapter.close_engine_client(self.engine, self.client)
