"""The pub/sub subscriptions of one client: which channel is subscribed on which link,
kept through reconnects and Cluster slot moves, and what is read on them.

Channels are reference-counted by the waiters that need them and kept for a while after
the last one leaves, so a busy name is subscribed once, not once per wait. After a link
re-connects (and re-subscribes), messages sent in the gap are gone: every channel on it
is reported out of sync. What is read goes to `Events` (the notifier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import redis.exceptions

from .._base import _adapter
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import REDIS_ERRORS, cancelling, pending_cancels, redeliver_cancel
from . import _serverfacts
from ._pubsub import Link
from ._serverfacts import RunScript, ServerFacts

__all__ = ["Events", "Subscriptions"]

log = logging.getLogger("aiolocks")

# Keyspace events on an owner key that mean "the holder is gone".
_GONE = frozenset({b"del", b"expired", b"evicted"})
# How long an unused channel stays subscribed, in case it is needed again soon.
_LINGER = 30.0
# Longest wait for a subscription to be confirmed before a waiter proceeds on its timer.
_CONFIRM_BOUND = 1.0
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0

# A client call that failed: the library's errors, and the socket's.
_LINK_DOWN: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)


class Events(Protocol):
    """Who is told what the subscriptions read (`Notifier`)."""

    def message(self, wake: bytes, payload: bytes) -> None:
        """A message on the channel `wake`."""

    def gone(self, wake: bytes) -> None:
        """A keyspace del/expired/evicted event on the key `wake` watches."""

    def resync(self, wake: bytes) -> None:
        """Messages of `wake` may have been lost (a reconnect, a slot move)."""


class _Channel:
    """A wake channel wanted here, with the keyspace channel that goes with it, if any."""

    __slots__ = ("confirmed", "keyspace", "linger", "link", "refs", "wake")

    def __init__(self, wake: bytes, keyspace: bytes | None, link: Link) -> None:
        self.wake = wake
        self.keyspace = keyspace
        self.link = link  # the connection it is subscribed on
        self.refs = 0
        self.confirmed: asyncio.Future[None] | None = None
        self.linger: asyncio.TimerHandle | None = None


class Subscriptions:
    """The channels one client is subscribed to, on one link per server (on Cluster, per
    node that owns a channel's slot: sharded channels and keyspace events are node-local).
    """

    def __init__(self, client: AnyRedis, run: RunScript, events: Events) -> None:
        self._client = client
        self._run = run
        self._events = events
        self._cluster = is_cluster(client)
        self._links: dict[str, Link] = {}
        self._channels: dict[bytes, _Channel] = {}
        self._by_keyspace: dict[bytes, bytes] = {}  # keyspace channel -> wake channel
        self._db = 0 if self._cluster else _db_of(client)
        self._facts: asyncio.Future[ServerFacts] | None = None
        self._sharded = False  # set from the facts before the first subscription

    def watching(self, wake: bytes) -> bool:
        """True when grants on `wake` are known to reach this process."""
        channel = self._channels.get(wake)
        return (
            channel is not None
            and channel.confirmed is not None
            and channel.confirmed.done()
            and channel.link.reading
        )

    async def retain(self, wake: bytes, watch_key: bytes | None) -> None:
        """Hold a reference to `wake` (and the keyspace channel of `watch_key`); see
        `Notifier.retain`. Holds no reference if it raises."""
        channel = self._channels.get(wake)
        if channel is None:
            facts = await self._server_facts()
            keyspace = None
            if watch_key is not None and facts.keyspace:
                keyspace = b"__keyspace@%d__:%s" % (self._db, watch_key)
            channel = self._channels.get(wake)  # another task may have created it meanwhile
            if channel is None:
                try:
                    link = self._link_for(wake)
                except REDIS_ERRORS as exc:  # no node known for the slot
                    log.debug("aiolocks: no pub/sub link for %r: %r", wake, exc)
                    return  # the waiter still wakes on its timer
                channel = self._channels[wake] = _Channel(wake, keyspace, link)
                if keyspace is not None:
                    self._by_keyspace[keyspace] = wake
        channel.refs += 1
        if channel.linger is not None:
            channel.linger.cancel()
            channel.linger = None
        try:
            if channel.confirmed is None:
                channel.confirmed = asyncio.get_running_loop().create_future()
                try:
                    await self._subscribe(channel)
                except _LINK_DOWN as exc:
                    log.debug("aiolocks: subscribe to %r failed: %r", wake, exc)
                    channel.confirmed = None
                    return
                except BaseException:
                    channel.confirmed = None  # cancelled, maybe unsent: the next one retries
                    raise
            if not channel.confirmed.done():
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(channel.confirmed), _CONFIRM_BOUND)
        except BaseException:
            self.release(wake)  # cancelled: the caller never got the reference
            raise

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
        self._forget(channel)
        if channel.link.pubsub is not None and channel.confirmed is not None:
            task = asyncio.get_running_loop().create_task(self._unsubscribe(channel))
            task.add_done_callback(_ignore_result)

    def _forget(self, channel: _Channel) -> None:
        del self._channels[channel.wake]
        if channel.keyspace is not None:
            self._by_keyspace.pop(channel.keyspace, None)

    def _link_for(self, wake: bytes) -> Link:
        """The link a channel belongs on: the one server, or the node owning its slot."""
        if not self._cluster:
            name, client = "", self._client
        else:
            node: Any = self._client.get_node_from_key(wake)  # type: ignore[union-attr,arg-type]
            if node is None:
                raise redis.exceptions.ConnectionError(f"no Cluster node owns {wake!r}")
            name = node.name
            client = None
        link = self._links.get(name)
        if link is None:
            if client is None:
                client = _adapter.node_client(node)
            link = self._links[name] = Link(name, client)
            link.owns_client = self._cluster
        return link

    async def _server_facts(self) -> ServerFacts:
        """Asked once per client, however many waiters want to know at the same moment."""
        if self._facts is None:
            self._facts = asyncio.ensure_future(_serverfacts.ask(self._client, self._run))
        asked = self._facts
        try:
            facts = await asyncio.shield(asked)
        except _LINK_DOWN:
            if self._facts is asked:
                self._facts = None  # ask again next time
            raise
        self._sharded = facts.sharded
        return facts

    async def _subscribe(self, channel: _Channel) -> None:
        link = channel.link
        async with link.lock:
            await link.subscribe(channel.wake, channel.keyspace, self._sharded)
            if not link.reading:
                self._start_reader(link)

    def _start_reader(self, link: Link) -> None:
        link.reader = asyncio.get_running_loop().create_task(
            self._read(link), name=f"aiolocks-notifier {link.name}".rstrip()
        )

    async def _unsubscribe(self, channel: _Channel) -> None:
        link = channel.link
        async with link.lock:
            again = self._channels.get(channel.wake)
            if again is not None and again.link is link:
                return  # wanted again since it expired: keep the subscription
            if link.pubsub is not None:
                await link.unsubscribe(channel.wake, channel.keyspace, self._sharded)
                if link.unsubscribing and not link.reading:
                    self._start_reader(link)  # to read the confirmations

    def _routed(self, link: Link) -> list[_Channel]:
        return [channel for channel in self._channels.values() if channel.link is link]

    async def _read(self, link: Link) -> None:
        delay = _RETRY_MIN
        before = pending_cancels()
        while self._routed(link) or link.unsubscribing:
            try:
                if not link.connected:
                    await self._reconnect(link)
                message = await link.pubsub.get_message(timeout=None)
                # A read that re-connected re-subscribes, and redis-py's `wait_for` around
                # that write may swallow aclose's cancellation (Python 3.11): not ours.
                redeliver_cancel(before)
                delay = _RETRY_MIN
            except asyncio.CancelledError:
                # Shutdown (aclose, or the loop closing): close the connection too.
                if link.reader is asyncio.current_task():
                    link.reader = None
                await self._drop_idle(link)
                raise
            except Exception as exc:  # the link is down: everyone re-checks on their own
                if cancelling():
                    return  # shutting down: a dropped socket raced the cancellation
                if link.idle(exc):
                    continue  # `socket_timeout` passed with no message: read on
                log.debug("aiolocks: pub/sub read on %r failed: %r", link.name, exc)
                link.unsubscribing.clear()  # a new connection: nothing stale can come
                if not any(channel.refs > 0 for channel in self._routed(link)):
                    # Nobody waits (e.g. the client was closed): stop; the next waiter
                    # subscribes afresh and starts a new reader.
                    link.reader = None
                    await self._drop_idle(link)
                    return
                await link.disconnect()  # the next read re-connects and re-subscribes
                for channel in self._routed(link):
                    self._events.resync(channel.wake)
                if self._cluster:
                    self._reroute(link)  # the node may be gone, its slots moved
                await asyncio.sleep(delay)  # reconnect back-off, not a poll of a lock
                delay = min(delay * 2, _RETRY_MAX)
                continue
            if message is not None:
                self._dispatch(link, message)

    async def _reconnect(self, link: Link) -> None:
        """Re-make the link (under its lock, so no subscriber writes on it meanwhile), and
        subscribe on it the channels whose subscription found it down."""
        async with link.lock:
            await link.reconnect()
        for channel in self._routed(link):
            if channel.refs > 0:
                await self._resubscribe(channel)

    def _reroute(self, link: Link) -> None:
        """Move the channels of `link` whose slot another node owns now (per the client's
        slot map, which redis-py refreshes as commands meet MOVED or a dead node)."""
        for channel in self._routed(link):
            target = self._link_for(channel.wake)
            if target is not link:
                channel.link = target
                channel.confirmed = None
                if channel.refs > 0:
                    self._spawn(self._resubscribe(channel))

    async def _drop_idle(self, link: Link) -> None:
        """Forget every (idle) subscription of `link`; the next waiter subscribes afresh.
        Only called when no reader is reading the connection."""
        for channel in self._routed(link):
            if channel.linger is not None:
                channel.linger.cancel()
            self._forget(channel)
        await link.close()
        if link.owns_client and self._links.get(link.name) is link and not link.reading:
            del self._links[link.name]
            with contextlib.suppress(Exception):
                await link.client.aclose()

    def _dispatch(self, link: Link, message: dict[str, Any]) -> None:
        kind = _as_bytes(message.get("type"))
        name = _as_bytes(message.get("channel"))
        data = message.get("data")
        if kind in (b"message", b"smessage"):
            payload = _as_bytes(data)
            if name in self._channels:
                self._events.message(name, payload)
            elif name in self._by_keyspace and payload in _GONE:
                self._events.gone(self._by_keyspace[name])
        elif kind in (b"sunsubscribe", b"unsubscribe") and link.unsubscribed(name):
            return  # the confirmation of one of ours
        elif kind == b"sunsubscribe":
            channel = self._channels.get(name)
            if channel is not None and channel.link is link and channel.confirmed is not None:
                # Not asked for (ours come after the channel is forgotten): the server
                # dropped it because its slot moved to another node. Messages may be
                # lost: re-check, and subscribe again where the slot is now.
                self._events.resync(name)
                channel.confirmed = None
                if channel.refs > 0:
                    self._spawn(self._follow_slot(channel))
        elif kind in (b"subscribe", b"ssubscribe"):
            wake = self._by_keyspace.get(name, name)
            channel = self._channels.get(wake)
            if channel is None or wake != name or channel.confirmed is None:
                return
            if channel.confirmed.done():
                self._events.resync(wake)  # re-subscribed after a reconnect
            else:
                channel.confirmed.set_result(None)

    async def _follow_slot(self, channel: _Channel) -> None:
        if self._cluster:
            # A keyed command through the cluster client meets MOVED and so updates its
            # slot map; the channel name is in its primitive's slot.
            with contextlib.suppress(*REDIS_ERRORS, OSError):
                await self._client.exists(channel.wake)
            if channel.confirmed is None and self._channels.get(channel.wake) is channel:
                channel.link = self._link_for(channel.wake)
        await self._resubscribe(channel)

    async def _resubscribe(self, channel: _Channel) -> None:
        if channel.confirmed is None and self._channels.get(channel.wake) is channel:
            channel.confirmed = asyncio.get_running_loop().create_future()
            try:
                await self._subscribe(channel)
            except _LINK_DOWN as exc:
                log.debug("aiolocks: re-subscribe to %r failed: %r", channel.wake, exc)
                channel.confirmed = None
            else:
                self._events.resync(channel.wake)  # what was sent meanwhile is lost

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(_ignore_result)

    async def aclose(self) -> None:
        for link in list(self._links.values()):
            reader, link.reader = link.reader, None
            if reader is not None and reader is not asyncio.current_task():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
            await self._drop_idle(link)
        self._links.clear()


def _db_of(client: AnyRedis) -> int:
    kwargs = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    return int(kwargs.get("db", 0) or 0)


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return b""


def _ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
