"""Auto-pipelining: the script calls a client's tasks make in one loop iteration go out as
one pipeline, on one connection, in the order they were made.

redis-py spends 85-120 µs of CPU on a command sent alone and 17-25 µs on one sent in a
pipeline of 16 or more; on a small machine that CPU bounds the throughput. One
connection also keeps a burst (10,000 tasks trying 1,000 names at once) off the pool,
which would otherwise open a connection per command in flight. A call made while the
client is quiet still goes out at once, alone.

All calls share one connection (a "link", `_pipelink`, taken from the client's pool):
batches are written at once when the socket takes them, and their replies are read in
order, so the next batch is written while the previous one's replies are still on their
way. One connection also keeps the order: a release a cancelled acquirer sends to clean up
can never reach the server before the acquire it follows, as it could over two connections.
This module queues, packs and writes the batches; the link answers them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from .._base import _adapter
from .._scripts import Script
from ._pipecall import Call, Staged, command
from ._pipelink import Link

__all__ = ["AutoPipeline", "Staged", "command"]

# Batches written on the link whose replies are not all read yet, and calls per batch.
MAX_BATCHES = 2
MAX_BATCH = 512
# How long `aclose()` waits for the replies of batches on their way before it closes the link.
CLOSE_BOUND = 1.0
# Replies parsed in the transport's callback (see `_direct_reads`); off: the link's task
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
        self._link: Link | None = None
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
        now = time.monotonic()
        for call in batch:
            if call.sent is not None:
                call.sent(now)
            script, keys, args = call.staged
            parts += connection.pack_command(*command(script, keys, args, by_source=call.by_source))
        return parts

    async def _drain(self, link: Link, writer: asyncio.StreamWriter) -> None:
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

    async def _send(self, link: Link, batch: list[Call]) -> None:
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

    async def _open(self) -> Link:
        if self._closed:
            # A call made after its engine was stopped (a clean-up run while the event loop
            # shuts down): a new link would outlive the loop, its socket left to the GC.
            raise redis.exceptions.ConnectionError("the aiolocks engine of this client was closed")
        connection = await _adapter.pooled_connection(self._pool)
        link = self._link = Link(self, self._pool, connection)
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
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _open_writer(connection: AbstractConnection) -> asyncio.StreamWriter | None:
    """The stream to write on, when `connection` is open and its socket takes data now (no
    backlog): a batch then goes out with one synchronous write. redis-py's own
    `send_packed_command` would wrap every write in a task and a timer (`wait_for`)."""
    # Not a socket's stream (fakeredis' connections): redis-py's own path, in the writer task.
    transport = _adapter.socket_transport(connection)  # asyncio's, or uvloop's
    if transport is None or transport.get_write_buffer_size():
        return None
    writer: asyncio.StreamWriter = _adapter.writer_of(connection)
    return writer
