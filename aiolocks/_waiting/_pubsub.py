"""One pub/sub connection (to the server, or to one Cluster node) and what is done on it.

A `Link` subscribes and unsubscribes channels, and keeps the count of its own
unsubscriptions not yet confirmed, so that a stale confirmation is never taken for the
server's. It takes re-connecting away from redis-py (whose retry re-connects inside a
failed read, even after the client was closed): its reader re-connects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._base import _adapter
from .._base._errors import REDIS_ERRORS, TIMEOUT_ERRORS

__all__ = ["Link"]


class Link:
    """One pub/sub connection and its reader task (run by `Subscriptions`)."""

    def __init__(self, name: str, client: Any) -> None:
        self.name = name
        self.client = client  # a redis.asyncio.Redis whose pubsub() this link uses
        self.pubsub: Any = None  # redis.asyncio.client.PubSub, created on first use
        self.reader: asyncio.Task[None] | None = None
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
        return connection is not None and bool(connection.is_connected)

    async def subscribe(self, wake: bytes, keyspace: bytes | None, sharded: bool) -> None:
        """Subscribe `wake` (SSUBSCRIBE if `sharded`) and `keyspace`; under `lock`.

        Once a reader reads the link, its re-connection is the reader's (`reconnect`, under
        `lock`, before each read): a subscriber never re-connects beside it, and a link
        found down, or dropped under a write (the kill seen by the reader's read, or by the
        write), raises ConnectionError. The
        waiter then falls back on its timer, and the reader subscribes the channel on the
        link it re-makes (`Subscriptions._reconnect`)."""
        if self.reading and not self.connected:
            raise redis.exceptions.ConnectionError(f"pub/sub link {self.name!r} is down")
        if self.pubsub is None:
            self.pubsub = self.client.pubsub()
        await self.pubsub.connect()
        self._own_connection()
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
            with contextlib.suppress(Exception):  # the reader's next read fails and backs off
                await self.pubsub.connect()

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
        connection = self.pubsub.connection
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.disconnect(), 1.0)

    async def close(self) -> None:
        """Close the pub/sub connection and forget its subscriptions (the next subscription
        opens a new one). Only called when no reader is reading it."""
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
