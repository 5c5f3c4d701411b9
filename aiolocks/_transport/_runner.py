"""The per-client script runner: every script and command the engine sends goes through it.

One `ScriptRunner` per client and event loop (the `ClientContext` is one): it runs scripts
by EVALSHA (EVAL when the server does not know them), auto-pipelines the calls of one loop
iteration on one connection (not on Cluster), and keeps the commands it has in flight
within a limit the client's pool can serve. It knows nothing of locks, waiters or leases,
so everything above it can use it.

The auto-pipeline (the second half of this module): the script calls a client's tasks
make in one loop iteration go out as one pipeline, on one connection, in the order they
were made.

redis-py spends 85-120 µs of CPU on a command sent alone and 17-25 µs on one sent in a
pipeline of 16 or more; on a small machine that CPU bounds the throughput. One
connection also keeps a burst (10,000 tasks trying 1,000 names at once) off the pool,
which would otherwise open a connection per command in flight. A call made while the
client is quiet still goes out at once, alone.

All calls share one connection (a "link", `PipeLink` below, taken from the client's pool):
batches are written at once when the socket takes them, and their replies are read in
order, so the next batch is written while the previous one's replies are still on their
way. One connection also keeps the order: a release a cancelled acquirer sends to clean up
can never reach the server before the acquire it follows, as it could over two connections.
The second half, read top to bottom: one call on its way (`Call`: what to run, its caller's
future, how a reply or an error settles it); direct reads (a link's replies taken straight
off its socket's transport and parsed by a hiredis reader in the transport's own callback,
instead of by a task reading through redis-py: per reply, no task wake-up, two loop
iterations and a timer fewer); the link (one pooled connection, the batches written on it
whose replies are awaited, when it breaks or retires; elsewhere than on a socket, such as
fakeredis, its task reads the replies through redis-py); and the pipeline (`AutoPipeline`:
what is written and when).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import sys
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

try:
    import hiredis

    HIREDIS = True
    # RESP3 pushes (hiredis 3.2+), told apart from replies; without it, RESP2 links only.
    PUSH: tuple[type, ...] = tuple(
        push for push in (getattr(hiredis, "PushNotification", None),) if push is not None
    )
except ImportError:  # pragma: no cover - a dependency of ours (redis[hiredis])
    HIREDIS = False
    PUSH = ()

from .._base import _adapter, _clock
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import (
    CONNECTION_ERRORS,
    NOSCRIPT_ERRORS,
    RESPONSE_ERRORS,
    TIMEOUT_ERRORS,
    EngineClosed,
    pending_cancels,
    redeliver_cancel,
    retrieved,
    stop_tasks,
)
from .._scripts import Script

__all__ = [
    "AUTOPIPELINE_ENV",
    "HIREDIS",
    "IDLE_S",
    "STALL_BOUND",
    "AutoPipeline",
    "Call",
    "PipeLink",
    "Pipeline",
    "Replies",
    "ScriptRunner",
    "Staged",
    "autopipelining",
    "command",
]

log = logging.getLogger("aiolocks")

# Commands the engine keeps in flight per client at most. redis-py's pool fails fast
# ("Too many connections") past its limit rather than waiting, so the engine must queue.
_MAX_IN_FLIGHT = 64

# "0" (or "off", "false", "no") turns auto-pipelining off (see the auto-pipeline, below): every
# script call then goes on its own pooled connection, within the in-flight limit.
AUTOPIPELINE_ENV = "AIOLOCKS_AUTOPIPELINE"


def autopipelining() -> bool:
    """Whether new runners auto-pipeline (`AIOLOCKS_AUTOPIPELINE`, on unless "0"/"off")."""
    value = os.environ.get(AUTOPIPELINE_ENV, "1").strip().lower()
    return value not in ("0", "off", "false", "no")


async def _cancellable(execute: Callable[..., Awaitable[Any]], *args: Any, **options: Any) -> Any:
    """`execute(*args, **options)`, which a cancellation stops at once (Python 3.11).

    CPython 3.11's `asyncio.wait_for`, in which redis-py writes and reads when the client
    has a `socket_timeout`, returns its inner result instead of raising a cancellation
    that comes in the loop iteration that inner awaitable finished (bpo-42130, fixed in
    3.12): the cancellation is lost, and a caller cut off at a deadline (a release at its
    lease's validity end, an acquisition's timeout) waits for the reply instead, however
    late. So the call runs in a task of its own, awaited through a shield: the caller's
    cancellation ends its wait at once, and is passed on to the call."""
    call = asyncio.ensure_future(execute(*args, **options))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        call.cancel()
        call.add_done_callback(retrieved)  # the caller left: its outcome is nobody's
        raise


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
        if sys.version_info < (3, 12):
            self._execute = functools.partial(_cancellable, self._execute)
        # Script calls made in one loop iteration go out as one pipeline, on one connection.
        # Not on Cluster: redis-py routes each command to its slot's node and follows
        # MOVED / ASK there, which a connection of our own would have to redo.
        self.autopipe: AutoPipeline | None = None
        if not is_cluster(client) and autopipelining():
            self.autopipe = AutoPipeline(self.engine.connection_pool)
        # On Cluster each node has its own pool; the limit then applies per client. The
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
        self._initialised_ok = self._initialised is not None  # (it stays so once it is)
        self._sent = 0  # commands sent besides the auto-pipeline's
        # Its client was closed by its user (`refuse_calls`): no call is made any more.
        self.closed_by_user = False

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
        if (initialising := self._ready()) is not None:
            await initialising
        if self.autopipe is not None:
            # The reply's own future: a cancellation always reaches this await (nothing of
            # redis-py's, whose `wait_for` may swallow one, is awaited on the way).
            return await self.autopipe.call(script, keys, args, retry, sent)
        before = pending_cancels()
        async with self._slots:
            try:
                reply = await self._evalsha(script, keys, args, sent)
            except (*CONNECTION_ERRORS, *TIMEOUT_ERRORS):
                if not retry:
                    raise
                redeliver_cancel(before)  # a caller cancelled meanwhile: no second try
                reply = await self._evalsha(script, keys, args, sent)
        redeliver_cancel(before)
        return reply

    @property
    def commands_sent(self) -> int:
        """Engine commands sent through this client (for tests and benchmarks)."""
        return self._sent + (0 if self.autopipe is None else self.autopipe.commands_sent)

    def weak_run(self) -> Callable[[Script, tuple[bytes, ...], tuple[Any, ...]], Awaitable[Any]]:
        """`run`, for a task that lives as long as a connection: it holds no reference to
        this runner, so a client dropped without `aclose()` is collected with its engine
        (whose connections the loop's async-generator finalizer then closes, see
        `_context._watch_loop_end`)."""
        runner = weakref.ref(self)

        async def run(script: Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
            alive = runner()
            if alive is None:
                raise ConnectionError("the client was dropped")
            return await alive.run(script, keys, args)

        return run

    async def _evalsha(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        sent: Callable[[float], None] | None = None,
    ) -> Any:
        if sent is not None:
            sent(_clock.monotonic())
        self._sent += 1
        try:
            return await self._execute(*command(script, keys, args, by_source=False))
        except NOSCRIPT_ERRORS:
            self._sent += 1
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
        if (initialising := self._ready()) is not None:
            await initialising
        for by_source in (False, True):
            async with self._slots:
                pipe = self.engine.pipeline(transaction=False)
                pipe.execute_command(*command(script, keys, args, by_source=by_source))
                pipe.execute_command("WAIT", replicas, timeout_ms)
                self._sent += 2
                reply, acked = await pipe.execute(raise_on_error=False)
            if not isinstance(reply, NOSCRIPT_ERRORS):
                break
        for result in (reply, acked):
            if isinstance(result, Exception):
                raise result
        return reply, int(acked)

    async def call(self, *args: Any) -> Any:
        """Send one plain command within the in-flight limit; bulk replies stay bytes."""
        if (initialising := self._ready()) is not None:
            await initialising
        async with self._slots:
            return await self._execute(*args, **{_adapter.NEVER_DECODE: True})

    async def call_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send plain commands in one round trip within the in-flight limit (bytes replies)."""
        if (initialising := self._ready()) is not None:
            await initialising
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
        if (initialising := self._ready()) is not None:
            await initialising
        async with self._slots:
            pipe = self.engine.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command(*command(*call, by_source=by_source))
            self._sent += len(calls)
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

    def refuse_calls(self) -> None:
        """Its client was closed by its user: every call from now on raises EngineClosed
        (none opens a connection on the closed client)."""
        self.closed_by_user = True

    def _ready(self) -> Awaitable[None] | None:
        """None when calls can be made now; else what to await first (a Cluster client's
        initialisation), or `EngineClosed` raised. (Not a coroutine: every call asks.)"""
        if self.closed_by_user:
            raise EngineClosed(_adapter.describe(self.client))
        if self._initialised_ok:
            return None
        return self._initialising()

    async def _initialising(self) -> None:
        initialised = self._initialised
        if (
            initialised is not None
            and initialised.done()
            and not initialised.cancelled()
            and initialised.exception() is None
        ):
            self._initialised_ok = True
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


