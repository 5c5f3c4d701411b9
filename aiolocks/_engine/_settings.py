"""A leased lock's settings: their defaults and the checks run on them at construction.

The contract asks bad arguments to raise `TypeError`/`ValueError` before any Redis call;
every primitive (and the web integrations, for their own options) checks them here, so
each setting has one rule and one message wherever it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .._base._clients import AnyRedis, is_cluster
from .._base._errors import LockLost

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "DEFAULT_TTL",
    "MAX_TTL",
    "LostCallback",
    "validate_int",
    "validate_max_hold",
    "validate_replica_timeout",
    "validate_replicas",
    "validate_timeout",
    "validate_ttl",
]

DEFAULT_TTL = 30.0
DEFAULT_REPLICA_TIMEOUT = 1.0

# The longest lease: its end in server milliseconds must stay exact in Lua's numbers.
MAX_TTL = 1e9

LostCallback = Callable[[LockLost], object]


def validate_int(value: object, what: str, low: int, high: int | None = None) -> int:
    """`value` if it is an int (not a bool) in `low`..`high` (None: no upper bound); raises
    `TypeError`/`ValueError` naming `what` if not. Every count an argument gives."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{what} must be {bounds}, got {value!r}")
    return value


def _seconds(value: object, what: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be {expected}, not {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} is too large: {value!r}") from None


def validate_timeout(timeout: object, what: str = "timeout") -> float | None:
    """Return `timeout` as seconds (None = wait forever, as is `inf`); raise on a bad value."""
    if timeout is None:
        return None
    seconds = _seconds(timeout, what, "a number of seconds or None")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{what} must be >= 0, got {timeout!r}")
    return None if math.isinf(seconds) else seconds


def validate_replicas(replicas: object, client: AnyRedis) -> int:
    count = validate_int(replicas, "replicas", 0)
    if count and is_cluster(client):
        # WAIT must follow the grant on the same connection, to the same node: a Cluster
        # pipeline sends a keyless WAIT to any node.
        raise ValueError("replicas= is not supported with a RedisCluster client")
    return count


def validate_replica_timeout(timeout: object) -> int:
    """Return `replica_timeout` in milliseconds (at least 1); raise on a bad value."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"replica_timeout must be a number of seconds, not {type(timeout).__name__}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"replica_timeout must be finite seconds > 0, got {timeout!r}")
    return max(1, round(timeout * 1000))


def validate_ttl(ttl: object) -> float:
    seconds = _seconds(ttl, "ttl", "a number of seconds")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
    if seconds < 0.01:
        raise ValueError(f"ttl must be at least 0.01 s (renewal runs every ttl/3), got {ttl!r}")
    if seconds > MAX_TTL:
        raise ValueError(f"ttl must be at most {MAX_TTL:g} s, got {ttl!r}")
    return seconds


def validate_max_hold(max_hold: object) -> float | None:
    if max_hold is None:
        return None
    seconds = _seconds(max_hold, "max_hold", "a number of seconds or None")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"max_hold must be a finite number of seconds > 0, got {max_hold!r}")
    return seconds
