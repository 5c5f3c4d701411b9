"""Auto-pipelining: the script calls a client's tasks make in one loop iteration go out as
one pipeline, on one connection, in the order they were made.

redis-py spends 85-120 µs of CPU on a command sent alone and 17-25 µs on one sent in a
pipeline of 16 or more; on a small machine that CPU bounds the throughput. One
connection also keeps a burst (10,000 tasks trying 1,000 names at once) off the pool,
which would otherwise open a connection per command in flight. A call made while the
client is quiet still goes out at once, alone.

All calls share one connection (a "link", taken from the client's pool): batches are
written at once when the socket takes them, and their replies are read in order, so the
next batch is written while the previous one's replies are still on their way. One
connection also keeps the order: a release a cancelled acquirer sends to clean up can
never reach the server before the acquire it follows, as it could over two connections.

On a socket (RESP2, or RESP3 with hiredis 3.2+) the replies are parsed where the bytes
arrive, in the transport's own callback (`_Replies`), and each caller is answered from
there: no reader task, no timer per reply. Other connections (fakeredis) are read by a task
of the link's through redis-py, as before.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

try:
    import hiredis

    _HIREDIS = True
    # RESP3 pushes (hiredis 3.2+), told apart from replies; without it, RESP2 links only.
    _PUSH: tuple[type, ...] = tuple(
        kind for kind in (getattr(hiredis, "PushNotification", None),) if kind is not None
    )
except ImportError:  # pragma: no cover - a dependency of ours (redis[hiredis])
    _HIREDIS = False
    _PUSH = ()

from ._scripts import Script

__all__ = ["AutoPipeline", "Staged", "command"]

# Batches written on the link whose replies are not all read yet, and calls per batch.
MAX_BATCHES = 2
MAX_BATCH = 512
# A link with nothing to do gives its connection back to the pool after this long.
IDLE_S = 5.0
# How long `aclose()` waits for the replies of batches on their way before it closes the link.
CLOSE_BOUND = 1.0
# A link on a connection without a socket_timeout waits this long at most for a reply
# before it is broken (its calls then go once more on a new connection, as on a lost
# connection): a direct link since it last had a reply, a reader task per reply read. One
# blackholed connection (a peer gone without a reset) would otherwise hold every script
# call of the client for as long as TCP takes to give up (minutes). Longer than a server
# stalls in normal use (a failover's CLIENT PAUSE, a slow script).
STALL_BOUND = 10.0
# Replies parsed in the transport's callback (see `_Replies`); off: a reader task reads
# them through redis-py, as on connections that are not plain sockets (for tests).
DIRECT_READS = True

# What a lost connection looks like; every engine script is idempotent, so a call cut off
# by one may be sent again (once, if the caller allows).
_LINK_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

# A script call as the engine sends it: (script, keys, args).
Staged = tuple[Script, tuple[bytes, ...], tuple[Any, ...]]

# Packed heads (EVALSHA, the SHA, the keys) kept for reuse: a name's calls pack only their
# arguments. Cleared when full (a client working through more names than this).
MAX_HEADS = 4096


def command(
    script: Script, keys: tuple[bytes, ...], args: tuple[Any, ...], *, by_source: bool
) -> tuple[Any, ...]:
    """One script call as a command: by SHA, or by its text (EVAL) after a NOSCRIPT."""
    if by_source:
        return ("EVAL", script.source, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


class _Call:
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


class _Link:
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
        "reader",
        "sending",
        "stall_timer",
        "timeout",
        "transport",
        "waiting_since",
        "wake",
    )

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        self.pending: collections.deque[list[_Call]] = collections.deque()
        self.broken: BaseException | None = None  # why nothing more can be read from it
        self.wake: asyncio.Future[None] | None = None  # the idle reader sleeps on it
        self.reader: asyncio.Task[None] | None = None
        self.sending = False  # the writer is writing a batch on it
        self.active_at = 0.0  # loop time the reader last finished a batch
        self.idle_timer: asyncio.TimerHandle | None = None  # one at a time, not one per batch
        # Direct reads (`_Replies`): the hiredis reader the bytes are fed to, how many calls
        # of the first pending batch are answered, and the transport and its own protocol.
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


class AutoPipeline:
    """Sends `call()`s in batches on one connection of `pool`, at most `MAX_BATCHES`
    written ahead of their replies; calls made meanwhile form the next batch.

    Each caller gets its own result or error; NOSCRIPT is answered by sending that call
    again by EVAL. A caller cancelled before its batch is written is not sent; one
    cancelled later stops waiting, and the batch goes on for the others.
    """

    def __init__(self, pool: ConnectionPool, sent: Callable[[int], None]) -> None:
        self._pool = pool
        self._sent = sent
        self._queue: collections.deque[_Call] = collections.deque()
        self._writer: asyncio.Task[None] | None = None
        self._link: _Link | None = None
        self._flushing = False  # a `_flush` is scheduled
        self._closed = False  # `aclose()` was called: no new link is opened
        self._heads: dict[tuple[str, tuple[bytes, ...]], bytes] = {}
        self.batches_sent = 0  # round trips made (for tests and benchmarks)

    async def call(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        retry: bool,
        sent: Callable[[float], None] | None = None,
    ) -> Any:
        """Run `script` in the next batch; a connection error is retried once if `retry`.
        `sent` is told when the call is written (behind a burst, long after this call)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(_Call((script, keys, args), retry, future, sent))
        self._kick()
        return await future

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
            self._sent(len(batch))
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
                self._break(link, failure)
                self._settle_all(batch, failure)  # sent again where allowed, on a new link
                continue
            self._appended(link, batch)
            if writer.transport.get_write_buffer_size():
                # The socket did not take it all (a slow reader, a full buffer): the rest
                # is written by the writer task, which waits for it, within socket_timeout.
                link.sending = True
                self._writer = asyncio.get_running_loop().create_task(self._drain(link, writer))
                return

    def _pack(self, connection: AbstractConnection, batch: list[_Call]) -> list[bytes]:
        """`batch` as RESP, the bytes redis-py's `pack_command` would make (its encoder,
        the connection's), with each script's and name's head packed once. It is written
        next: each call's `sent` is told now."""
        encode = connection.encoder.encode
        parts: list[bytes] = []
        now = time.monotonic()
        for call in batch:
            if call.sent is not None:
                call.sent(now)
            script, keys, args = call.staged
            if call.by_source:
                parts += connection.pack_command(*command(script, keys, args, by_source=True))
                continue
            head = self._heads.get((script.sha, keys))
            if head is None:
                if len(self._heads) >= MAX_HEADS:
                    self._heads.clear()
                words = [b"EVALSHA", script.sha.encode(), b"%d" % len(keys), *map(encode, keys)]
                head = self._heads[script.sha, keys] = b"".join(map(_bulk, words))
            parts += (b"*%d\r\n" % (3 + len(keys) + len(args)), head)
            parts += map(_bulk, map(encode, args))
        return parts

    async def _drain(self, link: _Link, writer: asyncio.StreamWriter) -> None:
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
            self._break(link, exc)
            await connection.disconnect(nowait=True)  # its reader stops reading too
            if not isinstance(exc, Exception):
                raise
        finally:
            link.sending = False
            self._writer = None
        if link.broken is not None and (link.reader is None or link.reader.done()):
            await self._give_back(link)  # its reader left the connection to us
        self._kick()

    def _full(self) -> bool:
        return self._link is not None and len(self._link.pending) >= MAX_BATCHES

    def _take(self) -> list[_Call]:
        batch: list[_Call] = []
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
                    self._break(link, redis.exceptions.ConnectionError("connection closed"))
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

    async def _send(self, link: _Link, batch: list[_Call]) -> None:
        """Write `batch` on `link`; its reader takes it from there (only once it is all
        written: a reply read before would come from a connection still being opened)."""
        self.batches_sent += 1
        self._sent(len(batch))
        connection = link.connection
        packed = self._pack(connection, batch)
        failure: BaseException | None = None
        link.sending = True
        try:
            await connection.send_packed_command(packed, check_health=False)
        except BaseException as exc:  # redis-py closed the connection
            failure = exc
            if isinstance(exc, AttributeError):
                # redis-py 8.1 writes on a connection closed under it (a reader saw it
                # drop) as `None.writelines`: that is a lost connection, not a bug here.
                failure = redis.exceptions.ConnectionError(f"connection closed: {exc}")
            self._break(link, failure)
        finally:
            link.sending = False
        if link.broken is None:
            self._appended(link, batch)
            if link.parser is not None:
                self._parse(link)  # replies that came while it was being written
            return
        # Broken meanwhile: whatever this batch did, its replies are lost with the link.
        self._settle_all(batch, failure or link.broken)
        if link.reader is None or link.reader.done():
            await self._give_back(link)  # its reader left the connection to us
        if failure is not None and not isinstance(failure, Exception):
            raise failure

    async def _open(self) -> _Link:
        if self._closed:
            # A call made after its engine was stopped (a clean-up run while the event loop
            # shuts down): a new link would outlive the loop, its socket left to the GC.
            raise redis.exceptions.ConnectionError("the aiolocks engine of this client was closed")
        connection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        link = self._link = _Link(connection)
        if DIRECT_READS:
            _read_directly(link, self)
        link.reader = asyncio.get_running_loop().create_task(self._read(link))
        return link

    def _appended(self, link: _Link, batch: list[_Call]) -> None:
        """`batch` was written on `link`: its replies are awaited."""
        if link.parser is None:
            link.pending.append(batch)
            link.poke()  # the reader task reads it
            return
        if not link.pending:
            link.waiting_since = asyncio.get_running_loop().time()
        link.pending.append(batch)
        if link.timeout is not None and link.stall_timer is None:
            self._stalled(link)

    def _parse(self, link: _Link) -> None:
        """Answer the callers whose replies have arrived on a direct link (in order), from
        the bytes its transport fed to `link.parser`; a protocol error, a connection error
        reply or a reply no call waits for breaks the link, as a read through redis-py
        would. Bytes that may answer a batch still being written wait for it."""
        parser = link.parser
        again: list[_Call] = []
        finished = False
        try:
            while link.broken is None and (link.pending or not link.sending):
                reply = parser.gets()
                if reply is _MORE:
                    break
                if isinstance(reply, _PUSH):
                    continue  # RESP3 out-of-band news (tracking, maintenance): no call's
                if isinstance(reply, redis.exceptions.ConnectionError):
                    raise reply  # e.g. LOADING: a server not ready
                if not link.pending:
                    raise redis.exceptions.InvalidResponse("a reply no call was waiting for")
                batch = link.pending[0]
                call = batch[link.answered]
                link.answered += 1
                self._settle(call, reply, again)
                if link.answered == len(batch):
                    link.pending.popleft()
                    link.answered = 0
                    finished = True
        except Exception as exc:
            self._break(link, exc)
        finally:
            self._requeue(again)
        if finished:
            link.active_at = link.waiting_since = asyncio.get_running_loop().time()
            if not link.pending and self._link is not link:
                link.poke()  # retired meanwhile: its task gives the connection back now
            self._kick()

    def _stalled(self, link: _Link) -> None:
        """The stall timer of a direct link: break it if a reply has been awaited for the
        connection's socket_timeout, else re-arm for when that would be."""
        link.stall_timer = None
        if link.broken is not None or not link.pending or link.timeout is None:
            return
        loop = asyncio.get_running_loop()
        due = link.waiting_since + link.timeout
        if loop.time() >= due:
            self._break(link, redis.exceptions.TimeoutError("Timeout reading from socket"))
            return
        link.stall_timer = loop.call_at(due, self._stalled, link)

    def _break(self, link: _Link, error: BaseException) -> None:
        """Nothing more can be read from `link`: new batches go to a new connection."""
        if link.broken is None:
            link.broken = error
        if self._link is link:
            self._link = None
        link.poke()

    async def _read(self, link: _Link) -> None:
        """Read the replies of `link`'s batches in order and hand each to its caller (a
        direct link's are parsed as they arrive: there it only waits), then retire it."""
        # redis-py bounds a read by the connection's socket_timeout; STALL_BOUND without.
        bound = None if getattr(link.connection, "socket_timeout", None) else STALL_BOUND
        try:
            while await self._next(link):
                batch = link.pending[0]
                again: list[_Call] = []
                answered = 0
                try:
                    for call in batch:
                        if link.broken is not None:
                            raise link.broken
                        try:
                            async with asyncio.timeout(bound):
                                result = await link.connection.read_response()
                        except redis.exceptions.ResponseError as exc:
                            result = exc
                        except TimeoutError:  # STALL_BOUND (redis-py closed the connection)
                            stalled = redis.exceptions.TimeoutError("Timeout reading from socket")
                            raise stalled from None
                        answered += 1
                        self._settle(call, result, again)
                finally:
                    del batch[:answered]  # the rest fail with the link, when it retires
                    self._requeue(again)
                link.pending.popleft()
                self._kick()
        except BaseException as exc:
            self._break(link, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            await self._retire(link)
            self._kick()

    async def _next(self, link: _Link) -> bool:
        """Wait until `link` has a batch for its reader task to read (True; never on a
        direct link, whose replies are parsed as they arrive), or is to retire (False):
        broken, closed, or idle for `IDLE_S`. A link being written to, or awaiting replies,
        is never idle. Batches do not wake a direct link's task: its idle timer does, once
        per IDLE_S, and so do a break, a close, and the last reply of a closed link."""
        loop = asyncio.get_running_loop()
        link.active_at = loop.time()
        while link.parser is not None or not link.pending:
            if link.broken is not None:
                return False
            idle_until = link.active_at + IDLE_S
            if not link.sending and not link.pending:
                if self._link is link and loop.time() >= idle_until:
                    self._link = None  # retired now: no writer can pick it up any more
                if self._link is not link:
                    return False
            if loop.time() >= idle_until:  # busy: idle from now at the earliest
                link.active_at = loop.time()
                idle_until = link.active_at + IDLE_S
            if link.idle_timer is None:
                # One timer, kept across batches (a busy link re-arms it once per IDLE_S).
                link.idle_timer = loop.call_at(idle_until, _idle, link)
            link.wake = loop.create_future()
            try:
                await link.wake
            finally:
                link.wake = None
        return True

    async def _retire(self, link: _Link) -> None:
        """Fail what is still pending on `link` (sent again if allowed), and give its
        connection back to the pool, closed if broken, unless a batch is being written on
        it: the writer gives it back then."""
        if self._link is link:
            self._link = None
        if link.idle_timer is not None:
            link.idle_timer.cancel()
            link.idle_timer = None
        error = link.broken or redis.exceptions.ConnectionError("the link was closed")
        again: list[_Call] = []
        while link.pending:
            for call in link.pending.popleft():
                self._settle(call, error, again)
        self._requeue(again)
        if not link.sending:
            await self._give_back(link)

    async def _give_back(self, link: _Link) -> None:
        if link.stall_timer is not None:
            link.stall_timer.cancel()
            link.stall_timer = None
        if link.parser is not None:
            # redis-py reads the connection again; bytes left unparsed would be misread.
            _restore(link)
            if link.parser.has_data() and link.broken is None:
                link.broken = redis.exceptions.InvalidResponse("unparsed bytes left")
        if link.broken is not None:
            await link.connection.disconnect(nowait=True)
        await self._pool.release(link.connection)

    def _settle(self, call: _Call, result: Any, again: list[_Call]) -> None:
        """Hand `result` to the caller, or keep the call for another try."""
        if call.future.done():
            return  # the caller left (cancelled)
        if isinstance(result, asyncio.CancelledError):
            call.future.cancel()
        elif isinstance(result, redis.exceptions.NoScriptError) and not call.by_source:
            call.by_source = True
            again.append(call)
        elif isinstance(result, _LINK_ERRORS) and call.retry:
            call.retry = False
            again.append(call)
        elif isinstance(result, BaseException):
            call.future.set_exception(result)
            call.future.exception()  # retrieved: a caller that left must not have it logged
        else:
            call.future.set_result(result)

    def _settle_all(self, batch: list[_Call], error: BaseException) -> None:
        again: list[_Call] = []
        for call in batch:
            self._settle(call, error, again)
        self._requeue(again)

    def _requeue(self, again: list[_Call]) -> None:
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
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _bulk(value: bytes | memoryview) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), bytes(value))


