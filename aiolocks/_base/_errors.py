"""The aiolocks exception tree, and the one boundary where the client library's errors are
translated: redis-py's, and valkey-py's (a fork of it, whose exception classes have the
same names but are not redis-py's). The engine catches a client error by the tuples below,
which hold both libraries' classes (valkey-py's when it is installed); `map_redis_errors`
turns either into an aiolocks error.

Every exception carries the primitive's name (and the token where it helps) and
builds its own message, so callers never format one by hand.
"""

from __future__ import annotations

from typing import Any

import redis.exceptions

from ._cancel import pending, redeliver

_valkey_exceptions: Any
try:
    import valkey.exceptions as _valkey_exceptions
except ImportError:  # valkey-py is optional (the `valkey` extra)
    _valkey_exceptions = None

__all__ = [
    "AccessDenied",
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
MOVED_ERRORS = _either("MovedError")
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
    """The primitive could not be acquired before the timeout ran out."""

    def __init__(self, name: str, timeout: float, situation: str | None = None) -> None:
        self.timeout = timeout
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
    (`_cancel`: its `wait_for` on Python 3.11) delivered again when the block ends. A
    class, not a generator: one object per use (it wraps every acquisition in flight)."""

    __slots__ = ("_before", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._before = 0

    def __enter__(self) -> None:
        self._before = pending()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            redeliver(self._before)
        elif isinstance(exc, Exception):
            translated = _translated(self.name, exc)
            if translated is not None:
                raise translated from exc


def _translated(name: str, exc: Exception) -> Exception | None:
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
