"""Being told a name may be free: one notifier per client, its pub/sub subscriptions and
connections, and what their messages mean.

A grant message unparks the waiter holding its token, a "holder gone" keyspace event wakes
the first waiter of the name, and messages that may have been lost (a reconnect, a slot
move) make every waiter of the channel re-check. Messages are an optimisation of latency
only: every waiter also has a timer, and re-running acquire is idempotent. Whoever must
see every event of a channel (an election's observers) listens.

Read top to bottom: what the notifier is told and what it means (`Notifier`, its first
part); the subscriptions (channels reference-counted by the waiters that need them and kept
for a while after the last one leaves, so a busy name is subscribed once, not once per
wait; after a link re-connects and re-subscribes, messages sent in the gap are gone: every
channel on it is reported out of sync); the reader of each link, and how a message is
told apart; then one pub/sub connection (`Link`, one to the server, or one per Cluster
node that owns a channel's slot: sharded channels and keyspace events are node-local) and
its read policy; last, what must be known of the server before the first subscription
(`ServerFacts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._base import _adapter
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import (
    REDIS_ERRORS,
    RESPONSE_ERRORS,
    TIMEOUT_ERRORS,
    cancelling,
    pending_cancels,
    redeliver_cancel,
    retrieved,
    stop_tasks,
)
from .._scripts import Script, load
from .._transport._runner import MORE, direct_reader, install_replies, restore_protocol
from ._waitqueue import WaitQueue

__all__ = ["Hint", "Link", "Listener", "Notifier", "RunScript", "ServerFacts"]

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
# A link's messages parsed where they arrive, in its transport's callback (`Link`); off:
# its reader task reads each through redis-py's `PubSub.get_message` (as on connections
# that are not plain sockets, or without hiredis).
DIRECT_READS = True

RunScript = Callable[[Script, tuple[bytes, ...], tuple[Any, ...]], Awaitable[Any]]


class Hint(enum.Enum):
    """What a listener of a channel is told (see `Notifier.listen`)."""

    MESSAGE = "message"  # a message on the channel (its payload is given)
    GONE = "gone"  # a keyspace del/expired/evicted event on the channel's watched key
    RESYNC = "resync"  # messages may have been lost (a reconnect, a slot move): re-read


Listener = Callable[[Hint, bytes], None]


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


class Notifier:
    """The pub/sub of one client: its subscriptions, on one link per server (on Cluster,
    per node), and the wake-ups their messages make in its `WaitQueue` and listeners."""

    def __init__(self, client: AnyRedis, waitqueue: WaitQueue, run: RunScript) -> None:
        self._waitqueue = waitqueue
        self._client = client
        self._run = run
        self._cluster = is_cluster(client)
        # Besides waiters, whoever must see every event of a channel (election observers).
        self._listeners: dict[bytes, list[Listener]] = {}
        self._links: dict[str, Link] = {}
        self._channels: dict[bytes, _Channel] = {}
        self._by_keyspace: dict[bytes, bytes] = {}  # keyspace channel -> wake channel
        self._db = 0 if self._cluster else _db_of(client)
        self._facts: asyncio.Future[ServerFacts] | None = None
        self._sharded = False  # set from the facts before the first subscription
        self._closed = False  # with its client's engine: it subscribes no more
        # Background (un)subscriptions, cancelled by `aclose` so none opens a connection
        # after it (which nobody would close).
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what the notifier is told, and what it means ------------------------------------

    def listen(self, wake: bytes, listener: Listener) -> None:
        """Call `listener` on every event of `wake` (it must also `retain` the channel)."""
        self._listeners.setdefault(wake, []).append(listener)

    def unlisten(self, wake: bytes, listener: Listener) -> None:
        listeners = self._listeners.get(wake, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            self._listeners.pop(wake, None)

    def message(self, wake: bytes, payload: bytes) -> None:
        """A message on the channel `wake`: a grant, for the waiters."""
        self._on_grant(wake, payload)
        self._tell(wake, Hint.MESSAGE, payload)

    def gone(self, wake: bytes) -> None:
        """The holder may be gone (a keyspace del/expired/evicted event on the key `wake`
        watches): the first local waiter re-runs acquire."""
        self._waitqueue.recheck_first(wake)
        self._tell(wake, Hint.GONE)

    def resync(self, wake: bytes) -> None:
        """Messages of `wake` may have been lost: waiters re-check, listeners re-read."""
        self._waitqueue.recheck_all(wake)
        self._tell(wake, Hint.RESYNC)

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

    def _tell(self, wake: bytes, hint: Hint, payload: bytes = b"") -> None:
        listeners = self._listeners.get(wake)
        if not listeners:
            return
        for listener in list(listeners):
            try:
                listener(hint, payload)
            except Exception:  # a listener must never stop the reader
                log.exception("aiolocks: a listener of %r failed", wake)

    # -- the subscriptions ---------------------------------------------------------------

    def watching(self, wake: bytes) -> bool:
        """True when grants on `wake` are known to reach this process (subscribed, and its
        link read and not found lost)."""
        channel = self._channels.get(wake)
        return (
            channel is not None
            and channel.confirmed is not None
            and channel.confirmed.done()
            and channel.link.reading
            and channel.link.connected
        )

    async def retain(self, wake: bytes, watch_key: bytes | None) -> None:
        """Hold a reference to `wake` (and the keyspace channel of `watch_key`).

        Returns once the subscription is confirmed, or after a short bound: a waiter whose
        subscription is not confirmed yet still wakes on its timer. A cancellation that
        redis-py or `wait_for` swallowed meanwhile is raised (see `_errors.redeliver_cancel`),
        before that wait too: the caller's deadline, delivered as a cancellation, bounds it.
        Holds no reference if it raises.
        """
        before = pending_cancels()
        await self._retain(wake, watch_key, before)  # holds no reference if it raises
        try:
            redeliver_cancel(before)
        except asyncio.CancelledError:
            self.release(wake)
            raise

    async def _retain(self, wake: bytes, watch_key: bytes | None, before: int) -> None:
        channel = self._channels.get(wake)
        if channel is None:
            facts = await self._server_facts()
            if self._closed:
                return  # closed meanwhile: no link made again (the waiter's next call ends it)
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
        self._take(channel)
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
                # A cancellation the subscription's write swallowed (redis-py's `wait_for`
                # on Python 3.11) would otherwise wait out the whole bound, past the
                # caller's deadline: raised first.
                redeliver_cancel(before)
                with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(channel.confirmed), _CONFIRM_BOUND)
        except BaseException:
            self.release(wake)  # cancelled: the caller never got the reference
            raise

    def retain_soon(self, wake: bytes) -> bool:
        """`retain` (no keyspace channel) without waiting: the reference is taken now and
        the channel subscribed in the background, if it is not yet (`watching` tells when it
        is confirmed). False, with no reference, when no link can carry it yet (or the
        notifier is closed)."""
        if self._closed:
            return False
        channel = self._channels.get(wake)
        if channel is None:
            try:
                link = self._link_for(wake)
            except Exception as exc:  # no node known for the slot (yet: a Cluster client's
                # slots are learnt by its first command, which `retain` makes first)
                log.debug("aiolocks: no pub/sub link for %r: %r", wake, exc)
                return False
            channel = self._channels[wake] = _Channel(wake, None, link)
        self._take(channel)
        if channel.confirmed is None:
            self._spawn(self._subscribe_soon(channel))
        return True

    async def _subscribe_soon(self, channel: _Channel) -> None:
        with contextlib.suppress(*_LINK_DOWN):  # not watching: the caller knows (`watching`)
            await self._server_facts()
            await self._resubscribe(channel)  # (its re-sync tells the listeners it is on)

    @staticmethod
    def _take(channel: _Channel) -> None:
        channel.refs += 1
        if channel.linger is not None:
            channel.linger.cancel()
            channel.linger = None

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
            self._spawn(self._unsubscribe(channel))

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
            link = self._links[name] = Link(name, client, self._received)
            link.owns_client = self._cluster
        return link

    async def _server_facts(self) -> ServerFacts:
        """Asked once per client, however many waiters want to know at the same moment."""
        if self._facts is None:
            self._facts = asyncio.ensure_future(_ask_server(self._client, self._run))
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
            if self._closed:  # closed while this waited for the lock: no new connection
                raise redis.exceptions.ConnectionError("the notifier is closed")
            await link.subscribe(channel.wake, channel.keyspace, self._sharded)
            if not link.reading:
                self._start_reader(link)

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
                self.resync(channel.wake)  # what was sent meanwhile is lost

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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(retrieved)

    async def aclose(self) -> None:
        self._closed = True
        if self._tasks:  # ended before the links close, so what they opened is closed too
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(list(self._tasks), timeout=_CONFIRM_BOUND)
        for link in list(self._links.values()):
            reader, link.reader = link.reader, None
            if reader is not None and reader is not asyncio.current_task():
                await stop_tasks((reader,))
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader  # (ended: its outcome read)
            await self._drop_idle(link)
        self._links.clear()
        # A reference dropped later (a wait ending after its client was closed) finds no
        # channel: it arms no linger, and nothing unsubscribes on a closed connection.
        for channel in self._channels.values():
            if channel.linger is not None:
                channel.linger.cancel()
        self._channels.clear()
        self._by_keyspace.clear()

    # -- the reader of a link, and what it reads -----------------------------------------

    def _start_reader(self, link: Link) -> None:
        link.reader = asyncio.get_running_loop().create_task(
            self._read(link), name=f"aiolocks-notifier {link.name}".rstrip()
        )

    async def _read(self, link: Link) -> None:
        """The reader task of `link`, for as long as a channel is routed to it (or one of
        its unsubscriptions is unconfirmed): it re-connects the link when it is down. Where
        the link's messages are parsed as they arrive (`Link.read_directly`), it only waits
        for the link to break, or to be told to look whether it is still needed; else it
        reads each message through redis-py."""
        delay = _RETRY_MIN
        before = pending_cancels()
        while self._routed(link) or link.unsubscribing:
            try:
                if not link.connected:
                    await self._reconnect(link)
                # A re-connection (ours, or a read's through redis-py) re-subscribes, and
                # redis-py's `wait_for` around those writes may swallow aclose's
                # cancellation (Python 3.11): raised again before the reader waits, as
                # nothing wakes the reader of a link that is up (aclose waited for ever).
                redeliver_cancel(before)
                message = None
                if link.parser is None:
                    message = await link.pubsub.get_message(timeout=None)
                else:
                    await link.stopped()  # raises what broke the link
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
                if link.heard:
                    delay = _RETRY_MIN  # it was read from since it last (re-)connected
                link.unsubscribing.clear()  # a new connection: nothing stale can come
                if not any(channel.refs > 0 for channel in self._routed(link)):
                    # Nobody waits (e.g. the client was closed): stop; the next waiter
                    # subscribes afresh and starts a new reader.
                    link.reader = None
                    await self._drop_idle(link)
                    return
                await link.disconnect()  # the next read re-connects and re-subscribes
                for channel in self._routed(link):
                    self.resync(channel.wake)
                if self._cluster:
                    self._reroute(link)  # the node may be gone, its slots moved
                await asyncio.sleep(delay)  # reconnect back-off, not a poll of a lock
                delay = min(delay * 2, _RETRY_MAX)
                continue
            if message is not None:
                message_type, name = (
                    _as_bytes(message.get("type")),
                    _as_bytes(message.get("channel")),
                )
                self._dispatch(link, message_type, name, _as_bytes(message.get("data")))

    def _received(self, link: Link, reply: list[Any]) -> None:
        """One reply parsed where it arrived on `link` (`Link.read_directly`): bytes, as
        [message_type, channel, data] (a RESP3 push, or a RESP2 array)."""
        if len(reply) != 3:
            return  # nothing the notifier subscribes to (a pattern's message has 4)
        message_type, name, data = reply
        if message_type == b"smessage" or message_type == b"message":
            self._dispatch(link, message_type, name, data)
            return
        if message_type == b"sunsubscribe" or message_type == b"unsubscribe":
            _adapter.pubsub_unsubscribed(
                link.pubsub, message_type, name
            )  # as redis-py's read would
        self._dispatch(link, message_type, name, data)
        if not (link.unsubscribing or self._routed(link)):
            link.poke()  # its reader is no longer needed: it ends

    def _dispatch(self, link: Link, message_type: bytes, name: bytes, data: Any) -> None:
        if message_type == b"smessage" or message_type == b"message":
            if name in self._channels:
                self.message(name, data)
            elif name in self._by_keyspace and data in _GONE:
                self.gone(self._by_keyspace[name])
        elif message_type in (b"sunsubscribe", b"unsubscribe") and link.unsubscribed(name):
            return  # the confirmation of one of ours
        elif message_type == b"sunsubscribe":
            channel = self._channels.get(name)
            if channel is not None and channel.link is link and channel.confirmed is not None:
                # Not asked for (ours come after the channel is forgotten): the server
                # dropped it because its slot moved to another node. Messages may be
                # lost: re-check, and subscribe again where the slot is now.
                self.resync(name)
                channel.confirmed = None
                if channel.refs > 0:
                    self._spawn(self._follow_slot(channel))
        elif message_type in (b"subscribe", b"ssubscribe"):
            wake = self._by_keyspace.get(name, name)
            channel = self._channels.get(wake)
            if channel is None or wake != name or channel.confirmed is None:
                return
            if channel.confirmed.done():
                self.resync(wake)  # re-subscribed after a reconnect
            else:
                channel.confirmed.set_result(None)


def _db_of(client: AnyRedis) -> int:
    return int(_adapter.connection_options(client).get("db", 0) or 0)


def _as_bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return b""


# -- one pub/sub connection ------------------------------------------------------------


class Link:
    """One pub/sub connection (to the server, or to one Cluster node) and its reader task
    (run by the `Notifier`).

    It subscribes and unsubscribes channels, and keeps the count of its own
    unsubscriptions not yet confirmed, so that a stale confirmation is never taken for the
    server's. It takes re-connecting away from redis-py (whose retry re-connects inside a
    failed read, even after the client was closed): its reader re-connects by itself.

    Its messages are parsed where they arrive (`read_directly`: its socket transport's
    protocol swapped, as the auto-pipeline's link does, `_runner.Replies`), each handed to
    `on_reply` in the transport's callback: per message, no task wakes up and redis-py
    builds nothing. redis-py still connects it, writes the subscriptions and subscribes
    again on re-connecting; where that is not possible (no hiredis, not a socket), the
    reader task reads each message through redis-py.
    """

    def __init__(self, name: str, client: Any, on_reply: Callable[[Link, list[Any]], None]) -> None:
        self.name = name
        self.client = client  # a redis.asyncio.Redis whose pubsub() this link uses
        self.pubsub: Any = None  # redis.asyncio.client.PubSub, created on first use
        self.reader: asyncio.Task[None] | None = None
        self.on_reply = on_reply
        # Direct reads: the hiredis reader fed by the transport, what broke the link (its
        # reader raises it), whether anything was read since it (re-)connected, and the
        # future the reader waits on meanwhile.
        self.parser: Any = None
        self.transport: asyncio.BaseTransport | None = None
        self.tried: Any = None  # the socket transport direct reads were last tried on
        self.broken: Exception | None = None
        self.heard = False
        self.wake: asyncio.Future[None] | None = None
        self.lock = asyncio.Lock()
        # The connection's own settings, put back when it goes back to the pool.
        self.saved: tuple[Any, Any, float] | None = None
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

    @property
    def connected(self) -> bool:
        connection = None if self.pubsub is None else self.pubsub.connection
        return connection is not None and bool(connection.is_connected) and self.broken is None

    async def subscribe(self, wake: bytes, keyspace: bytes | None, sharded: bool) -> None:
        """Subscribe `wake` (SSUBSCRIBE if `sharded`) and `keyspace`; under `lock`.

        Once a reader reads the link, its re-connection is the reader's (`reconnect`, under
        `lock`, before each read): a subscriber never re-connects beside it, and a link
        found down, or dropped under a write (the kill seen by the reader's read, or by the
        write), raises ConnectionError. The waiter then falls back on its timer, and the
        reader subscribes the channel on the link it re-makes (`Notifier._reconnect`)."""
        if self.reading and not self.connected:
            raise redis.exceptions.ConnectionError(f"pub/sub link {self.name!r} is down")
        if self.broken is not None:
            await self.disconnect()  # broke while no reader read it: connected anew below
        if self.pubsub is None:
            self.pubsub = self.client.pubsub()
        await self.pubsub.connect()
        self._own_connection()
        self.read_directly()
        writer = _adapter.writer_of(self.pubsub.connection)
        try:
            if sharded:
                await _adapter.ssubscribe(self.pubsub, wake)
            else:
                await self.pubsub.subscribe(wake)
            if keyspace is not None:  # keyspace events are never sharded
                await self.pubsub.subscribe(keyspace)
        except Exception as exc:
            if _adapter.writer_of(self.pubsub.connection) is writer:
                raise
            # The connection was dropped (and maybe re-made) under the write: whatever the
            # client release raised for that, the link was lost.
            raise redis.exceptions.ConnectionError(f"pub/sub link {self.name!r} lost") from exc

    async def reconnect(self) -> None:
        """The reader's re-connection after a failed read (under `lock`): the client
        re-subscribes the channels it knows of as it connects."""
        if self.pubsub is not None and not self.connected:
            if self.broken is not None:
                await self.disconnect()
            with contextlib.suppress(Exception):  # the reader's next read fails and backs off
                await self.pubsub.connect()
                self.read_directly()

    async def unsubscribe(self, wake: bytes, keyspace: bytes | None, sharded: bool) -> None:
        """Unsubscribe what `subscribe` subscribed, if connected; errors are ignored (a
        new connection subscribes afresh). Under `lock`."""
        if self.pubsub is None:
            return
        with contextlib.suppress(*REDIS_ERRORS, OSError):
            self.expect_unsubscribed(wake)
            if sharded:
                await _adapter.sunsubscribe(self.pubsub, wake)
            else:
                await self.pubsub.unsubscribe(wake)
            if keyspace is not None:
                self.expect_unsubscribed(keyspace)
                await self.pubsub.unsubscribe(keyspace)

    def _own_connection(self) -> None:
        """The pub/sub connection's read policy is the reader's, not the client's."""
        connection = self.pubsub.connection
        if connection is None or self.saved is not None:
            return
        self.saved = (connection, connection.retry, connection.health_check_interval)
        # redis-py's retry re-connects inside a failed read (even after the client was
        # closed, and even while the loop shuts down, orphaning the new socket). The reader
        # re-connects by itself, with a bounded back-off, so errors must reach it untouched.
        connection.retry = _Once()
        # A health check reads a PING's reply wherever a command is sent: beside the
        # reader's read, a second reader (redis-py refuses it, valkey-py 6.2 mistakes one
        # reply for the other). The reader's blocking read needs none.
        connection.health_check_interval = 0

    # -- direct reads ----------------------------------------------------------------------

    def read_directly(self) -> None:
        """Have the connection's replies parsed where they arrive, from now on (bytes that
        came while it re-subscribed included), if it allows it (`_runner.direct_reader`);
        else its reader task reads them through redis-py. Once per connection made."""
        connection = self.pubsub.connection
        socket = None if connection is None else _adapter.socket_transport(connection)
        if not DIRECT_READS or socket is None or socket is self.tried:
            return  # tried on this socket already: never switched while redis-py reads it
        self.tried = socket
        self.stop_reading_directly()
        self.broken, self.heard = None, False
        found = direct_reader(connection, pubsub=True)
        if found is None:
            return
        self.parser, self.transport = found
        install_replies(self.transport, self._received, self._lost)
        self._parse()  # what was received before

    def stop_reading_directly(self) -> None:
        """Give the transport its connection's own protocol back (redis-py reads it)."""
        restore_protocol(self.transport)
        self.parser = self.transport = None

    def _received(self, data: bytes) -> None:
        """Bytes off the transport, in its callback: parsed, each message handed on."""
        if self.broken is None and self.parser is not None:
            self.parser.feed(data)
            self._parse()

    def _parse(self) -> None:
        parser = self.parser
        try:
            while True:
                reply = parser.gets()
                if reply is MORE:
                    return
                self.heard = True
                if isinstance(reply, Exception):
                    raise reply  # an error reply: as a read through redis-py would raise
                if isinstance(reply, list):
                    try:
                        self.on_reply(self, reply)
                    except Exception:  # a message that cannot be handled must not stop it
                        log.exception("aiolocks: a pub/sub message on %r failed", self.name)
        except Exception as exc:  # a protocol error
            self._lost(exc)

    def _lost(self, error: BaseException) -> None:
        """The connection broke (or its replies cannot be read): its reader re-makes it."""
        if self.broken is None:
            self.broken = (
                error
                if isinstance(error, Exception)
                else redis.exceptions.ConnectionError(f"connection lost: {error!r}")
            )
        self.poke()

    def poke(self) -> None:
        """Have the reader look whether the link broke, or is still needed."""
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def stopped(self) -> None:
        """Wait while the messages are parsed where they arrive: raise what broke the
        link, or return when poked."""
        if self.broken is None:
            self.wake = asyncio.get_running_loop().create_future()
            try:
                await self.wake
            finally:
                self.wake = None
        if self.broken is not None:
            raise self.broken

    def idle(self, error: Exception) -> bool:
        """Whether a failed read only timed out on a quiet, still open connection (the
        client's `socket_timeout`): nothing is wrong, no message came."""
        connection = None if self.pubsub is None else self.pubsub.connection
        return (
            isinstance(error, TIMEOUT_ERRORS) and connection is not None and connection.is_connected
        )

    async def disconnect(self) -> None:
        """Drop the socket (after a failed read): the next read re-connects and
        re-subscribes."""
        self.stop_reading_directly()
        connection = None if self.pubsub is None else self.pubsub.connection
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.disconnect(), 1.0)

    async def close(self) -> None:
        """Close the pub/sub connection and forget its subscriptions (the next subscription
        opens a new one). Only called when no reader is reading it."""
        self.stop_reading_directly()
        self.broken, self.heard, self.tried = None, False, None
        pubsub, self.pubsub = self.pubsub, None
        self.unsubscribing.clear()
        if self.saved is not None:
            owned: Any = self.saved[0]
            owned.retry, owned.health_check_interval = self.saved[1:]
            self.saved = None
        if pubsub is not None:
            connection = pubsub.connection
            with contextlib.suppress(Exception):
                if connection is not None:
                    # Nobody reads it now (callers see to that), so the close can be
                    # awaited: the socket is shut even if the loop is about to close.
                    await asyncio.wait_for(connection.disconnect(), 1.0)
                await pubsub.aclose()


