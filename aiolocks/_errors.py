"""The aiolocks exception tree, and the one boundary where redis-py errors are translated.

Every exception carries the primitive's name (and the token where it helps) and
builds its own message, so callers never format one by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.exceptions

__all__ = [
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


class LockError(Exception):
    """Base class of every error raised by aiolocks."""

    def __init__(self, name: str, reason: str, *, token: str | None = None) -> None:
        self.name = name
        self.reason = reason
        self.token = token
        super().__init__(f"{name!r}: {reason}")


class LockTimeout(LockError, TimeoutError):
    """The primitive could not be acquired before the timeout ran out."""

    def __init__(self, name: str, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(name, f"not acquired within {timeout:g} s")


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
    """Redis could not be reached (or answered with an error) while serving the call."""


@contextmanager
def map_redis_errors(name: str) -> Iterator[None]:
    """Translate redis-py's connection and timeout errors into `ServerUnavailable`."""
    try:
        yield
    except (
        TimeoutError,
        redis.exceptions.ConnectionError,
        redis.exceptions.TimeoutError,
        OSError,
    ) as exc:
        raise ServerUnavailable(name, f"Redis unreachable: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        raise ServerUnavailable(name, f"Redis refused the call: {exc}") from exc
