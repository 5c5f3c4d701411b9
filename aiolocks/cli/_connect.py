"""Which server, and one client on it: found quickly or reported as unreachable (exit 3).

The CLI talks to a single server (or a Sentinel-managed primary's address), not to a Redis
Cluster: it reads several keys of one name in one transaction and asks the server's clock.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio
import redis.exceptions

from .._base._errors import AccessDenied, ServerUnavailable
from .._engine._context import context_for
from ._errors import Refused, Unreachable, UsageError

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "DEFAULT_URL", "connected", "redacted", "server_url"]

DEFAULT_URL = "redis://localhost:6379"
DEFAULT_CONNECT_TIMEOUT = 2.0
# A command (not the connection) that takes longer than this means a stalled server.
_COMMAND_TIMEOUT = 10.0
# The server answered, with an error: a wrong password, a command the ACL denies.
_REFUSALS = (redis.exceptions.ResponseError, redis.exceptions.AuthenticationError)


def server_url(given: str | None) -> str:
    """`--url` if given, else `$REDIS_URL`, else the local default."""
    return given or os.environ.get("REDIS_URL") or DEFAULT_URL


def redacted(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _reason(exc: BaseException) -> str:
    """One line on why: the OS's words for a socket error redis-py wrapped, else its own."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve the host name ({cause.strerror})"
    if isinstance(cause, OSError) and cause.errno:
        return os.strerror(cause.errno)
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


@asynccontextmanager
async def connected(url: str, connect_timeout: float) -> AsyncIterator[redis.asyncio.Redis]:
    """A client on `url` that has answered a PING within `connect_timeout` seconds; redis-py
    errors raised inside the block become `Unreachable` (connection lost) or `Refused` (the
    server answered with an error)."""
    shown = redacted(url)
    try:
        client = redis.asyncio.Redis.from_url(
            url, socket_connect_timeout=connect_timeout, socket_timeout=_COMMAND_TIMEOUT
        )
    except ValueError as exc:
        raise UsageError(f"invalid --url {shown}: {_reason(exc)}") from None
    try:
        try:
            await asyncio.wait_for(client.ping(), connect_timeout)
        except TimeoutError:
            raise Unreachable(
                f"cannot reach {shown}: no answer within {connect_timeout:g} s (--connect-timeout)"
            ) from None
        except _REFUSALS as exc:  # reached, but it will not serve us
            raise Refused(f"the server at {shown} refused: {_reason(exc)}") from None
        except (redis.exceptions.RedisError, OSError) as exc:
            raise Unreachable(f"cannot reach {shown}: {_reason(exc)}") from None
        try:
            yield client
        except (ServerUnavailable, AccessDenied) as exc:
            raise _translate(exc.__cause__ or exc, shown) from None
        except (TimeoutError, redis.exceptions.RedisError, OSError) as exc:
            raise _translate(exc, shown) from None
    finally:
        try:
            await context_for(client).aclose()
        finally:
            await client.aclose()


def _translate(exc: BaseException, shown: str) -> Exception:
    if isinstance(exc, _REFUSALS):
        if isinstance(exc, redis.exceptions.MovedError) or str(exc).startswith("MOVED"):
            return Refused(
                f"{shown} is a Redis Cluster node: the CLI works with a single server only"
            )
        return Refused(f"the server at {shown} refused: {_reason(exc)}")
    return Unreachable(f"lost the server at {shown}: {_reason(exc)}")
