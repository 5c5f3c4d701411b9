"""The auto-pipeline's link: one pooled connection, the batches written on it whose replies
are awaited, how those replies reach their callers, and when the link breaks or retires.

The pipeline (`_autopipe`) decides what is written and when; a link answers the calls
written on it, in order, and gives its connection back. On a socket its replies are parsed
where they arrive (`_direct_reads`), and its task only waits to retire it; elsewhere
(fakeredis) that task reads them through redis-py.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Protocol

import redis.exceptions
from redis.asyncio.connection import AbstractConnection, ConnectionPool

from .._base._errors import CONNECTION_ERRORS, RESPONSE_ERRORS
from . import _direct_reads
from ._pipecall import Call

__all__ = ["IDLE_S", "STALL_BOUND", "Link", "Pipeline"]

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

    _link: Link | None

    def _requeue(self, again: list[Call]) -> None: ...

    def _kick(self) -> None: ...


class Link:
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
        `_direct_reads.reader_for`); else the reader task reads them through redis-py."""
        found = _direct_reads.reader_for(self.connection)
        if found is None:
            return
        self.parser, self.transport = found
        timeout = getattr(self.connection, "socket_timeout", None)
        self.timeout = float(timeout) if timeout else STALL_BOUND
        _direct_reads.install(self.transport, self._received, self.mark_broken)

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
                if reply is _direct_reads.MORE:
                    break
                if isinstance(reply, _direct_reads.PUSH):
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
            _direct_reads.restore(self.transport)
            if self.parser.has_data() and self.broken is None:
                self.broken = redis.exceptions.InvalidResponse("unparsed bytes left")
        if self.broken is not None:
            await self.connection.disconnect(nowait=True)
        await self.pool.release(self.connection)