class _Once(Retry):
    """A retry policy that tries once and never re-connects on failure; a write on a
    connection closed under it (CLIENT KILL seen by the reader), or a re-connection whose
    handshake reads beside the reader, fails as a lost connection, which the waiters
    recover from, not as redis-py 8.1's AttributeError or asyncio's RuntimeError."""

    def __init__(self) -> None:
        super().__init__(NoBackoff(), 0)

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await do()
        except (AttributeError, RuntimeError) as exc:
            if not (_adapter.closed_under_us(exc) or _adapter.read_beside_the_reader(exc)):
                raise
            raise redis.exceptions.ConnectionError(f"connection closed: {exc}") from exc


# -- what must be known of the server before the first subscription ----------------------

# Grants are published with SPUBLISH where the server has sharded pub/sub (the scripts
# decide from its version), so they must be subscribed with SSUBSCRIBE there; keyspace
# events wake waiters sooner where the server has them on (asked with CONFIG GET).
_PUBSUB_MODE = load("pubsub_mode")


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the notifier must know of the server before its first subscription."""

    sharded: bool  # grants are SPUBLISHed: subscribe with SSUBSCRIBE
    keyspace: bool  # keyspace events for generic and expired keys are on


async def _ask_server(client: AnyRedis, run: RunScript) -> ServerFacts:
    """Ask the server (through `run`, the client's script runner, and `client`)."""
    # The scripts decide SPUBLISH or PUBLISH from the server's version: ask them.
    sharded = bool(await run(_PUBSUB_MODE, (), ()))
    try:
        reply = await client.config_get("notify-keyspace-events")
    except RESPONSE_ERRORS:
        # CONFIG denied (a least-privilege ACL user, whose keyspace channels would be
        # denied too) or renamed away: treat notifications as off; waiters still wake on
        # grant messages and on their timers.
        return ServerFacts(sharded, keyspace=False)
    flags = str(next(iter(reply.values()), "") if reply else "")
    keyspace = "K" in flags and ("A" in flags or ("g" in flags and "x" in flags))
    return ServerFacts(sharded, keyspace)
