"""One pub/sub connection per client: grant messages and keyspace events wake local waiters.

Channels are reference-counted by the waiters that need them and kept for a while after
the last one leaves, so a busy name is subscribed once, not once per wait. Messages are an
optimisation of latency only: every waiter also has a timer, and re-running acquire is
idempotent. After redis-py re-connects (and re-subscribes) by itself, messages sent in the
gap are gone, so every waiter of a re-confirmed channel is told to re-check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ._leases import cancelling
from ._scripts import Script, load
from ._waitqueue import WaitQueue

__all__ = ["Notifier"]

log = logging.getLogger("aiolocks")

# Keyspace events on an owner key that mean "the holder is gone".
_GONE = frozenset({b"del", b"expired", b"evicted"})
# How long an unused channel stays subscribed, in case it is needed again soon.
_LINGER = 30.0
# Longest wait for a subscription to be confirmed before a waiter proceeds on its timer.
_CONFIRM_BOUND = 1.0
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0
_PUBSUB_MODE = load("pubsub_mode")

RunScript = Callable[[Script, tuple[bytes, ...], tuple[Any, ...]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class _ServerFacts:
    """What the notifier must know of the server before its first subscription."""

    sharded: bool  # grants are SPUBLISHed: subscribe with SSUBSCRIBE
    keyspace: bool  # keyspace events for generic and expired keys are on


class _Channel:
    __slots__ = ("confirmed", "keyspace", "linger", "refs", "wake")

    def __init__(self, wake: bytes, keyspace: bytes | None) -> None:
        self.wake = wake
        self.keyspace = keyspace
        self.refs = 0
        self.confirmed: asyncio.Future[None] | None = None
        self.linger: asyncio.TimerHandle | None = None


class Notifier:
    """Routes pub/sub messages for one client into its `WaitQueue`."""

    def __init__(self, client: redis.asyncio.Redis, waitqueue: WaitQueue, run: RunScript) -> None:
        self._client = client
        self._waitqueue = waitqueue
        self._run = run
        self._pubsub: Any = None  # redis.asyncio.client.PubSub, created on first use
        self._channels: dict[bytes, _Channel] = {}
        self._by_keyspace: dict[bytes, bytes] = {}  # keyspace channel -> wake channel
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._db = int(client.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._facts: asyncio.Future[_ServerFacts] | None = None
        self._sharded = False  # set from the facts before the first subscription
        self._saved_retry: tuple[Any, Any] | None = None

    def watching(self, wake: bytes) -> bool:
        """True when grants on `wake` are known to reach this process."""
        channel = self._channels.get(wake)
        return (
            channel is not None
            and channel.confirmed is not None
            and channel.confirmed.done()
            and self._reader is not None
            and not self._reader.done()
        )

    async def retain(self, wake: bytes, watch_key: bytes | None) -> None:
        """Hold a reference to `wake` (and the keyspace channel of `watch_key`).

        Returns once the subscription is confirmed, or after a short bound: a waiter whose
        subscription is not confirmed yet still wakes on its timer.
        """
        channel = self._channels.get(wake)
        if channel is None:
            facts = await self._server_facts()
            keyspace = None
            if watch_key is not None and facts.keyspace:
                keyspace = b"__keyspace@%d__:%s" % (self._db, watch_key)
            channel = self._channels.get(wake)  # another task may have created it meanwhile
            if channel is None:
                channel = self._channels[wake] = _Channel(wake, keyspace)
                if keyspace is not None:
                    self._by_keyspace[keyspace] = wake
        channel.refs += 1
        if channel.linger is not None:
            channel.linger.cancel()
            channel.linger = None
        if channel.confirmed is None:
            channel.confirmed = asyncio.get_running_loop().create_future()
            try:
                await self._subscribe(channel)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.debug("aiolocks: subscribe to %r failed: %r", wake, exc)
                channel.confirmed = None
                return
        if not channel.confirmed.done():
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(channel.confirmed), _CONFIRM_BOUND)

    def release(self, wake: bytes) -> None:
        """Drop a reference taken by `retain`; the channel lingers before unsubscribing."""
        channel = self._channels.get(wake)
        if channel is None:
            return
        channel.refs -= 1
        if channel.refs <= 0 and channel.linger is None:
            loop = asyncio.get_running_loop()
            channel.linger = loop.call_later(_LINGER, self._expire, wake)

    def _expire(self, wake: bytes) -> None:
        channel = self._channels.get(wake)
        if channel is None or channel.refs > 0:
            return
        del self._channels[wake]
        names = [wake]
        if channel.keyspace is not None:
            self._by_keyspace.pop(channel.keyspace, None)
            names.append(channel.keyspace)
        if self._pubsub is not None and channel.confirmed is not None:
            task = asyncio.get_running_loop().create_task(self._unsubscribe(wake, channel.keyspace))
            task.add_done_callback(_ignore_result)

    async def _server_facts(self) -> _ServerFacts:
        """Asked once per client, however many waiters want to know at the same moment."""
        if self._facts is None:
            self._facts = asyncio.ensure_future(self._ask_facts())
        asked = self._facts
        try:
            facts = await asyncio.shield(asked)
        except (redis.exceptions.RedisError, OSError):
            if self._facts is asked:
                self._facts = None  # ask again next time
            raise
        self._sharded = facts.sharded
        return facts

    async def _ask_facts(self) -> _ServerFacts:
        # The scripts decide SPUBLISH or PUBLISH from the server's version: ask them.
        sharded = bool(await self._run(_PUBSUB_MODE, (), ()))
        try:
            reply = await self._client.config_get("notify-keyspace-events")
        except redis.exceptions.RedisError:
            # CONFIG may be disabled or denied: subscribe anyway, it costs little.
            return _ServerFacts(sharded, keyspace=True)
        flags = str(next(iter(reply.values()), "") if reply else "")
        keyspace = "K" in flags and ("A" in flags or ("g" in flags and "x" in flags))
        return _ServerFacts(sharded, keyspace)

    async def _subscribe(self, channel: _Channel) -> None:
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self._client.pubsub()
            if self._sharded:
                await self._pubsub.ssubscribe(channel.wake)
            else:
                await self._pubsub.subscribe(channel.wake)
            if channel.keyspace is not None:  # keyspace events are never sharded
                await self._pubsub.subscribe(channel.keyspace)
            self._own_reconnects()
            if self._reader is None or self._reader.done():
                self._reader = asyncio.get_running_loop().create_task(
                    self._read(), name="aiolocks-notifier"
                )

    async def _unsubscribe(self, wake: bytes, keyspace: bytes | None) -> None:
        async with self._lock:
            if wake in self._channels:
                return  # wanted again since it expired: keep the subscription
            if self._pubsub is not None:
                with contextlib.suppress(redis.exceptions.RedisError, OSError):
                    if self._sharded:
                        await self._pubsub.sunsubscribe(wake)
                    else:
                        await self._pubsub.unsubscribe(wake)
                    if keyspace is not None:
                        await self._pubsub.unsubscribe(keyspace)

    def _own_reconnects(self) -> None:
        connection = self._pubsub.connection
        if connection is None:
            return
        if self._saved_retry is None:
            # redis-py's retry re-connects inside a failed read (even after the client was
            # closed, and even while the loop shuts down, orphaning the new socket). The
            # reader re-connects by itself, with a bounded back-off, so errors must reach
            # it untouched. The client's policy is put back when the connection goes back.
            self._saved_retry = (connection, connection.retry)
            connection.retry = _Once()

    async def _read(self) -> None:
        delay = _RETRY_MIN
        while self._channels:
            try:
                message = await self._pubsub.get_message(timeout=None)
                delay = _RETRY_MIN
            except asyncio.CancelledError:
                # Shutdown (aclose, or the loop closing): close the connection too.
                if self._reader is asyncio.current_task():
                    self._reader = None
                await self._drop_idle()
                raise
            except Exception as exc:  # the link is down: everyone re-checks on their own
                if cancelling():
                    return  # shutting down: a dropped socket raced the cancellation
                log.debug("aiolocks: pub/sub read failed: %r", exc)
                if not any(channel.refs > 0 for channel in self._channels.values()):
                    # Nobody waits (e.g. the client was closed): stop; the next waiter
                    # subscribes afresh and starts a new reader.
                    self._reader = None
                    await self._drop_idle()
                    return
                connection = self._pubsub.connection
                if connection is not None:  # the next read re-connects and re-subscribes
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.disconnect(), 1.0)
                self._waitqueue.recheck_all()
                await asyncio.sleep(delay)  # reconnect back-off, not a poll of a lock
                delay = min(delay * 2, _RETRY_MAX)
                continue
            if message is not None:
                self._dispatch(message)

    async def _drop_idle(self) -> None:
        """Forget every (idle) subscription; the next waiter subscribes afresh. Only called
        when no reader is reading the connection."""
        for channel in self._channels.values():
            if channel.linger is not None:
                channel.linger.cancel()
        self._channels.clear()
        self._by_keyspace.clear()
        pubsub, self._pubsub = self._pubsub, None
        if self._saved_retry is not None:
            connection, retry = self._saved_retry
            connection.retry = retry
            self._saved_retry = None
        if pubsub is not None:
            connection = pubsub.connection
            with contextlib.suppress(Exception):
                if connection is not None:
                    # Nobody reads it now (callers see to that), so the close can be
                    # awaited: the socket is shut even if the loop is about to close.
                    await asyncio.wait_for(connection.disconnect(), 1.0)
                await pubsub.aclose()

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = _as_bytes(message.get("type"))
        name = _as_bytes(message.get("channel"))
        data = message.get("data")
        if kind in (b"message", b"smessage"):
            payload = _as_bytes(data)
            if name in self._channels:
                self._on_grant(name, payload)
            elif name in self._by_keyspace and payload in _GONE:
                self._waitqueue.recheck_first(self._by_keyspace[name])
        elif kind == b"sunsubscribe":
            channel = self._channels.get(name)
            if channel is not None and channel.confirmed is not None:
                # Not asked for (ours come after the channel is forgotten): the server
                # dropped it, e.g. its slot moved to another node. Messages may be lost:
                # re-check, and subscribe again.
                self._waitqueue.recheck_all(name)
                channel.confirmed = None
                if channel.refs > 0:
                    task = asyncio.get_running_loop().create_task(self._resubscribe(channel))
                    task.add_done_callback(_ignore_result)
        elif kind in (b"subscribe", b"ssubscribe"):
            wake = self._by_keyspace.get(name, name)
            channel = self._channels.get(wake)
            if channel is None or wake != name:
                return
            if channel.confirmed is None:
                return
            if channel.confirmed.done():
                self._waitqueue.recheck_all(wake)  # re-subscribed after a reconnect
            else:
                channel.confirmed.set_result(None)

    async def _resubscribe(self, channel: _Channel) -> None:
        if channel.confirmed is None and self._channels.get(channel.wake) is channel:
            channel.confirmed = asyncio.get_running_loop().create_future()
            try:
                await self._subscribe(channel)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.debug("aiolocks: re-subscribe to %r failed: %r", channel.wake, exc)
                channel.confirmed = None

    def _on_grant(self, wake: bytes, payload: bytes) -> None:
        parts = payload.split(b" ")
        if len(parts) != 3:
            return
        token, fence, ttl = parts[0].decode(), int(parts[1]), int(parts[2])
        lot = self._waitqueue.lot(wake)
        if lot is not None:
            lot.note_lease(ttl)
        self._waitqueue.unpark(token, fence)

    async def aclose(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        await self._drop_idle()


class _Once(Retry):
    """A retry policy that tries once and never re-connects on failure."""

    def __init__(self) -> None:
        super().__init__(NoBackoff(), 0)

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        return await do()


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return b""


def _ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
