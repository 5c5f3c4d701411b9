"""The aiolocks exception tree, and the one boundary where the client library's errors are
translated: redis-py's, and valkey-py's (a fork of it, whose exception classes have the
same names but are not redis-py's). The engine catches a client error by the tuples below,
which hold both libraries' classes (valkey-py's when it is installed); `map_redis_errors`
turns either into an aiolocks error.

Every exception carries the primitive's name (and the token where it helps) and
builds its own message, so callers never format one by hand.

At the same boundary, a cancellation the client library swallowed is delivered again (the
last section). On Python 3.11, `asyncio.wait_for` returns the result and drops a
cancellation that arrives in the same loop iteration as the result (fixed in Python 3.12),
and redis-py awaits it around every socket write when the client has a `socket_timeout`. A
cancelled acquire would then return normally, and `asyncio.timeout` would not fire. The
engine counts the task's pending cancellation requests before such a call and, if one
arrived and was not delivered, raises `CancelledError` itself. `cancelling()` tells a
background task whether an error it caught is its own cancellation in disguise.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection
from typing import Any

import anyio
import redis.exceptions

_valkey_exceptions: Any
try:
    import valkey.exceptions as _valkey_exceptions
except ImportError:  # valkey-py is optional (the `valkey` extra)
    _valkey_exceptions = None

__all__ = [
    "AccessDenied",
    "ClientClosed",
    "EngineClosed",
    "LockError",
    "LockLost",
    "LockNotOwned",
    "LockReentry",
    "LockTimeout",
    "LimitMismatch",
    "NotReplicated",
    "ServerUnavailable",
    "map_redis_errors",
]


def _either(name: str, valkey_name: str | None = None) -> tuple[type[Exception], ...]:
    """redis-py's exception class `name`, and valkey-py's of that name if installed."""
    ours: type[Exception] = getattr(redis.exceptions, name)
    theirs = getattr(_valkey_exceptions, valkey_name or name, None)
    return (ours,) if theirs is None else (ours, theirs)


# Either library's errors, by redis-py's class names.
REDIS_ERRORS = _either("RedisError", "ValkeyError")
CONNECTION_ERRORS = _either("ConnectionError")  # BusyLoadingError is one
TIMEOUT_ERRORS = _either("TimeoutError")
RESPONSE_ERRORS = _either("ResponseError")
NOSCRIPT_ERRORS = _either("NoScriptError")
INVALID_RESPONSE_ERRORS = _either("InvalidResponse")
AUTHENTICATION_ERRORS = _either("AuthenticationError")
NOPERMISSION_ERRORS = _either("NoPermissionError")
CLUSTERDOWN_ERRORS = _either("ClusterDownError")
TRYAGAIN_ERRORS = _either("TryAgainError")
READONLY_ERRORS = _either("ReadOnlyError")
_UNREACHABLE: tuple[type[Exception], ...] = (
    TimeoutError,
    *CONNECTION_ERRORS,
    *TIMEOUT_ERRORS,
    OSError,
)


class LockError(Exception):
    """Base class of every error raised by aiolocks."""

    def __init__(self, name: str, reason: str, *, token: str | None = None) -> None:
        self.name = name
        self.reason = reason
        self.token = token
        super().__init__(f"{name!r}: {reason}")


class LockTimeout(LockError, TimeoutError):
    """The primitive could not be acquired before the timeout ran out. From a rate limiter,
    `retry_after` is the seconds until the next free slot (None from a lock, whose holder
    may release any time)."""

    def __init__(
        self,
        name: str,
        timeout: float,
        situation: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        self.timeout = timeout
        self.retry_after = retry_after
        reason = f"not acquired within {timeout:g} s"
        super().__init__(name, reason if situation is None else f"{reason}: {situation}")


class LockNotOwned(LockError):
    """The calling task tried to release a holding it does not have."""


class LockLost(LockError):
    """A held lease ended before it was released: another holder may have run meanwhile."""


class LockReentry(LockError):
    """The calling task tried to acquire a non-reentrant primitive it already holds."""


class LimitMismatch(LockError, ValueError):
    """The name is stored with another configuration (a semaphore's limit) than given."""


class NotReplicated(LockError):
    """A grant was not acknowledged by the asked number of replicas in time (`replicas=`);
    the holding was given back."""


class ServerUnavailable(LockError):
    """Redis could not be reached, did not answer in time, or answered with an error while
    serving the call: a passing condition, worth retrying."""


class AccessDenied(LockError):
    """Redis refused the client's credentials or permissions (no password, a wrong
    password, an ACL `NOPERM`): a configuration error, not worth retrying as it is."""


class ClientClosed(LockError):
    """The Redis client was closed by its user (`aclose()`, `close()`, the end of `async
    with client`): a wait under way ends with it at once, a holding is reported lost
    (`LockLost`), and every later call on that client on the same event loop (an acquire, a
    campaign) raises it, naming the client. The engine makes no call on a client its user
    closed; a later event loop (the next `asyncio.run()`) may use it again."""


CLIENT_CLOSED = (
    "closed by its user (aclose()): aiolocks makes no call on it any more on this event "
    "loop (what was held is lost, waits end; make a new client)"
)


class EngineClosed(ClientClosed):
    """Raised by the engine for a call on a client its user closed, on the event loop it was
    closed on (internal: `map_redis_errors` makes it a `ClientClosed` naming the primitive;
    met outside one, it is a `ClientClosed` naming the client)."""

    def __init__(self, client: str) -> None:
        self.client = client  # (`_adapter.describe`)
        super().__init__(client, CLIENT_CLOSED)


def _access_cause(exc: Exception) -> str:
    text = str(exc)
    if isinstance(exc, NOPERMISSION_ERRORS):
        return f"the user lacks an ACL permission (NOPERM {text})"
    lowered = text.lower()
    if getattr(exc, "status_code", None) == "NOAUTH" or "authentication required" in lowered:
        return "the server requires a password and none was given (NOAUTH)"
    if "no password is set" in lowered:
        return "a password was given but the server has none set"
    return f"wrong username or password ({text})"


class map_redis_errors:
    """Translate redis-py's (and valkey-py's) errors: refused credentials or permissions
    into `AccessDenied`, connection and timeout errors (and a reply that is not Redis
    protocol) into `ServerUnavailable`; and a cancellation that redis-py swallowed
    (`redeliver_cancel`, below: its `wait_for` on Python 3.11) delivered again when the
    block ends. A class, not a generator: one object per use (it wraps every acquisition
    in flight)."""

    __slots__ = ("_before", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._before = 0

    def __enter__(self) -> None:
        self._before = pending_cancels()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            redeliver_cancel(self._before)
        elif isinstance(exc, Exception):
            translated = _translated(self.name, exc)
            if translated is not None:
                raise translated from exc


def _translated(name: str, exc: Exception) -> Exception | None:
    if isinstance(exc, EngineClosed):
        return ClientClosed(name, f"its Redis client {exc.client} was {CLIENT_CLOSED}")
    if isinstance(exc, (*AUTHENTICATION_ERRORS, *NOPERMISSION_ERRORS)):
        return AccessDenied(name, f"Redis refused access: {_access_cause(exc)}")
    if isinstance(exc, INVALID_RESPONSE_ERRORS):
        return ServerUnavailable(
            name, f"Redis unreachable: the endpoint did not answer as Redis does ({exc})"
        )
    if isinstance(exc, CONNECTION_ERRORS) and _pool_ran_out(exc):
        return ServerUnavailable(
            name, f"the client's connection pool ran out (its max_connections): {exc}"
        )
    if isinstance(exc, _UNREACHABLE):
        return ServerUnavailable(name, f"Redis unreachable: {exc}")
    if isinstance(exc, RESPONSE_ERRORS):
        return ServerUnavailable(name, f"Redis refused the call: {exc}")
    return None


def _pool_ran_out(exc: Exception) -> bool:
    """A pool at its `max_connections` (redis-py's MaxConnectionsError from 6.0, "Too many
    connections" before; a BlockingConnectionPool's "No connection available"): the
    server may be fine."""
    text = str(exc)
    return (
        type(exc).__name__ == "MaxConnectionsError"
        or "Too many connections" in text
        or "No connection available" in text
    )


# -- cancellations a library below us swallowed ------------------------------------------


def pending_cancels() -> int:
    """How many cancellation requests of the current task are pending (0 outside a task,
    and outside a running loop: `map_redis_errors` also wraps synchronous code)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return 0
    return 0 if task is None else task.cancelling()


def redeliver_cancel(before: int) -> None:
    """Raise `CancelledError` if a cancellation was requested since `pending_cancels()` returned
    `before` but the awaited call returned normally instead of raising it.

    Not when an anyio cancel scope around us is cancelled: anyio delivers its cancellation
    again at the next await by itself, with the message its scope recognises (a bare
    `CancelledError` would escape the scope).
    """
    if pending_cancels() > before and anyio.current_effective_deadline() != -math.inf:
        raise asyncio.CancelledError


# How often `stop_tasks` cancels again a task that has not ended.
RECANCEL_EVERY = 1.0


async def stop_tasks(tasks: Collection[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again every
    `RECANCEL_EVERY` s any that has not: a cancellation redis-py's `wait_for` swallowed
    (Python 3.11, one that lands as the call it wraps completes) would otherwise leave the
    task running and its closer waiting for ever. Their outcomes are the caller's to read."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_EVERY)


def retrieved(future: asyncio.Future[Any]) -> None:
    """A done callback for a call nobody awaits any more: its error (or its end by a
    cancellation) is read, so that asyncio never logs it as "never retrieved"."""
    if not future.cancelled():
        future.exception()


def cancelling() -> bool:
    """True when the current task is being cancelled (a shutdown racing a dropped socket
    can surface from redis-py as ConnectionError instead of CancelledError)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
