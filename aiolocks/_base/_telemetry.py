"""The engine's event hooks: metrics and spans, only when asked for; and each instance's
counters.

The engine keeps each instance's cumulative `Counters` (read by `statistics()`) itself,
where each event happens. It calls the `on_*` functions (and `observe` around `acquire`)
at a few points (acquire, release, hand-off, lease renewal, lease loss) only when
`aiolocks.otel.instrument()` has installed a `recorder`, to which they pass the event on.
With none installed the cost is a None test at the call site, no call into this module,
and nothing imports OpenTelemetry. A recorder that fails is logged, never raised:
telemetry must not break a lock, nor the lease keeper that calls it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from ._keys import parse_key

__all__ = [
    "ACQUIRED",
    "BUSY",
    "CANCELLED",
    "ERROR",
    "TIMEOUT",
    "Counters",
    "HoldingView",
    "LockView",
    "Recorder",
    "LeaseView",
    "LimitCall",
    "SpecView",
    "describe",
    "observe",
    "on_handoff",
    "on_lease_lost",
    "on_release",
    "on_renewal",
    "recorder",
]

log = logging.getLogger("aiolocks")

# How an acquire() call ended.
ACQUIRED, TIMEOUT, BUSY, CANCELLED, ERROR = "acquired", "timeout", "busy", "cancelled", "error"

AcquireCall = Callable[[bool, "float | None"], Awaitable[bool]]


class Counters:
    """Cumulative counts of one primitive instance since it was made (`statistics()`),
    kept where each event happens (a lock's `acquire` and lease losses, the releases'
    `_release.handed_off`, the rate limiter's acquire), recorder or none."""

    __slots__ = ("acquisitions", "handoffs", "leases_lost", "timeouts")

    def __init__(self) -> None:
        self.acquisitions = 0  # acquire() calls that got it
        self.timeouts = 0  # acquire() calls whose timeout ran out
        self.leases_lost = 0  # holdings whose lease was lost
        self.handoffs = 0  # grants its releases made to waiters


# What the hooks read of the engine's objects, described here rather than imported: this
# module sits at the bottom, below the specs, locks and leases that call it.


class SpecView(Protocol):
    """A primitive instance's `Spec`: its renewal keys and counters."""

    @property
    def renew_keys(self) -> tuple[bytes, ...]: ...

    @property
    def counters(self) -> Counters: ...


class HoldingView(Protocol):
    """One holding (`_leases._keeper.Holding`)."""

    @property
    def token(self) -> str: ...

    @property
    def fence(self) -> int: ...


class LockView(Protocol):
    """A primitive instance whose `acquire()` is observed (`LeasedLock`)."""

    @property
    def name(self) -> str: ...

    @property
    def _spec(self) -> SpecView: ...

    def _current(self) -> HoldingView | None:
        """The current task's holding, if any."""


class LeaseView(Protocol):
    """A lease the keeper renews (`_leases.Lease`)."""

    @property
    def keys(self) -> tuple[bytes, ...]: ...


class LimitCall:
    """What a rate limiter's acquire() adds to its report: its limits, (rate, per, burst)
    each, as used by the call; the limit that set the slot (0-based; None: a slot free at
    once) and the seconds until that slot (slept for, or refused for)."""

    __slots__ = ("binding", "delay", "limits")

    def __init__(self, limits: tuple[tuple[float, float, int], ...]) -> None:
        self.limits = limits
        self.binding: int | None = None
        self.delay = 0.0


class Recorder(Protocol):
    """What `instrument()` installs; every method is called on the event loop."""

    def acquire_started(self, lock: LockView) -> object:
        """An acquire() call began; the returned handle comes back to `acquire_ended`."""

    def acquire_ended(
        self,
        handle: object,
        lock: LockView,
        outcome: str,
        error: BaseException | None,
        limit: LimitCall | None,
    ) -> None:
        """It ended with `outcome` (one of ACQUIRED ... ERROR); on ACQUIRED the current
        task holds `lock` (a rate limiter's: `limit` says which limit held the call back)."""

    def released(self, spec: SpecView, token: str) -> None:
        """The holding `token` is being released (its hold ends)."""

    def handed_off(self, spec: SpecView, count: int, local: bool) -> None:
        """A release let `count` waiters in (`local`: a cohort's pass, no Redis call)."""

    def lease_lost(self, spec: SpecView, token: str) -> None:
        """The lease of holding `token` was lost."""

    def renewed(self, leases: Sequence[LeaseView], results: Sequence[object]) -> None:
        """One renewal batch: each lease's result (1 renewed, 0 lost, an exception failed)."""


recorder: Recorder | None = None
"""The installed recorder; None (the default) means telemetry is off."""


async def observe(
    lock: LockView,
    blocking: bool,
    timeout: float | None,
    acquire: AcquireCall,
    limit: LimitCall | None = None,
) -> bool:
    """Report `acquire(blocking, timeout)`, an acquisition of `lock` (which counts it in
    `lock`'s counters itself), to the installed recorder; called only when one is. A rate
    limiter's `acquire` fills in `limit`."""
    active = recorder
    if active is None:
        return await acquire(blocking, timeout)
    try:
        handle = active.acquire_started(lock)
    except Exception:
        log.exception("aiolocks: telemetry recorder failed")
        return await acquire(blocking, timeout)
    try:
        acquired = await acquire(blocking, timeout)
    except BaseException as exc:
        outcome = CANCELLED if isinstance(exc, asyncio.CancelledError) else ERROR
        _safely(active.acquire_ended, handle, lock, outcome, exc, limit)
        raise
    if acquired:
        outcome = ACQUIRED
    elif not blocking or timeout == 0:  # one try, refused: busy, not a timeout
        outcome = BUSY
    else:
        outcome = TIMEOUT
    _safely(active.acquire_ended, handle, lock, outcome, None, limit)
    return acquired


def on_release(spec: SpecView, token: str) -> None:
    """The holding `token` is being released."""
    active = recorder
    if active is not None:
        _safely(active.released, spec, token)


def on_handoff(spec: SpecView, count: int, *, local: bool = False) -> None:
    """A release let `count` waiters in: by the release script's grants, or `local`ly, a
    `local_handoff` cohort passing its lease to its next task."""
    active = recorder
    if active is not None:
        _safely(active.handed_off, spec, count, local)


def on_lease_lost(spec: SpecView, token: str) -> None:
    """The lease of holding `token` was lost (found by renewal, or at release)."""
    active = recorder
    if active is not None:
        _safely(active.lease_lost, spec, token)


def on_renewal(leases: Sequence[LeaseView], results: Sequence[object]) -> None:
    """The lease keeper settled one renewal batch."""
    active = recorder
    if active is not None and leases:
        _safely(active.renewed, leases, results)


@functools.lru_cache(maxsize=1024)
def describe(key: bytes) -> tuple[str, str]:
    """(kind, name) of the primitive whose renewal key is `key`; kind is one of `mutex`,
    `semaphore`, `rwlock_read`, `rwlock_write`, `election`, `ratelimit` (its state key)."""
    kind, name, part = parse_key(key)
    if kind == "rwlock":
        kind = "rwlock_write" if part == "writer" else "rwlock_read"
    return kind, name


def _safely(method: Callable[..., object], *args: Any) -> None:
    try:
        method(*args)
    except Exception:
        log.exception("aiolocks: telemetry recorder failed")