# -- the auto-pipeline: one script call on its way -----------------------------------------

# What a lost connection looks like; every engine script is idempotent, so a call cut off
# by one may be sent again (once, if the caller allows).
_LINK_ERRORS = (*CONNECTION_ERRORS, *TIMEOUT_ERRORS)

# A script call as the engine sends it: (script, keys, args).
Staged = tuple[Script, tuple[bytes, ...], tuple[Any, ...]]


def command(
    script: Script, keys: tuple[bytes, ...], args: tuple[Any, ...], *, by_source: bool
) -> tuple[Any, ...]:
    """One script call as a command: by SHA, or by its text (EVAL) after a NOSCRIPT."""
    if by_source:
        return ("EVAL", script.source, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


class Call:
    """One script call on its way: what to run, and the caller's future."""

    __slots__ = ("by_source", "future", "retry", "sent", "staged")

    def __init__(
        self,
        staged: Staged,
        retry: bool,
        future: asyncio.Future[Any],
        sent: Callable[[float], None] | None = None,
    ) -> None:
        self.staged = staged
        self.retry = retry  # a lost connection may still send it again
        self.by_source = False  # EVAL, after the server answered NOSCRIPT
        self.future = future
        self.sent = sent  # told the monotonic time each time it is written

    def settle(self, result: Any, again: list[Call]) -> None:
        """Hand `result` to the caller, or keep the call (in `again`) for another try."""
        if self.future.done():
            return  # the caller left (cancelled)
        if isinstance(result, asyncio.CancelledError):
            self.future.cancel()
        elif isinstance(result, NOSCRIPT_ERRORS) and not self.by_source:
            self.by_source = True
            again.append(self)
        elif isinstance(result, _LINK_ERRORS) and self.retry:
            self.retry = False
            again.append(self)
        elif isinstance(result, BaseException):
            self.future.set_exception(result)
            self.future.exception()  # retrieved: a caller that left must not have it logged
        else:
            self.future.set_result(result)


# -- direct reads: replies parsed where they arrive ----------------------------------------

# What a hiredis reader returns while a reply is incomplete.
MORE = object()
# The connection protocols whose replies `Replies` parses: RESP2, and RESP3 when hiredis
# marks its pushes (redis-py 8 connects with RESP3 by default).
_PROTOCOLS = ("2", "None", "3") if PUSH else ("2", "None")


class Replies(asyncio.Protocol):
    """The protocol a direct link's transport calls: bytes go to `received` (the link
    parses them and answers their callers there and then); connection events go to `lost`
    (the link breaks). Everything is passed on to the connection's own protocol too (its
    stream sees the close, and `drain()` keeps its flow control)."""

    def __init__(
        self,
        received: Callable[[bytes], None],
        lost: Callable[[BaseException], None],
        inner: asyncio.BaseProtocol,
    ) -> None:
        self._received = received
        self._lost_with = lost
        self.inner = inner

    def data_received(self, data: bytes) -> None:
        self._received(data)

    def eof_received(self) -> bool | None:
        self._lost(None)
        eof_received = getattr(self.inner, "eof_received", None)
        return None if eof_received is None else bool(eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _lost(self, exc: Exception | None) -> None:
        reason = "Connection closed by server." if exc is None else f"connection lost: {exc!r}"
        self._lost_with(redis.exceptions.ConnectionError(reason))


def direct_reader(
    connection: AbstractConnection, *, pubsub: bool = False
) -> tuple[Any, asyncio.BaseTransport] | None:
    """A hiredis reader for `connection`'s replies, and its transport, if the connection is
    a socket with nothing buffered and hiredis can parse its protocol (RESP2, or RESP3
    with pushes marked); else None: redis-py reads it.

    For a `pubsub` connection (whose messages come unasked, some maybe received already
    while it re-subscribed): bytes waiting in its stream are fed to the reader, and replies
    stay bytes whatever the client's `decode_responses` (the notifier reads them)."""
    transport = _adapter.socket_transport(connection)  # asyncio's, or uvloop's
    unread = _adapter.unread(connection)
    if (
        not HIREDIS
        or str(getattr(connection, "protocol", 2)) not in _PROTOCOLS
        or transport is None
        or unread is None
        or (unread and not pubsub)
    ):
        return None
    parse_error = _adapter.reply_error(connection)
    if parse_error is None:
        return None
    options: dict[str, Any] = {
        "protocolError": redis.exceptions.InvalidResponse,
        "replyError": parse_error,
        "notEnoughData": MORE,
    }
    encoder = connection.encoder
    if encoder.decode_responses and not pubsub:
        options["encoding"] = encoder.encoding
        options["errors"] = encoder.encoding_errors
    reader = hiredis.Reader(**options)
    if unread:
        received = _adapter.take_unread(connection)
        if received is None:
            return None  # the stream saw its end: redis-py's read reports it
        reader.feed(received)
    return reader, transport


def install_replies(
    transport: asyncio.BaseTransport,
    received: Callable[[bytes], None],
    lost: Callable[[BaseException], None],
) -> None:
    """Have `transport` call `Replies` (passing all on to its own protocol)."""
    transport.set_protocol(Replies(received, lost, transport.get_protocol()))


def restore_protocol(transport: asyncio.BaseTransport | None) -> None:
    """Give a direct link's transport its connection's own protocol back."""
    protocol = None if transport is None else transport.get_protocol()
    if isinstance(protocol, Replies):
        assert transport is not None
        transport.set_protocol(protocol.inner)


# -- the link: one connection, its batches, its replies ------------------------------------

# A link with nothing to do gives its connection back to the pool after this long.
IDLE_S = 5.0
# A link on a connection without a socket_timeout waits this long at most for a reply
# before it is broken (its calls then go once more on a new connection, as on a lost
# connection): a direct link since it last had a reply, a reader task per reply read. One
# blackholed connection (a peer gone without a reset) would otherwise hold every script
# call of the client for as long as TCP takes to give up (minutes). Longer than a server
# stalls in normal use (a failover's CLIENT PAUSE, a slow script).
STALL_BOUND = 10.0


class Pipeline(Protocol):
    """What a link needs of the pipeline whose batches it carries (`AutoPipeline`): the
    link its new batches go to (a link that breaks or retires stops being it), where calls
    to send once more go back, and a flush to schedule once the link can take more."""

    _link: PipeLink | None

    def _requeue(self, again: list[Call]) -> None: ...

    def _kick(self) -> None: ...


class PipeLink:
    """One pooled connection, the batches written on it and not yet read, and its reader
    (or, when its replies are parsed where they arrive, the task that retires it)."""

    __slots__ = (
        "active_at",
        "answered",
        "broken",
        "connection",
        "idle_timer",
        "parser",
        "pending",
        "pipeline",
        "pool",
        "reader",
        "sending",
        "stall_timer",
        "timeout",
        "transport",
        "waiting_since",
        "wake",
    )

    def __init__(
        self, pipeline: Pipeline, pool: ConnectionPool, connection: AbstractConnection
    ) -> None:
        self.pipeline = pipeline
        self.pool = pool  # the connection goes back to it
        self.connection = connection
        self.pending: collections.deque[list[Call]] = collections.deque()
        self.broken: BaseException | None = None  # why nothing more can be read from it
        self.wake: asyncio.Future[None] | None = None  # the idle reader sleeps on it
        self.reader: asyncio.Task[None] | None = None
        self.sending = False  # the writer is writing a batch on it
        self.active_at = 0.0  # loop time the reader last finished a batch
        self.idle_timer: asyncio.TimerHandle | None = None  # one at a time, not one per batch
        # Direct reads: the hiredis reader the bytes are fed to, how many calls of the
        # first pending batch are answered, and the transport.
        self.parser: Any = None
        self.answered = 0
        self.transport: asyncio.BaseTransport | None = None
        # A direct link waiting longer than the connection's socket_timeout for a reply is
        # broken, as redis-py's read would be: since when it waits, and the one timer.
        self.timeout: float | None = None
        self.waiting_since = 0.0
        self.stall_timer: asyncio.TimerHandle | None = None

    def poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def mark_broken(self, error: BaseException) -> None:
        """Nothing more can be read from this link: new batches go to a new connection."""
        if self.broken is None:
            self.broken = error
        if self.pipeline._link is self:
            self.pipeline._link = None
        self.poke()

    def appended(self, batch: list[Call]) -> None:
        """`batch` was written on this link: its replies are awaited."""
        if self.parser is None:
            self.pending.append(batch)
            self.poke()  # the reader task reads it
            return
        if not self.pending:
            self.waiting_since = asyncio.get_running_loop().time()
        self.pending.append(batch)
        if self.timeout is not None and self.stall_timer is None:
            self._stalled()

    # ------------------------------------------------------------------ direct reads

    def read_directly(self) -> None:
        """Have the replies parsed where they arrive, if the connection allows it (see
        `direct_reader`); else the reader task reads them through redis-py."""
        found = direct_reader(self.connection)
        if found is None:
            return
        self.parser, self.transport = found
        timeout = getattr(self.connection, "socket_timeout", None)
        self.timeout = float(timeout) if timeout else STALL_BOUND
        install_replies(self.transport, self._received, self.mark_broken)

    def _received(self, data: bytes) -> None:
        """Bytes off the transport, in its callback: parsed, their callers answered."""
        if self.broken is None:
            self.parser.feed(data)
            self.parse()

    def parse(self) -> None:
        """Answer the callers whose replies have arrived on a direct link (in order), from
        the bytes its transport fed to `parser`; a protocol error, a connection error reply
        or a reply no call waits for breaks the link, as a read through redis-py would.
        Bytes that may answer a batch still being written wait for it."""
        parser = self.parser
        again: list[Call] = []
        finished = False
        try:
            while self.broken is None and (self.pending or not self.sending):
                reply = parser.gets()
                if reply is MORE:
                    break
                if isinstance(reply, PUSH):
                    continue  # RESP3 out-of-band news (tracking, maintenance): no call's
                if isinstance(reply, CONNECTION_ERRORS):
                    raise reply  # e.g. LOADING: a server not ready
                if not self.pending:
                    raise redis.exceptions.InvalidResponse("a reply no call was waiting for")
                batch = self.pending[0]
                call = batch[self.answered]
                self.answered += 1
                call.settle(reply, again)
                if self.answered == len(batch):
                    self.pending.popleft()
                    self.answered = 0
                    finished = True
        except Exception as exc:
            self.mark_broken(exc)
        finally:
            self.pipeline._requeue(again)
        if finished:
            self.active_at = self.waiting_since = asyncio.get_running_loop().time()
            if not self.pending and self.pipeline._link is not self:
                self.poke()  # retired meanwhile: its task gives the connection back now
            self.pipeline._kick()

    def _stalled(self) -> None:
        """The stall timer of a direct link: break it if a reply has been awaited for the
        connection's socket_timeout, else re-arm for when that would be."""
        self.stall_timer = None
        if self.broken is not None or not self.pending or self.timeout is None:
            return
        loop = asyncio.get_running_loop()
        due = self.waiting_since + self.timeout
        if loop.time() >= due:
            self.mark_broken(redis.exceptions.TimeoutError("Timeout reading from socket"))
            return
        self.stall_timer = loop.call_at(due, self._stalled)

    # ------------------------------------------------------------------ the link's task

    async def read(self) -> None:
        """The link's task: read the replies of its batches in order and hand each to its
        caller (a direct link's are parsed as they arrive: there it only waits), then
        retire the link."""
        # redis-py bounds a read by the connection's socket_timeout; STALL_BOUND without.
        bound = None if getattr(self.connection, "socket_timeout", None) else STALL_BOUND
        try:
            while await self._next():
                batch = self.pending[0]
                again: list[Call] = []
                answered = 0
                try:
                    for call in batch:
                        if self.broken is not None:
                            raise self.broken
                        try:
                            async with asyncio.timeout(bound):
                                result = await self.connection.read_response()
                        except RESPONSE_ERRORS as exc:
                            result = exc
                        except TimeoutError:  # STALL_BOUND (redis-py closed the connection)
                            stalled = redis.exceptions.TimeoutError("Timeout reading from socket")
                            raise stalled from None
                        answered += 1
                        call.settle(result, again)
                finally:
                    del batch[:answered]  # the rest fail with the link, when it retires
                    self.pipeline._requeue(again)
                self.pending.popleft()
                self.pipeline._kick()
        except BaseException as exc:
            self.mark_broken(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            await self._retire()
            self.pipeline._kick()

    async def _next(self) -> bool:
        """Wait until the link has a batch for its task to read (True; never on a direct
        link, whose replies are parsed as they arrive), or is to retire (False): broken,
        closed, or idle for `IDLE_S`. A link being written to, or awaiting replies, is
        never idle. Batches do not wake a direct link's task: its idle timer does, once
        per IDLE_S, and so do a break, a close, and the last reply of a closed link."""
        loop = asyncio.get_running_loop()
        self.active_at = loop.time()
        while self.parser is not None or not self.pending:
            if self.broken is not None:
                return False
            idle_until = self.active_at + IDLE_S
            if not self.sending and not self.pending:
                if self.pipeline._link is self and loop.time() >= idle_until:
                    self.pipeline._link = None  # retired now: no writer can pick it up any more
                if self.pipeline._link is not self:
                    return False
            if loop.time() >= idle_until:  # busy: idle from now at the earliest
                self.active_at = loop.time()
                idle_until = self.active_at + IDLE_S
            if self.idle_timer is None:
                # One timer, kept across batches (a busy link re-arms it once per IDLE_S).
                self.idle_timer = loop.call_at(idle_until, self._idle)
            self.wake = loop.create_future()
            try:
                await self.wake
            finally:
                self.wake = None
        return True

    def _idle(self) -> None:
        """The idle timer fired: the link's task looks whether it has been idle long enough."""
        self.idle_timer = None
        self.poke()

    async def _retire(self) -> None:
        """Fail what is still pending (sent again if allowed), and give the connection back
        to the pool, closed if broken, unless a batch is being written on it: the writer
        gives it back then."""
        if self.pipeline._link is self:
            self.pipeline._link = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        error = self.broken or redis.exceptions.ConnectionError("the link was closed")
        again: list[Call] = []
        while self.pending:
            for call in self.pending.popleft():
                call.settle(error, again)
        self.pipeline._requeue(again)
        if not self.sending:
            await self.give_back()

    async def give_back(self) -> None:
        """Give the connection back to the pool (closed if the link broke), its transport's
        own protocol restored."""
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        if self.parser is not None:
            # redis-py reads the connection again; bytes left unparsed would be misread.
            restore_protocol(self.transport)
            if self.parser.has_data() and self.broken is None:
                self.broken = redis.exceptions.InvalidResponse("unparsed bytes left")
        if self.broken is not None:
            await self.connection.disconnect(nowait=True)
        await self.pool.release(self.connection)


# -- the pipeline: what is written, and when -----------------------------------------------

# Batches written on the link whose replies are not all read yet, and calls per batch.
MAX_BATCHES = 2
MAX_BATCH = 512
# How long `aclose()` waits for the replies of batches on their way before it closes the link.
CLOSE_BOUND = 1.0
# Replies parsed in the transport's callback (see `Replies` above); off: the link's task
# reads them through redis-py, as on connections that are not plain sockets (for tests).
DIRECT_READS = True


class AutoPipeline:
    """Sends `call()`s in batches on one connection of `pool`, at most `MAX_BATCHES`
    written ahead of their replies; calls made meanwhile form the next batch.

    Each caller gets its own result or error; NOSCRIPT is answered by sending that call
    again by EVAL. A caller cancelled before its batch is written is not sent; one
    cancelled later stops waiting, and the batch goes on for the others.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._queue: collections.deque[Call] = collections.deque()
        self._writer: asyncio.Task[None] | None = None
        self._link: PipeLink | None = None
        self._flushing = False  # a `_flush` is scheduled
        self._closed = False  # `aclose()` was called: no new link is opened
        self.batches_sent = 0  # round trips made (for tests and benchmarks)
        self.commands_sent = 0  # calls written

    def _count(self, commands: int) -> None:
        """Count `commands` as written (just before the batch is written)."""
        self.commands_sent += commands

    def call(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        retry: bool,
        sent: Callable[[float], None] | None = None,
    ) -> asyncio.Future[Any]:
        """Run `script` in the next batch: the future of its reply (a future, not a
        coroutine: one object less per call in flight). A connection error is retried
        once if `retry`; `sent` is told when the call is written (behind a burst, long
        after this call)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(Call((script, keys, args), retry, future, sent))
        self._kick()
        return future

    def _kick(self) -> None:
        """Schedule a flush if calls wait and the link can take another batch. It runs on
        the next loop iteration: every call made in this one joins its batch."""
        if not self._flushing and self._writer is None and self._queue and not self._full():
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Write the waiting calls on the open link, here and now: no task, no timer (the
        hot path). Opening a connection, and a socket that did not take a whole batch at
        once, are left to the writer task, which may wait (bounded by socket_timeout)."""
        self._flushing = False
        while self._writer is None and self._queue and not self._full():
            link = self._link
            writer = None if link is None else _open_writer(link.connection)
            if link is None or writer is None or link.sending:
                self._writer = asyncio.get_running_loop().create_task(self._write())
                return
            batch = self._take()
            if not batch:
                return
            self.batches_sent += 1
            self._count(len(batch))
            connection = link.connection
            try:
                packed = self._pack(connection, batch)
            except Exception as exc:  # an argument redis-py cannot encode: the callers'
                self._settle_all(batch, exc)
                continue
            try:
                writer.writelines(packed)
            except Exception as exc:  # the socket is gone: as a lost connection
                failure = redis.exceptions.ConnectionError(f"connection closed: {exc!r}")
                link.mark_broken(failure)
                self._settle_all(batch, failure)  # sent again where allowed, on a new link
                continue
            link.appended(batch)
            if writer.transport.get_write_buffer_size():
                # The socket did not take it all (a slow reader, a full buffer): the rest
                # is written by the writer task, which waits for it, within socket_timeout.
                link.sending = True
                self._writer = asyncio.get_running_loop().create_task(self._drain(link, writer))
                return

    def _pack(self, connection: AbstractConnection, batch: list[Call]) -> list[bytes]:
        """`batch` as RESP, packed by the connection (as redis-py would send each call).
        It is written next: each call's `sent` is told now."""
        parts: list[bytes] = []
        now = _clock.monotonic()
        for call in batch:
            if call.sent is not None:
                call.sent(now)
            script, keys, args = call.staged
            parts += connection.pack_command(*command(script, keys, args, by_source=call.by_source))
        return parts

    async def _drain(self, link: PipeLink, writer: asyncio.StreamWriter) -> None:
        """Wait until `link`'s socket has taken what `_flush` wrote (redis-py's own bound:
        the connection's socket_timeout); a failure breaks the link, and its reader fails
        (or sends again) the batches on it. Then go on writing."""
        connection = link.connection
        timeout = getattr(connection, "socket_timeout", None)
        try:
            try:
                async with asyncio.timeout(timeout or None):
                    await writer.drain()
            except TimeoutError:
                raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
            except OSError as exc:
                raise redis.exceptions.ConnectionError(f"Error while writing: {exc}") from exc
        except BaseException as exc:
            link.mark_broken(exc)
            await connection.disconnect(nowait=True)  # its reader stops reading too
            if not isinstance(exc, Exception):
                raise
        finally:
            link.sending = False
            self._writer = None
        if link.broken is not None and (link.reader is None or link.reader.done()):
            await link.give_back()  # its reader left the connection to us
        self._kick()

    def _full(self) -> bool:
        return self._link is not None and len(self._link.pending) >= MAX_BATCHES

    def _take(self) -> list[Call]:
        batch: list[Call] = []
        while self._queue and len(batch) < MAX_BATCH:
            call = self._queue.popleft()
            if not call.future.done():  # a caller cancelled meanwhile is not sent
                batch.append(call)
        return batch

    async def _write(self) -> None:
        try:
            while not self._full():
                batch = self._take()
                if not batch:
                    return
                link = self._link
                if link is not None and not link.connection.is_connected:
                    # Closed under us (`client.aclose()` closes every connection of its
                    # pool): never reconnected in place, where its reader may be reading.
                    link.mark_broken(redis.exceptions.ConnectionError("connection closed"))
                    link = None
                if link is None:
                    try:
                        link = await self._open()
                    except BaseException as exc:
                        self._settle_all(batch, exc)
                        if not isinstance(exc, Exception):
                            raise
                        continue
                await self._send(link, batch)
        finally:
            self._writer = None

    async def _send(self, link: PipeLink, batch: list[Call]) -> None:
        """Write `batch` on `link`; its reader takes it from there (only once it is all
        written: a reply read before would come from a connection still being opened)."""
        self.batches_sent += 1
        self._count(len(batch))
        connection = link.connection
        packed = self._pack(connection, batch)
        failure: BaseException | None = None
        link.sending = True
        try:
            await connection.send_packed_command(packed, check_health=False)
        except BaseException as exc:  # redis-py closed the connection
            failure = exc
            if _adapter.closed_under_us(exc):  # a lost connection, not a bug here
                failure = redis.exceptions.ConnectionError(f"connection closed: {exc}")
            link.mark_broken(failure)
        finally:
            link.sending = False
        if link.broken is None:
            link.appended(batch)
            if link.parser is not None:
                link.parse()  # replies that came while it was being written
            return
        # Broken meanwhile: whatever this batch did, its replies are lost with the link.
        self._settle_all(batch, failure or link.broken)
        if link.reader is None or link.reader.done():
            await link.give_back()  # its reader left the connection to us
        if failure is not None and not isinstance(failure, Exception):
            raise failure

    async def _open(self) -> PipeLink:
        if self._closed:
            # A call made after its engine was stopped (a clean-up run while the event loop
            # shuts down): a new link would outlive the loop, its socket left to the GC.
            raise redis.exceptions.ConnectionError("the aiolocks engine of this client was closed")
        connection = await _adapter.pooled_connection(self._pool)
        link = self._link = PipeLink(self, self._pool, connection)
        if DIRECT_READS:
            link.read_directly()
        link.reader = asyncio.get_running_loop().create_task(link.read())
        return link

    def _settle_all(self, batch: list[Call], error: BaseException) -> None:
        again: list[Call] = []
        for call in batch:
            call.settle(error, again)
        self._requeue(again)

    def _requeue(self, again: list[Call]) -> None:
        """Calls to send once more go first: they were made before anything queued."""
        self._queue.extendleft(reversed(again))

    async def aclose(self) -> None:
        """Retire the link: at once if idle, else once the batches on their way are read,
        for `CLOSE_BOUND` at most, past which it is closed under them (their callers get
        the error of a lost connection). No new link is opened afterwards (calls fail as on
        a lost connection). The pipeline's tasks have ended when this returns: it may be
        the last thing to run before the event loop closes."""
        self._closed = True
        link, self._link = self._link, None
        if link is not None:
            link.poke()
        tasks = [
            task
            for task in (self._writer, None if link is None else link.reader)
            if task is not None and not task.done()
        ]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=CLOSE_BOUND)
            await stop_tasks(late)
            await asyncio.gather(*tasks, return_exceptions=True)  # (ended: outcomes read)


def _open_writer(connection: AbstractConnection) -> asyncio.StreamWriter | None:
    """The stream to write on, when `connection` is open and its socket takes data now (no
    backlog): a batch then goes out with one synchronous write. redis-py's own
    `send_packed_command` would wrap every write in a task and a timer (`wait_for`)."""
    # Not a socket's stream (fakeredis' connections): redis-py's own path, in the writer task.
    writer: asyncio.StreamWriter | None = _adapter.socket_writer(connection)  # asyncio, uvloop
    if writer is None or writer.transport.get_write_buffer_size():
        return None
    return writer
