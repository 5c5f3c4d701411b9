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
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from . import _adapter, _cancel
from ._cancel import cancelling
from ._clients import AnyRedis, is_cluster
from ._errors import REDIS_ERRORS, RESPONSE_ERRORS
from ._scripts import Script, load
from ._waitqueue import WaitQueue

__all__ = ["Hint", "Listener", "Notifier"]

log = logging.getLogger("aiolocks")

# Keyspace events on an owner key that mean "the holder is gone".
_GONE = frozenset({b"del", b"expired", b"evicted"})
# How long an unused channel stays subscribed, in case it is needed again soon.
_LINGER = 30.0
# Longest wait for a subscription to be confirmed before a waiter proceeds on its timer.
_CONFIRM_BOUND = 1.0
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0
_PUBSUB_MODE = load("pubsub_mode")

# A client call that failed: the library's errors, and the socket's.
_LINK_DOWN: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)

RunScript = Callable[[Script, tuple[bytes, ...], tuple[Any, ...]], Awaitable[Any]]


class Hint(enum.Enum):
    """What a listener of a channel is told (see `Notifier.listen`)."""

    MESSAGE = "message"  # a message on the channel (its payload is given)
    GONE = "gone"  # a keyspace del/expired/evicted event on the channel's watched key
    RESYNC = "resync"  # messages may have been lost (a reconnect, a slot move): re-read


Listener = Callable[[Hint, bytes], None]


@dataclass(frozen=True, slots=True)
class _ServerFacts:
    """What the notifier must know of the server before its first subscription."""

    sharded: bool  # grants are SPUBLISHed: subscribe with SSUBSCRIBE
    keyspace: bool  # keyspace events for generic and expired keys are on


class _Channel:
    __slots__ = ("confirmed", "keyspace", "linger", "link", "refs", "wake")

    def __init__(self, wake: bytes, keyspace: bytes | None, link: _Link) -> None:
        self.wake = wake
        self.keyspace = keyspace
        self.link = link  # the connection it is subscribed on
        self.refs = 0
        self.confirmed: asyncio.Future[None] | None = None
        self.linger: asyncio.TimerHandle | None = None


class _Link:
    """One pub/sub connection (to the server, or to one Cluster node) and its reader task."""

    def __init__(self, name: str, client: Any) -> None:
        self.name = name
        self.client = client  # a redis.asyncio.Redis whose pubsub() this link uses
        self.pubsub: Any = None  # redis.asyncio.client.PubSub, created on first use
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.saved_retry: tuple[Any, Any] | None = None
        self.owns_client = False  # a per-node client made by the notifier, closed with it
        # Unsubscriptions sent and not yet confirmed, by channel: the reader reads on until
        # they are, so no stale confirmation is left in the socket for a later subscriber
        # of the same name to take for an unsolicited one.
        self.unsubscribing: dict[bytes, int] = {}

    def expect_unsubscribed(self, name: bytes) -> None:
        self.unsubscribing[name] = self.unsubscribing.get(name, 0) + 1

    def unsubscribed(self, name: bytes) -> bool:
        """True when a confirmation for `name` answers an unsubscription of ours."""
        count = self.unsubscribing.get(name, 0)
        if count <= 0:
            return False
        if count == 1:
            del self.unsubscribing[name]
        else:
            self.unsubscribing[name] = count - 1
        return True

    @property
    def reading(self) -> bool:
        return self.reader is not None and not self.reader.done()


