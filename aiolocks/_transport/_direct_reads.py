"""Direct reads: a link's replies taken straight off its socket's transport, parsed by a
hiredis reader in the transport's own callback, instead of by a task reading through
redis-py.

Reading through redis-py costs, per reply, a task's wake-up, two more loop iterations and a
timer; here each reply answers its caller where its bytes arrive. This module only swaps
the transport's protocol (`Replies`) and builds the reader; the link (`_pipelink`) parses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.exceptions
from redis.asyncio.connection import AbstractConnection

try:
    import hiredis

    HIREDIS = True
    # RESP3 pushes (hiredis 3.2+), told apart from replies; without it, RESP2 links only.
    PUSH: tuple[type, ...] = tuple(
        kind for kind in (getattr(hiredis, "PushNotification", None),) if kind is not None
    )
except ImportError:  # pragma: no cover - a dependency of ours (redis[hiredis])
    HIREDIS = False
    PUSH = ()

from .._base import _adapter

__all__ = ["HIREDIS", "MORE", "PUSH", "Replies", "install", "reader_for", "restore"]

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


def reader_for(connection: AbstractConnection) -> tuple[Any, asyncio.BaseTransport] | None:
    """A hiredis reader for `connection`'s replies, and its transport, if the connection is
    a socket with nothing buffered and hiredis can parse its protocol (RESP2, or RESP3
    with pushes marked); else None: redis-py reads it."""
    transport = _adapter.socket_transport(connection)  # asyncio's, or uvloop's
    if (
        not HIREDIS
        or str(getattr(connection, "protocol", 2)) not in _PROTOCOLS
        or transport is None
        or _adapter.unread(connection) is not False
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
    if encoder.decode_responses:
        options["encoding"] = encoder.encoding
        options["errors"] = encoder.encoding_errors
    return hiredis.Reader(**options), transport


def install(
    transport: asyncio.BaseTransport,
    received: Callable[[bytes], None],
    lost: Callable[[BaseException], None],
) -> None:
    """Have `transport` call `Replies` (passing all on to its own protocol)."""
    transport.set_protocol(Replies(received, lost, transport.get_protocol()))


def restore(transport: asyncio.BaseTransport | None) -> None:
    """Give a direct link's transport its connection's own protocol back."""
    protocol = None if transport is None else transport.get_protocol()
    if isinstance(protocol, Replies):
        assert transport is not None
        transport.set_protocol(protocol.inner)