def _idle(link: _Link) -> None:
    """The idle timer of `link` fired: its reader looks whether it has been idle long enough."""
    link.idle_timer = None
    link.poke()


# What a hiredis reader returns while a reply is incomplete.
_MORE = object()
# The connection protocols whose replies `_Replies` parses: RESP2, and RESP3 when hiredis
# marks its pushes (redis-py 8 connects with RESP3 by default).
_PROTOCOLS = ("2", "None", "3") if _PUSH else ("2", "None")


class _Replies(asyncio.Protocol):
    """The protocol a direct link's transport calls: bytes go to the link's parser and
    answer their callers there and then; connection events break the link. Everything is
    passed on to the connection's own protocol too (its stream sees the close, and
    `drain()` keeps its flow control)."""

    def __init__(self, pipeline: AutoPipeline, link: _Link, inner: asyncio.BaseProtocol) -> None:
        self._pipeline = pipeline
        self._link = link
        self.inner = inner

    def data_received(self, data: bytes) -> None:
        link = self._link
        if link.broken is None:
            link.parser.feed(data)
            self._pipeline._parse(link)

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
        self._pipeline._break(self._link, redis.exceptions.ConnectionError(reason))


def _read_directly(link: _Link, pipeline: AutoPipeline) -> None:
    """Have `link`'s replies parsed where they arrive (`_Replies`), if its connection is a
    socket with nothing buffered, and hiredis can parse its protocol (RESP2, or RESP3 with
    pushes marked); else leave it to redis-py."""
    connection = link.connection
    writer = connection._writer if connection.is_connected else None
    transport = getattr(writer, "transport", None)
    stream = connection._reader
    if (
        not _HIREDIS
        or str(getattr(connection, "protocol", 2)) not in _PROTOCOLS
        or not isinstance(transport, asyncio.Transport)
        or transport.is_closing()
        or not isinstance(stream, asyncio.StreamReader)
        or stream._buffer  # type: ignore[attr-defined]
        or stream.at_eof()
    ):
        return
    parse_error = getattr(connection._parser, "parse_error", None)
    if parse_error is None:
        return
    options: dict[str, Any] = {
        "protocolError": redis.exceptions.InvalidResponse,
        "replyError": parse_error,
        "notEnoughData": _MORE,
    }
    encoder = connection.encoder
    if encoder.decode_responses:
        options["encoding"] = encoder.encoding
        options["errors"] = encoder.encoding_errors
    link.parser = hiredis.Reader(**options)
    link.transport = transport
    timeout = getattr(connection, "socket_timeout", None)
    link.timeout = float(timeout) if timeout else STALL_BOUND
    transport.set_protocol(_Replies(pipeline, link, transport.get_protocol()))


def _restore(link: _Link) -> None:
    """Give a direct link's transport its connection's own protocol back."""
    transport = link.transport
    protocol = None if transport is None else transport.get_protocol()
    if isinstance(protocol, _Replies):
        assert transport is not None
        transport.set_protocol(protocol.inner)


def _open_writer(connection: AbstractConnection) -> asyncio.StreamWriter | None:
    """The stream to write on, when `connection` is open and its socket takes data now (no
    backlog): a batch then goes out with one synchronous write. redis-py's own
    `send_packed_command` would wrap every write in a task and a timer (`wait_for`)."""
    writer = connection._writer if connection.is_connected else None
    # Not a socket's stream (fakeredis' connections): redis-py's own path, in the writer task.
    transport = getattr(writer, "transport", None)
    if not isinstance(transport, asyncio.WriteTransport) or transport.is_closing():
        return None
    if transport.get_write_buffer_size():
        return None
    return writer