class Notifier:
    """Routes pub/sub messages for one client into its `WaitQueue`.

    On one server there is one link (pub/sub connection); on Cluster one per node that
    owns a channel's slot, as sharded channels and keyspace events are node-local.
    """

    def __init__(self, client: AnyRedis, waitqueue: WaitQueue, run: RunScript) -> None:
        self._client = client
        self._waitqueue = waitqueue
        self._run = run
        self._cluster = is_cluster(client)
        self._links: dict[str, _Link] = {}
        self._channels: dict[bytes, _Channel] = {}
        self._by_keyspace: dict[bytes, bytes] = {}  # keyspace channel -> wake channel
        self._db = 0 if self._cluster else _db_of(client)
        self._facts: asyncio.Future[_ServerFacts] | None = None
        self._sharded = False  # set from the facts before the first subscription
        # Besides waiters, whoever must see every event of a channel (election observers).
        self._listeners: dict[bytes, list[Listener]] = {}

    def listen(self, wake: bytes, listener: Listener) -> None:
        """Call `listener` on every event of `wake` (it must also `retain` the channel)."""
        self._listeners.setdefault(wake, []).append(listener)

    def unlisten(self, wake: bytes, listener: Listener) -> None:
        listeners = self._listeners.get(wake, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            self._listeners.pop(wake, None)

    def _tell(self, wake: bytes, hint: Hint, payload: bytes = b"") -> None:
        for listener in list(self._listeners.get(wake, ())):
            try:
                listener(hint, payload)
            except Exception:  # a listener must never stop the reader
                log.exception("aiolocks: a listener of %r failed", wake)

    def _recheck(self, wake: bytes) -> None:
        """Messages of `wake` may have been lost: waiters re-check, listeners re-read."""
        self._waitqueue.recheck_all(wake)
        self._tell(wake, Hint.RESYNC)

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
        """Hold a reference to `wake` (and the keyspace channel of `watch_key`).

        Returns once the subscription is confirmed, or after a short bound: a waiter whose
        subscription is not confirmed yet still wakes on its timer. A cancellation that
        redis-py or `wait_for` swallowed meanwhile is raised (see `_cancel`).
        """
        before = _cancel.pending()
        await self._retain(wake, watch_key)  # holds no reference if it raises
        try:
            _cancel.redeliver(before)
        except asyncio.CancelledError:
            self.release(wake)
            raise

    async def _retain(self, wake: bytes, watch_key: bytes | None) -> None:
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

    def _link_for(self, wake: bytes) -> _Link:
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
            link = self._links[name] = _Link(name, client)
            link.owns_client = self._cluster
        return link

    async def _server_facts(self) -> _ServerFacts:
        """Asked once per client, however many waiters want to know at the same moment."""
        if self._facts is None:
            self._facts = asyncio.ensure_future(self._ask_facts())
        asked = self._facts
        try:
            facts = await asyncio.shield(asked)
        except _LINK_DOWN:
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
        except RESPONSE_ERRORS:
            # CONFIG denied (a least-privilege ACL user, whose keyspace channels would be
            # denied too) or renamed away: treat notifications as off; waiters still wake on
            # grant messages and on their timers.
            return _ServerFacts(sharded, keyspace=False)
        flags = str(next(iter(reply.values()), "") if reply else "")
        keyspace = "K" in flags and ("A" in flags or ("g" in flags and "x" in flags))
        return _ServerFacts(sharded, keyspace)

    async def _subscribe(self, channel: _Channel) -> None:
        link = channel.link
        async with link.lock:
            if link.pubsub is None:
                link.pubsub = link.client.pubsub()
            if self._sharded:
                await _adapter.ssubscribe(link.pubsub, channel.wake)
            else:
                await link.pubsub.subscribe(channel.wake)
            if channel.keyspace is not None:  # keyspace events are never sharded
                await link.pubsub.subscribe(channel.keyspace)
            self._own_reconnects(link)
            if not link.reading:
                self._start_reader(link)

    def _start_reader(self, link: _Link) -> None:
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
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    link.expect_unsubscribed(channel.wake)
                    if self._sharded:
                        await _adapter.sunsubscribe(link.pubsub, channel.wake)
                    else:
                        await link.pubsub.unsubscribe(channel.wake)
                    if channel.keyspace is not None:
                        link.expect_unsubscribed(channel.keyspace)
                        await link.pubsub.unsubscribe(channel.keyspace)
                if link.unsubscribing and not link.reading:
                    self._start_reader(link)  # to read the confirmations

    def _own_reconnects(self, link: _Link) -> None:
        connection = link.pubsub.connection
        if connection is None:
            return
        if link.saved_retry is None:
            # redis-py's retry re-connects inside a failed read (even after the client was
            # closed, and even while the loop shuts down, orphaning the new socket). The
            # reader re-connects by itself, with a bounded back-off, so errors must reach
            # it untouched. The client's policy is put back when the connection goes back.
            link.saved_retry = (connection, connection.retry)
            connection.retry = _Once()

    def _routed(self, link: _Link) -> list[_Channel]:
        return [channel for channel in self._channels.values() if channel.link is link]

    async def _read(self, link: _Link) -> None:
        delay = _RETRY_MIN
        while self._routed(link) or link.unsubscribing:
            try:
                message = await link.pubsub.get_message(timeout=None)
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
                log.debug("aiolocks: pub/sub read on %r failed: %r", link.name, exc)
                link.unsubscribing.clear()  # a new connection: nothing stale can come
                if not any(channel.refs > 0 for channel in self._routed(link)):
                    # Nobody waits (e.g. the client was closed): stop; the next waiter
                    # subscribes afresh and starts a new reader.
                    link.reader = None
                    await self._drop_idle(link)
                    return
                connection = link.pubsub.connection
                if connection is not None:  # the next read re-connects and re-subscribes
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.disconnect(), 1.0)
                for channel in self._routed(link):
                    self._recheck(channel.wake)
                if self._cluster:
                    self._reroute(link)  # the node may be gone, its slots moved
                await asyncio.sleep(delay)  # reconnect back-off, not a poll of a lock
                delay = min(delay * 2, _RETRY_MAX)
                continue
            if message is not None:
                self._dispatch(link, message)

    def _reroute(self, link: _Link) -> None:
        """Move the channels of `link` whose slot another node owns now (per the client's
        slot map, which redis-py refreshes as commands meet MOVED or a dead node)."""
        for channel in self._routed(link):
            target = self._link_for(channel.wake)
            if target is not link:
                channel.link = target
                channel.confirmed = None
                if channel.refs > 0:
                    self._spawn(self._resubscribe(channel))

    async def _drop_idle(self, link: _Link) -> None:
        """Forget every (idle) subscription of `link`; the next waiter subscribes afresh.
        Only called when no reader is reading the connection."""
        for channel in self._routed(link):
            if channel.linger is not None:
                channel.linger.cancel()
            self._forget(channel)
        pubsub, link.pubsub = link.pubsub, None
        link.unsubscribing.clear()
        if link.saved_retry is not None:
            connection, retry = link.saved_retry
            connection.retry = retry
            link.saved_retry = None
        if pubsub is not None:
            connection = pubsub.connection
            with contextlib.suppress(Exception):
                if connection is not None:
                    # Nobody reads it now (callers see to that), so the close can be
                    # awaited: the socket is shut even if the loop is about to close.
                    await asyncio.wait_for(connection.disconnect(), 1.0)
                await pubsub.aclose()
        if link.owns_client and self._links.get(link.name) is link and not link.reading:
            del self._links[link.name]
            with contextlib.suppress(Exception):
                await link.client.aclose()

    def _dispatch(self, link: _Link, message: dict[str, Any]) -> None:
        kind = _as_bytes(message.get("type"))
        name = _as_bytes(message.get("channel"))
        data = message.get("data")
        if kind in (b"message", b"smessage"):
            payload = _as_bytes(data)
            if name in self._channels:
                self._on_grant(name, payload)
                self._tell(name, Hint.MESSAGE, payload)
            elif name in self._by_keyspace and payload in _GONE:
                self._waitqueue.recheck_first(self._by_keyspace[name])
                self._tell(self._by_keyspace[name], Hint.GONE)
        elif kind in (b"sunsubscribe", b"unsubscribe") and link.unsubscribed(name):
            return  # the confirmation of one of ours
        elif kind == b"sunsubscribe":
            channel = self._channels.get(name)
            if channel is not None and channel.link is link and channel.confirmed is not None:
                # Not asked for (ours come after the channel is forgotten): the server
                # dropped it because its slot moved to another node. Messages may be
                # lost: re-check, and subscribe again where the slot is now.
                self._recheck(name)
                channel.confirmed = None
                if channel.refs > 0:
                    self._spawn(self._follow_slot(channel))
        elif kind in (b"subscribe", b"ssubscribe"):
            wake = self._by_keyspace.get(name, name)
            channel = self._channels.get(wake)
            if channel is None or wake != name or channel.confirmed is None:
                return
            if channel.confirmed.done():
                self._recheck(wake)  # re-subscribed after a reconnect
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
                self._recheck(channel.wake)  # what was sent meanwhile is lost

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(_ignore_result)

    def _on_grant(self, wake: bytes, payload: bytes) -> None:
        # "<token> <fence> <ttl_ms>", maybe followed by more for listeners (an election's).
        parts = payload.split(b" ", 3)
        if len(parts) < 3:
            return
        token, fence, ttl = parts[0].decode(), int(parts[1]), int(parts[2])
        if self._waitqueue.stale(token, fence):
            return  # ended since: a later answer found the token not holding (issue 24)
        lot = self._waitqueue.lot(wake)
        if lot is not None:
            lot.note_lease(ttl, grant=True)
        self._waitqueue.unpark(token, fence, channel=wake)

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
