"""The vocabulary every layer of the engine shares: what a primitive gives it (`Spec`), its
scripts' replies, what failures of a call mean, and how an acquisition ends (`Grant`, `Miss`).

Script conventions (see `_scripts/*.lua`; each reply is decoded, once, in the engine module
that runs the script: `_acquire.AcquireReply`, `_release.ReleaseReply`):

- member = "<token>:<ttl_ms>:<tag>:<side>", the acquisition's queue entry; tag names the
  caller's client (`WaitQueue.tag`): a grant to a waiter with the caller's tag is not
  published, as the caller wakes that waiter from the reply.
- acquire: KEYS = spec.keys, ARGV = member, 'try'|'wait', channel, *spec.args.
- release: KEYS = spec.keys, ARGV = member, channel, *spec.args; withdraws the token
  whatever state it reached, and reports every grant it made.
- renew: KEYS = spec.renew_keys (the lease key, then the keys kept as long as the lease),
  ARGV = token, ttl_ms; returns 1 while still held.
- heartbeat: KEYS = spec.heartbeat_keys (the waiters key, then the keys kept as long as a
  waiter); see `_leases`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._scripts import Script
from . import _telemetry
from ._errors import (
    CLUSTERDOWN_ERRORS,
    CONNECTION_ERRORS,
    READONLY_ERRORS,
    TIMEOUT_ERRORS,
    TRYAGAIN_ERRORS,
)

__all__ = [
    "LOST_REPLY",
    "PASSING_OUTAGE",
    "RETRY_MAX",
    "RETRY_MIN",
    "Grant",
    "Miss",
    "Spec",
]

# What a server that restarts or fails over answers for a while: a queued waiter waits on,
# and a clean-up tries again.
PASSING_OUTAGE = (
    *CONNECTION_ERRORS,  # BusyLoadingError too: a restart loading its data
    *TIMEOUT_ERRORS,
    *CLUSTERDOWN_ERRORS,  # a Cluster node back but not yet serving its slots
    *TRYAGAIN_ERRORS,  # a slot in the middle of a move
    *READONLY_ERRORS,  # a demoted primary, before the client finds the new one
)
# Back-off between re-tries while Redis cannot be reached.
RETRY_MIN, RETRY_MAX = 0.05, 2.0
# A call cut off by these may or may not have run on the server.
LOST_REPLY = (*CONNECTION_ERRORS, *TIMEOUT_ERRORS)


@dataclass(slots=True)
class Spec:
    """What a primitive instance gives the engine: its keys, channel and scripts.

    Never changed once made (a new setting makes a new one), but not `frozen`: a handler
    makes a primitive per request, and a frozen dataclass's `__init__` sets each of its 14
    fields through `object.__setattr__`, 1.7 µs against 0.6 (of a mutex's 3.9 µs to make)."""

    name: str
    side: str  # of its queue members: 'x' exclusive, 'r' / 'w' read / write side
    keys: tuple[bytes, ...]
    heartbeat_keys: tuple[bytes, ...]  # the waiters key, then the keys kept alive with it
    channel: bytes
    watch_key: bytes | None  # a key whose del/expired events mean "re-check"
    acquire: Script
    release: Script
    renew: Script
    renew_keys: tuple[bytes, ...]
    args: tuple[Any, ...] = ()
    # Several holders at once (a semaphore, a read-write lock): a grant ends no lease.
    shared: bool = False
    # Builds the error for a refused acquisition (`Status.REFUSED`), given the stored
    # value; primitives that store configuration set it.
    refused: Callable[[int], Exception] | None = None
    # The instance's cumulative counts (`statistics()`), kept where each event happens.
    counters: _telemetry.Counters = field(default_factory=_telemetry.Counters, compare=False)


@dataclass(frozen=True, slots=True)
class Grant:
    """A successful acquisition: its fence, and when its lease started counting (monotonic)."""

    token: str
    fence: int
    granted_at: float
    # Granted by the acquisition's first call (never queued): nobody live waited in the
    # server's queue then (a local hand-off cohort's chain starts with nobody waiting).
    alone: bool = False


@dataclass(frozen=True, slots=True)
class Miss:
    """Why an acquisition ended without the primitive: what the caller's error tells."""

    unanswered: bool  # the server had not answered the call in flight when time ran out
    wait_ms: int = -1  # the last answer: until the first lease in the way ends (-1 unknown)
    failure: str | None = None  # the last re-check's connection error, if it failed
    local: bool = False  # it waited in its process's local hand-off cohort, not on the server

    def situation(self) -> str:
        """The situation, in words, for `LockTimeout`'s message."""
        if self.local:
            return (
                "held by another task of this process (it waited behind it here, in the "
                "local hand-off, never on the server's queue)"
            )
        if self.unanswered:
            return "Redis did not answer in time (a stalled server or link, not contention)"
        if self.failure is not None:
            return f"Redis could not be reached at the last re-check ({self.failure})"
        if self.wait_ms >= 0:
            return (
                "held by another holder (the first lease in the way had "
                f"{self.wait_ms} ms left at the last check)"
            )
        return "held by another holder"
