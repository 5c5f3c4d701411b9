"""LeasedLock: the base of every primitive whose acquisitions are task-owned leases.

What a user calls on a mutex, a semaphore or a side of a read-write lock, read whole in this
one class: its settings and its holdings by task (each acquisition a `Holding`, owned by the
task that made it, its lease given to the keeper); `acquire()` (the one acquisition of
`_acquire`, then `replicas=` confirmed) and `release()` (through `_release`); a holding
capped at `max_hold` and reported when lost (the `async with` body cancelled, `on_lost`
called); `detach()` / `adopt()` (a holding moved to a new token of another process in one
script); the current task's `fencing_token`, `lost` and `statistics()`; `async with` and the
decorator form. A subclass supplies the `Spec` (its keys and scripts) and overrides the
hooks (`_make_spec`, `_hold`, `_release_call`, ...) where it differs, as the multi-lock does.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

from .._base import _adapter, _clock, _spec, _telemetry
from .._base._clients import AnyRedis, ensure_async_client
from .._base._errors import (
    LockError,
    LockLost,
    LockNotOwned,
    LockReentry,
    LockTimeout,
    NotReplicated,
    ServerUnavailable,
    map_redis_errors,
)
from .._base._handle import LockHandle
from .._base._keys import DEFAULT_PREFIX, validate_name, validate_prefix
from .._base._query import AsyncWithOnly
from .._leases._keeper import Callbacks, Holding, Lease, LeaseOwner, current_task
from .._scripts import Script
from .._waiting._notifier import Hint
from . import _acquire, _release
from ._context import ClientContext, context_for, open_context
from ._settings import (
    DEFAULT_REPLICA_TIMEOUT,
    DEFAULT_TTL,
    LostCallback,
    validate_max_hold,
    validate_replica_timeout,
    validate_replicas,
    validate_timeout,
    validate_ttl,
)

__all__ = [
    "CHAIN_BOUND",
    "DEFAULT_LOCAL_HANDOFF",
    "MAX_LOCAL_HANDOFF",
    "Cohort",
    "LeasedLock",
    "LockStatistics",
    "cohort_token",
    "is_cohort_token",
]

log = logging.getLogger("aiolocks")

# -- local hand-off (`RedisMutex(local_handoff=N)`, the `Cohort` below) --
MAX_LOCAL_HANDOFF = 10_000
# `RedisMutex`'s default `local_handoff`: measured best of 4 and 16 (docs/benchmarks.md).
DEFAULT_LOCAL_HANDOFF = 16
# Local passes stop this long after a waiter in another process queued behind the cohort
# (its announcement arrived: see `Cohort`), and after any holding this long. Go's
# sync.Mutex turns fair after a 1 ms wait, but a pass through Redis costs ~100x a thread's
# hand-off (a round trip): 10 ms keeps 0.1-5 ms bodies passing locally and makes 20 ms ones
# strict FIFO (docs/benchmarks.md).
CHAIN_BOUND = 0.010

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT_REPLICA_TIMEOUT_MS = validate_replica_timeout(DEFAULT_REPLICA_TIMEOUT)
_DEFAULT_TTL_MS = max(1, round(DEFAULT_TTL * 1000))

# Why the current task's last acquisition through Redis failed, for `LockTimeout`'s message
# (a context variable: `acquire()` runs in the caller's task, as does `__aenter__`).
# An acquisition that waited for its process's other tasks only (`local_handoff`).
_LOCAL_MISS = _spec.Miss(unanswered=False, local=True)
_last_miss: contextvars.ContextVar[_spec.Miss | None] = contextvars.ContextVar(
    "aiolocks_last_miss", default=None
)

# A failed acquisition lets go of its task: each frame of the acquisition that refers to the
# acquiring task (`__aenter__`, `_counted_acquire`, a cohort's `acquire` and `_contend`)
# deletes that reference before an exception leaves it. A traceback keeps every frame it
# passes through, and a task that ends with the exception (a cancelled request, a worker's
# `LockTimeout`) keeps the traceback: a frame still referring to the task would make a cycle
# (the task, its coroutine and its context, often a whole request's) that only the garbage
# collector frees. `asyncio.Lock` leaves none either.


@dataclass(frozen=True, slots=True)
class LockStatistics:
    """A cheap local snapshot of one primitive instance (no Redis call)."""

    name: str
    held_here: int  # holdings of this instance in this process
    tasks_waiting: int  # tasks of this instance waiting to acquire
    lease_remaining: float | None  # seconds the current task's lease is known valid, if held
    lost: bool  # the current task's holding was lost
    # Cumulative, for this instance since it was made (every task, this process):
    acquisitions: int = 0  # acquire() calls that got it
    timeouts: int = 0  # acquire() calls whose timeout ran out (LockTimeout included)
    leases_lost: int = 0  # holdings whose lease was lost
    handoffs: int = 0  # waiters its releases let in (each a grant made by the release)


class LeasedLock(AsyncWithOnly):
    """Base of every primitive whose acquisitions are task-owned leases."""

    _kind = "lock"
    _local_handoff = 0  # > 0: tasks of this process pass the lease on (see `Cohort`)
    _handle_kind = ""  # the `LockHandle.kind` of its holdings (see detach / adopt)

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        max_hold: float | None = None,
    ) -> None:
        self._client = ensure_async_client(client)
        self._name = validate_name(name)
        # Each setting given is checked; a default, the same object, is known good (a
        # handler makes a mutex per request, most settings left at their defaults).
        self._prefix = prefix if prefix is DEFAULT_PREFIX else validate_prefix(prefix)
        if ttl is DEFAULT_TTL:
            self._ttl, self._ttl_ms = ttl, _DEFAULT_TTL_MS
        else:
            self._ttl = validate_ttl(ttl)
            self._ttl_ms = max(1, round(self._ttl * 1000))
        self._timeout = None if timeout is None else validate_timeout(timeout)
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        self._on_lost = on_lost
        self._replicas = (
            0  # (the default: nothing to check, and no Cluster question to ask)
            if replicas == 0 and type(replicas) is int
            else validate_replicas(replicas, self._client)
        )
        self._replica_timeout_ms = (
            _DEFAULT_REPLICA_TIMEOUT_MS
            if replica_timeout is DEFAULT_REPLICA_TIMEOUT
            else validate_replica_timeout(replica_timeout)
        )
        self._max_hold = None if max_hold is None else validate_max_hold(max_hold)
        if self._max_hold is not None and self._local_handoff:
            # A cohort's lease outlives each local holding; capping one would end the chain.
            raise ValueError("max_hold cannot be combined with local_handoff")
        self._holdings: dict[asyncio.Task[Any], Holding] = {}
        self._waiting = 0
        self._spec = self._make_spec()
        # Its cohort's key, with `local_handoff` (see `Cohort`).
        self._cohort_key: _Key = (self._spec.channel, self._ttl_ms, self._local_handoff)

    @property
    def name(self) -> str:
        return self._name

    @property
    def ttl(self) -> float:
        return self._ttl

    def __repr__(self) -> str:
        class_name = type(self).__name__
        return f"<{class_name} {self._name!r} ttl={self._ttl:g} held_here={len(self._holdings)}>"

    # -- the hooks a primitive overrides -------------------------------------------------

    def _make_spec(self) -> _spec.Spec:
        raise NotImplementedError

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        """The script (and its keys) that moves a holding to a new token, for `adopt()`."""
        raise NotImplementedError

    def _held_elsewhere(self, task: asyncio.Task[Any]) -> Holding | None:
        """A holding of `task` that makes acquiring this one a self-deadlock (e.g. the other
        side of a read-write lock); none by default."""
        return None

    def _hold(self, context: ClientContext, task: asyncio.Task[Any], grant: _spec.Grant) -> None:
        """`task` holds this instance now, by `grant`: its lease renewed, its cap armed."""
        holding = self._install(task, grant.token, grant.fence)
        holding.lease = self._new_lease(grant, holding)
        context.keeper.hold(holding.lease)
        if self._max_hold is not None:
            self._cap(context, holding, grant.granted_at)

    def _stop_renewal(self, context: ClientContext, holding: Holding) -> None:
        """Take `holding`'s lease(s) out of the keeper (released, detached or capped)."""
        if holding.lease is not None:
            context.keeper.drop(holding.lease)

    async def _release_call(self, context: ClientContext, token: str) -> bool | None:
        """Run the release script(s) for `token` once (see `_release.release`)."""
        return await _release.release(context, self._spec, token, self._ttl_ms)

    async def _give_back_holding(self, holding: Holding) -> bool | None:
        """`holding`'s release, as its lease's owner is asked for one (the loop's end)."""
        return await self._release_call(context_for(self._client), holding.token)

    def _release_surely(
        self, context: ClientContext, holding: Holding
    ) -> Awaitable[bool | _release.Unanswered | None]:
        """`_release_call` for `holding`, completed even if the caller is cancelled
        meanwhile; its lease is renewed until the release is answered, which is waited for
        while the lease is known valid (`Unanswered` past it, the release going on in the
        background). (Not a coroutine: one level less in every release.)"""
        if holding.lease is None:
            self._stop_renewal(context, holding)
            return _release.release_surely(context, self._spec, holding.token, self._ttl_ms)
        lease = holding.lease
        return _release.release_until(
            context, self._spec, holding.token, self._ttl_ms, lease.valid_until, lease=lease
        )

    # -- the holdings, by task -------------------------------------------------------------

    def _new_lease(self, grant: _spec.Grant, owner: LeaseOwner) -> Lease:
        return Lease(
            self._spec.renew,
            self._spec.renew_keys,
            (grant.token, self._ttl_ms),
            self._ttl,
            grant.granted_at,
            owner,
        )

    def _install(
        self, task: asyncio.Task[Any], token: str, fence: int, lease: Lease | None = None
    ) -> Holding:
        """Record that `task` holds this instance now."""
        holding = Holding(self, task, token, fence)
        holding.lease = lease
        self._holdings[task] = holding
        return holding

    def _take_holding(self, holding: Holding) -> None:
        """`holding` (one of this instance's) is being released: it is no longer held."""
        del self._holdings[holding.task]
        holding.end_body()  # released inside its `async with` body: no loss cancels it now

    def _find_holding(self) -> Holding:
        """The current task's holding, else one of a task that has finished."""
        task = current_task()
        holding = self._holdings.get(task)
        if holding is not None:
            return holding
        for owner, held in self._holdings.items():
            if owner.done():  # e.g. acquired inside asyncio.wait_for's own task
                return held
        raise LockNotOwned(self._name, "the current task does not hold it")

    def _current(self) -> Holding | None:
        task = asyncio.current_task()
        return None if task is None else self._holdings.get(task)

    # -- max_hold: a holding is renewed that long at most ----------------------------------

    def _cap(self, context: ClientContext, holding: Holding, since: float) -> None:
        """Arm `max_hold` for `holding`, counted from `since` (monotonic)."""
        if self._max_hold is None or holding.lease is None:
            return
        delay = max(0.0, since + self._max_hold - _clock.monotonic())
        holding.cap = asyncio.get_running_loop().call_later(
            delay, self._max_hold_reached, context, holding
        )

    def _max_hold_reached(self, context: ClientContext, holding: Holding) -> None:
        """Stop renewing `holding` and report it lost; its lease then ends on the server by
        itself (or sooner, when the cancelled body releases it)."""
        holding.cap = None
        lease = holding.lease
        if lease is None or lease.lost or holding.is_lost:
            return
        self._stop_renewal(context, holding)
        lease.ended()
        assert self._max_hold is not None
        self._lease_lost(
            holding, f"held for max_hold={self._max_hold:g} s, so its renewal was stopped"
        )

    @staticmethod
    def _uncap(holding: Holding) -> None:
        if holding.cap is not None:
            holding.cap.cancel()
            holding.cap = None

    # -- a lost lease: the holder is told --------------------------------------------------

    def _lost_error(self, holding: Holding) -> LockLost:
        return LockLost(self._name, f"lease lost: {holding.lost_reason}", token=holding.token)

    def _keeper_lost(self, holding: Holding, reason: str) -> None:
        """The keeper lost `holding`'s lease: its validity ended with Redis unanswering, or
        another owner holds the name. The holder is told, and the token is given back at
        once, in the background (`_release.give_back_lost`), not when the task releases."""
        self._lease_lost(holding, reason)
        context = open_context(self._client)
        if context is not None:
            _release.give_back_lost(
                context, self._spec, holding.token, self._ttl_ms, holding.give_back
            )

    def _lease_lost(self, holding: Holding, reason: str) -> None:
        holding.mark_lost(reason)
        self._spec.counters.leases_lost += 1
        if _telemetry.recorder is not None:
            _telemetry.on_lease_lost(self._spec, holding.token)
        if self._holdings.get(holding.task) is holding:
            holding.cancel_body()
        if self._on_lost is not None:
            try:
                self._on_lost(self._lost_error(holding))
            except Exception:
                log.exception("aiolocks: on_lost callback of %r failed", self._name)

    # -- acquire / release -------------------------------------------------------------

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquire for the current task; False if not blocking and busy, or on timeout.

        `timeout` bounds the whole call, Redis round trips included; `timeout=0` means
        one try, the same as `blocking=False`. Raises `LockReentry` if the current task
        already holds this instance.
        """
        if _telemetry.recorder is not None:
            return await _telemetry.observe(self, blocking, timeout, self._counted_acquire)
        return await self._counted_acquire(blocking, timeout)

    async def _counted_acquire(
        self, blocking: bool, timeout: float | None, task: asyncio.Task[Any] | None = None
    ) -> bool:
        """`acquire`, its outcome counted for `statistics()` (`task`: the current one, if
        the caller has it already)."""
        if timeout is not None:  # (None, the common case, needs no check)
            timeout = validate_timeout(timeout)
        if not blocking and timeout is not None:
            raise ValueError("a timeout cannot be given with blocking=False")
        if timeout == 0:
            # A zero deadline would end the call before its one try reached Redis.
            blocking, timeout = False, None
        if task is None:
            task = current_task()
        held = self._holdings.get(task)
        if held is not None:
            reason = "the current task already holds it (not reentrant)"
            raise LockReentry(self._name, reason, token=held.token)
        held = self._held_elsewhere(task)
        if held is not None:
            reason = "the current task holds the other side (that would deadlock)"
            raise LockReentry(self._name, reason, token=held.token)
        context = context_for(self._client, task.get_loop())
        deadline = None if timeout is None else _clock.monotonic() + timeout
        self._waiting += 1
        try:
            cohorts = context.cohorts if self._local_handoff else None
            cohort = None if cohorts is None else self._cohort_for(context, cohorts, task)
            if cohort is not None:
                acquired = await cohort.acquire(self, task, blocking, deadline)
            else:  # strict FIFO, or alone: through Redis (as a cohort's contender would)
                grant = None
                try:
                    grant = await self._acquire_grant(
                        context, self._local_handoff, blocking, deadline
                    )
                finally:
                    if cohorts is not None:
                        self._acquired_alone(cohorts, context, task, grant)
                acquired = grant is not None
                if grant is not None and cohorts is None:
                    self._hold(context, task, grant)
            if not acquired and self._local_handoff and _last_miss.get() is None:
                _last_miss.set(_LOCAL_MISS)  # (no call to Redis told why)
        except BaseException:
            del task  # (a failed acquisition lets go of its task: above)
            raise
        finally:
            self._waiting -= 1
        if acquired:
            self._spec.counters.acquisitions += 1
        elif blocking:  # (timeout=0 is blocking=False by now): a timeout, not busy
            self._spec.counters.timeouts += 1
        return acquired

    def _cohort_for(
        self, context: ClientContext, cohorts: dict[_Key, Cohort | _Solo], task: asyncio.Task[Any]
    ) -> Cohort | None:
        """With `local_handoff`: the cohort `task` acquires through, or None when no other
        task of this process wants the lock, a `_Solo` entry then standing for `task` (no
        `Cohort` is made: the task acquires alone, through Redis, with a cohort's token, its
        fence block reserved). The first task that finds one acquiring or holding alone
        makes the cohort, which takes it over."""
        key = self._cohort_key
        found = cohorts.get(key)
        if found is None:
            cohorts[key] = (self, task, 0.0)
            return None
        if isinstance(found, Cohort):
            return found
        cohort = cohorts[key] = Cohort(context, self._spec, self._ttl_ms, self._local_handoff)
        cohort.take_over(found)
        return cohort

    def _acquired_alone(
        self,
        cohorts: dict[_Key, Cohort | _Solo],
        context: ClientContext,
        task: asyncio.Task[Any],
        grant: _spec.Grant | None,
    ) -> None:
        """The acquisition `task` began alone (`_cohort_for`) ended: it holds the lock alone
        now, or leaves; a cohort made meanwhile takes the outcome over."""
        key = self._cohort_key
        found = cohorts.get(key)
        if isinstance(found, Cohort):
            found.contended(self, task, grant)
        elif found is not None and found[0] is self and found[1] is task:
            if grant is None:
                del cohorts[key]
            else:
                self._hold(context, task, grant)
                cohorts[key] = (self, task, _clock.monotonic())

    def _leave_alone(self, context: ClientContext, holding: Holding) -> Cohort | None:
        """The cohort of `holding` (a local hand-off one), which leaves this process
        (released or detached); None if it was held alone, which it no longer is."""
        cohorts: dict[_Key, Cohort | _Solo] = context.cohorts
        key = self._cohort_key
        found = cohorts.get(key)
        if isinstance(found, Cohort):
            return found
        if found is not None and found[0] is self and found[1] is holding.task:
            del cohorts[key]
        return None

    async def _acquire_grant(
        self, context: ClientContext, local_handoff: int, blocking: bool, deadline: float | None
    ) -> _spec.Grant | None:
        """One acquisition through Redis (replication confirmed, if asked for);
        `local_handoff` > 0 makes it a local hand-off cohort's, which reserves
        `local_handoff + 1` fences."""
        token = _clock.token_hex(16)
        if local_handoff:
            token = cohort_token(token, local_handoff)
        try_bound, deadline = self._try_deadline(blocking, deadline)
        with map_redis_errors(self._name):
            grant = await _acquire.acquire(
                context,
                self._spec,
                token,
                self._ttl_ms,
                blocking=blocking,
                deadline=deadline,
                respec=None if self._spec.refused is None else self._current_spec,
            )
        if isinstance(grant, _spec.Miss):
            self._missed(grant, try_bound, token)
            return None
        if self._replicas:
            await self._confirm_replicated(context, grant)
        return grant

    async def _confirm_replicated(self, context: ClientContext, grant: _spec.Grant) -> None:
        """Have `replicas` replicas acknowledge `grant` before it is reported; give it back
        and raise `NotReplicated` if they do not within `replica_timeout`."""
        given_back = False
        spec, ttl_ms, replicas = self._spec, self._ttl_ms, self._replicas
        # The acquire script again (it may grant the token anew), on a pooled connection of its
        # own even with auto-pipelining: in a task that leaving does not stop, and the give-back
        # is sent after its reply (`_release.InFlight`).
        in_flight = _release.InFlight(
            _acquire.confirm(context, spec, grant.token, ttl_ms, replicas, self._replica_timeout_ms)
        )
        try:
            with map_redis_errors(self._name):
                status, acked = await in_flight.reply()
            if status is not _acquire.Status.GRANTED:
                raise LockLost(
                    self._name, "lost before its replication was confirmed", token=grant.token
                )
            if acked < replicas:
                given_back = True
                await _release.shielded(
                    lambda: _release.release(context, spec, grant.token, ttl_ms),
                    _release.CLEANUP_BOUND,
                )
                raise NotReplicated(
                    self._name,
                    f"{acked} of {replicas} replica(s) acknowledged the grant within "
                    f"{self._replica_timeout_ms} ms; it was given back",
                    token=grant.token,
                )
        except BaseException:
            if not given_back:
                await _release.withdraw(
                    context, spec, grant.token, ttl_ms, None, after=in_flight.after()
                )
            raise

    def _current_spec(self) -> _spec.Spec:
        """The instance's spec now (after a `set_limit()`, a new one): for an acquisition
        that a stale one's refusal sends back to try again."""
        return self._spec

    def _try_deadline(
        self, blocking: bool, deadline: float | None
    ) -> tuple[float | None, float | None]:
        """(the try's bound, the deadline): one try (not blocking) waits for the server at
        most the try bound (`_try_bound`), as the server may stall."""
        if blocking:
            return None, deadline
        try_bound = _try_bound(self._client)
        return try_bound, _clock.monotonic() + try_bound

    def _missed(self, miss: _spec.Miss, try_bound: float | None, token: str) -> None:
        """An acquisition ended without the primitive: noted for `LockTimeout`'s message; a
        try the server did not answer within its bound raises `ServerUnavailable`."""
        _last_miss.set(miss)
        if try_bound is not None and miss.unanswered:
            raise ServerUnavailable(
                self._name,
                f"Redis did not answer a try (blocking=False) within {try_bound:g} s "
                "(the client's socket_timeout, or "
                f"{_acquire.TRY_BOUND:g} s without one)",
                token=token,
            )

    async def release(self) -> None:
        """Release the current task's holding.

        Raises `LockNotOwned` if the task holds nothing (a holding of a task that has
        finished is adopted), and `LockLost` if the lease had been lost meanwhile.
        """
        await self._release(self._find_holding(), None)

    async def _release(self, holding: Holding, loop: asyncio.AbstractEventLoop | None) -> None:
        """`release()` of `holding`, on `loop` (the running one, if the caller has it)."""
        self._take_holding(holding)
        if holding.cap is not None:
            self._uncap(holding)
        if _telemetry.recorder is not None:
            _telemetry.on_release(self._spec, holding.token)
        in_cohort = self._local_handoff and is_cohort_token(holding.token)
        if holding.is_lost:
            lost = open_context(self._client)  # None: its client was closed since
            if lost is not None:
                if in_cohort:
                    self._leave_alone(lost, holding)  # (a cohort's lease is the cohort's to drop)
                else:
                    self._stop_renewal(lost, holding)
                # Best-effort: the key is gone or someone else's; this only tidies the
                # queue, and never delays the report (a link that stalled may be why).
                until = _clock.monotonic() + _release.GRACE
                await _release.withdraw(
                    lost, self._spec, holding.token, self._ttl_ms, until, call=holding.give_back
                )
            holding.released()
            raise self._lost_error(holding)
        context = context_for(self._client, loop)
        cohort = self._leave_alone(context, holding) if in_cohort else None
        if cohort is not None and cohort.pass_on(self, holding):
            return  # handed to the next local task: no call to Redis
        with map_redis_errors(self._name):
            # Waited for no longer than the lease is known valid: past that, whether it
            # was released or lost cannot be told, and the report must not wait.
            valid_until = None if holding.lease is None else holding.lease.valid_until
            try:
                if cohort is not None:
                    answer = await cohort.release(self, holding, valid_until)
                else:
                    try:
                        answer = await self._release_surely(context, holding)
                    finally:
                        holding.released()
            except asyncio.CancelledError:
                # The keeper reports no loss of a lease being released: a release cancelled
                # after its validity ended records the loss itself (else none would).
                lease = holding.lease
                if lease is not None and lease.remaining <= 0 and not holding.is_lost:
                    self._lost_at_release(
                        holding, "its validity ended before its release (cancelled) was answered"
                    )
                raise
            if isinstance(answer, _release.Unanswered):
                raise self._lost_at_release(
                    holding,
                    "Redis did not answer its release before the lease's validity ended "
                    "(the release goes on in the background)",
                )
            held = answer
        if held is None:
            # The first call's reply was lost and the retry found it released: that was the
            # first call, unless the lease had ended, which its validity rules out.
            held = holding.lease is None or holding.lease.remaining > 0
        if not held:
            raise self._lost_at_release(holding, "it was no longer held when released")

    def _lost_at_release(self, holding: Holding, reason: str) -> LockLost:
        """The release found `holding`'s lease lost: recorded, and the error to raise."""
        holding.mark_lost(reason)
        self._spec.counters.leases_lost += 1
        if _telemetry.recorder is not None:
            _telemetry.on_lease_lost(self._spec, holding.token)
        return self._lost_error(holding)

    # -- hand-over to another process --------------------------------------------------

    def detach(self) -> LockHandle:
        """Let go of the current task's holding here without releasing it, for another
        process to `adopt()`: renewal here stops, so adopt it within the `ttl`.

        Raises `LockNotOwned` if the task holds nothing, and `LockLost` if the lease had
        been lost. A local hand-off holding takes its cohort's lease with it: this
        process's other tasks then wait for it through Redis.
        """
        self._check_handover()
        holding = self._find_holding()
        if holding.is_lost:
            raise self._lost_error(holding)
        del self._holdings[holding.task]
        self._uncap(holding)
        context = context_for(self._client)
        if self._local_handoff and is_cohort_token(holding.token):
            cohort = self._leave_alone(context, holding)
            if cohort is not None:
                cohort.detach(holding)  # drops the lease from the keeper if it is the cohort's
        self._stop_renewal(context, holding)
        holding.released()  # (its lease, renewed here no more, lets go of it)
        if _telemetry.recorder is not None:
            _telemetry.on_release(self._spec, holding.token)  # it ends here, as far as we know
        return LockHandle(self._handle_kind, self._name, holding.token, holding.fence, self._prefix)

    async def adopt(self, handle: LockHandle) -> None:
        """Take over a holding another process `detach()`ed: the current task holds it now,
        renewed and released here, with the handle's `fencing_token`.

        The server hands it to a new token of this process in one script, so a handle is
        adopted once only, across every process. Raises `LockLost` at once if that holding
        has ended (or its handle was adopted already): nothing is acquired anew, nothing
        queued. Raises `LockError` for a handle of another kind, name or prefix.
        """
        if not isinstance(handle, LockHandle):
            raise TypeError(f"adopt() takes a LockHandle, not {type(handle).__name__}")
        self._check_handover()
        mine = (self._handle_kind, self._name, self._prefix)
        if (handle.kind, handle.name, handle.prefix) != mine:
            raise LockError(
                self._name,
                f"the handle is of {handle.kind} {handle.name!r} (prefix {handle.prefix!r}), "
                f"not of this {self._handle_kind} (prefix {self._prefix!r})",
            )
        task = current_task()
        if task in self._holdings or self._held_elsewhere(task) is not None:
            raise LockReentry(self._name, "the current task already holds it")
        context = context_for(self._client)
        token = _clock.token_hex(16)
        script, keys = self._adopt_call()
        sent_at = _clock.monotonic()
        in_flight = _release.InFlight(
            context.run(script, keys, (handle.token, token, self._ttl_ms)), context
        )
        try:
            with map_redis_errors(self._name):
                taken = await in_flight.reply()
        except BaseException:
            # The script may have run: give back what the new token may hold (after its
            # reply, if it is still on its way), awaited up to CLEANUP_BOUND, then in the
            # background.
            release = functools.partial(self._release_call, context, token)
            await _release.withdraw(
                context, self._spec, token, self._ttl_ms, None, release, after=in_flight.after()
            )
            raise
        if not int(taken):
            raise LockLost(
                self._name,
                "the handed-over holding has ended, or its handle was adopted already "
                "(a handle is adopted once)",
                token=handle.token,
            )
        self._hold(context, task, _spec.Grant(token, handle.fencing_token, sent_at))

    def _check_handover(self) -> None:
        if not self._handle_kind:
            raise LockError(self._name, f"a {type(self).__name__} cannot be handed over")

    # -- the current task's holding ----------------------------------------------------

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the current task's holding (None if it holds nothing).

        Strictly increasing per name across all holders: give it to the storage you
        protect and have that reject writes carrying an older token.
        """
        holding = self._current()
        return None if holding is None else holding.fence

    @property
    def lost(self) -> asyncio.Event:
        """An event set when the current task's lease is lost (LockNotOwned if none held)."""
        holding = self._current()
        if holding is None:
            raise LockNotOwned(self._name, "the current task does not hold it")
        return holding.lost

    def held(self) -> bool:
        """True if the current task holds this instance (a local check, no Redis call)."""
        return self._current() is not None

    def statistics(self) -> LockStatistics:
        """A cheap local snapshot; see `inspect()` for what the server says."""
        holding = self._current()
        lease = None if holding is None else holding.lease
        counters = self._spec.counters
        return LockStatistics(
            name=self._name,
            held_here=len(self._holdings),
            tasks_waiting=self._waiting,
            lease_remaining=None if lease is None or lease.lost else lease.remaining,
            lost=holding is not None and holding.is_lost,
            acquisitions=counters.acquisitions,
            timeouts=counters.timeouts,
            leases_lost=counters.leases_lost,
            handoffs=counters.handoffs,
        )

    # -- async with and decorator ------------------------------------------------------

    async def __aenter__(self) -> Self:
        _last_miss.set(None)
        task = current_task()
        try:
            acquired = await self._acquisition(task, True, self._timeout)
        except BaseException:
            del task  # (a failed acquisition lets go of its task: above)
            raise
        if not acquired:
            del task
            assert self._timeout is not None
            miss = _last_miss.get()
            raise LockTimeout(self._name, self._timeout, None if miss is None else miss.situation())
        self._enter_body(task)
        return self

    def _acquisition(
        self, task: asyncio.Task[Any], blocking: bool, timeout: float | None
    ) -> Awaitable[bool]:
        """`acquire(blocking, timeout)` by `task`, the current one (`async with`, the web
        integrations): without a telemetry recorder, one coroutine less per acquisition."""
        if _telemetry.recorder is not None:
            return self.acquire(blocking, timeout)
        return self._counted_acquire(blocking, timeout, task)

    def _enter_body(self, task: asyncio.Task[Any] | None = None) -> Holding:
        """The current task's holding enters its `async with` body: a loss cancels the body,
        and `__aexit__` takes that cancellation back (the web integrations call it after
        their own `acquire()`, a refusal costing no `LockTimeout`). Returns the holding."""
        holding = self._holdings[current_task() if task is None else task]
        holding.body = True
        if holding.is_lost:  # lost before the body even started
            holding.cancel_body()
        return holding

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = asyncio.current_task()
        holding = self._holdings.get(task)  # type: ignore[arg-type]  # (None: not found)
        if holding is None:
            return  # released inside the body already
        try:  # (the release takes back a cancellation that a loss made: `end_body`)
            await self._release(holding, holding.task.get_loop())
        except LockLost as lost:
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                raise lost from exc
            raise lost from None

    def __call__(self, func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        """Use the instance as a decorator: each call of `func` runs holding it."""
        if not inspect.iscoroutinefunction(func):
            # A plain `def` would come back as a coroutine function, its calls
            # never awaited: say so now.
            what = getattr(func, "__qualname__", type(func).__name__)
            raise TypeError(
                f"{type(self).__name__} decorates coroutine functions (`async def`), "
                f"and {what} is not one: write `async def {what.rpartition('.')[2]}`, "
                f"or hold the lock with `async with` around the call"
            )

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self:
                return await func(*args, **kwargs)

        return locked_call


def _try_bound(client: AnyRedis) -> float:
    """How long one try (blocking=False) waits for the server: the client's socket_timeout
    when it has one, else `_acquire.TRY_BOUND`."""
    timeout = _adapter.connection_options(client).get("socket_timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    return _acquire.TRY_BOUND


# -- local hand-off ---------------------------------------------------------------------
#
# Local hand-off (lock cohorting): a process that holds a lease passes it among its own
# waiting tasks, up to a limit, before it goes back to the global FIFO queue.
#
# After Dice, Marathe and Shavit, "Lock Cohorting" (PPoPP 2012). The tasks of one process
# that want one lock with the same settings form a cohort. At most one of them (the
# contender) acquires through Redis at a time; the others wait here, in FIFO order, without
# any Redis state. When the cohort holds the lease, a release hands it to the next local
# task without a round trip, up to `local_handoff` times in a row, never after a holding of
# `CHAIN_BOUND` or more, and for less than `CHAIN_BOUND` once a waiter elsewhere may wait;
# then the release script is asked to give it to the global queue, or, when nobody waits
# there, to let the cohort keep it. A waiter that queues behind the cohort's token is
# announced to it (the acquire script publishes the token on the channel's "queued" twin,
# which the cohort subscribes to through the notifier from its first local waiter on), and
# `CHAIN_BOUND` counts from that announcement's arrival. Where it could miss one, it counts
# from the chain's start (the lease's grant or `keep`), as if someone waited all along: until
# its subscription is confirmed, while the link is down or after it re-synced, and after a
# grant that others may be queued behind (any but a first call's) or a call answered after an
# announcement or re-sync. So a waiter in another process waits beyond strict FIFO at most
# `local_handoff` local holdings and at most `CHAIN_BOUND` of them after its announcement
# arrives (plus the holding in progress when the bound passes).
#
# Fences stay strictly increasing across all holders: a cohort's token ends in "+<local_handoff+1>"
# and every grant of it reserves that many consecutive fences (see `_prelude.lua`); local
# hand-offs use the rest of the block, and any later grant is above it.

_Key = tuple[bytes, int, int]  # (channel, ttl_ms, local_handoff)


class _Turn(enum.Enum):
    """What a waiting task of the cohort is told."""

    HOLD = "hold"  # it holds the lock now, handed on locally
    CONTEND = "contend"  # it is the cohort's contender now: acquire through Redis


class _LocalWaiter:
    __slots__ = ("future", "lock", "task")

    def __init__(self, lock: LeasedLock, task: asyncio.Task[Any]) -> None:
        self.lock = lock
        self.task = task
        self.future: asyncio.Future[_Turn] = task.get_loop().create_future()


# A task of this process acquiring (since 0.0) or holding (since when it got it) a lock alone,
# no other task of the process wanting it: (its lock, the task, since). It stands in for a
# cohort, and a second task that comes makes the cohort, which takes it over.
_Solo = tuple[LeasedLock, asyncio.Task[Any], float]


def cohort_token(token: str, local_handoff: int) -> str:
    """The token a cohort acquires with: a grant of it reserves `local_handoff + 1` fences."""
    return f"{token}+{local_handoff + 1}"


def is_cohort_token(token: str) -> bool:
    """True for a token `cohort_token` made (a cohort's lease, shared by its holdings)."""
    return "+" in token


class Cohort:
    """The tasks of one process (one client, one loop) that want one lock with one setting
    of `ttl` and `local_handoff`."""

    def __init__(self, context: ClientContext, spec: _spec.Spec, ttl_ms: int, local_handoff: int):
        self._context = context
        self._cohorts: dict[_Key, Cohort | _Solo] = context.cohorts  # where it is kept in use
        self._key = (spec.channel, ttl_ms, local_handoff)
        self._spec = spec
        self._ttl_ms = ttl_ms
        self.local_handoff = local_handoff
        self._queue: deque[_LocalWaiter] = deque()
        self._contending = False  # a task is acquiring through Redis for the cohort
        self.token: str | None = None  # the cohort's lease on the server, while it has one
        self._lease: Lease | None = None
        self._next_fence = 0
        self.passes = 0  # local hand-offs since the lease last came from (or stayed with) Redis
        self._chain_start = 0.0  # when it last came from (or stayed with) Redis
        # Since when a waiter elsewhere may wait behind it: None while nobody does and one
        # that queues would be announced to it (`_heard`); else that announcement's arrival,
        # or the chain's start (not listening yet, a re-sync, a grant others may wait behind).
        self._waited_since: float | None = 0.0
        self._news = 0  # announcements and re-syncs heard (none between call and answer?)
        self._queued = spec.channel + b":queued"  # the acquire script's `tell_cohort`
        self._listening = False  # with a reference on the `_queued` subscription
        self._held_since = 0.0  # when the current holder got it
        self._holder: tuple[LeasedLock, Holding] | None = None

    @property
    def idle(self) -> bool:
        return self.token is None and not self._contending and not self._queue

    # -- acquire ---------------------------------------------------------------------------

    async def acquire(
        self, lock: LeasedLock, task: asyncio.Task[Any], blocking: bool, deadline: float | None
    ) -> bool:
        """Acquire for `task`: through Redis if the cohort is idle, else after the local
        tasks ahead of it (or as the next contender, if the lease leaves the process)."""
        waiter: _LocalWaiter | None = None
        try:
            if self.idle:
                return await self._contend(lock, task, blocking, deadline)
            if not blocking:
                return False  # busy here: held by, or being acquired for, another local task
            waiter = _LocalWaiter(lock, task)
            self._queue.append(waiter)
            if not self._listening:
                self._listen()
            try:
                if deadline is None:  # cancelling the task cancels its turn with it
                    await waiter.future
                else:
                    timeout = max(0.0, deadline - _clock.monotonic())
                    await asyncio.wait((waiter.future,), timeout=timeout)
            except BaseException:
                await self._abandon(waiter)
                raise
            if not waiter.future.done():
                await self._abandon(waiter)
                return False
            if waiter.future.result() is _Turn.HOLD:
                return True
            return await self._contend(lock, task, True, deadline)
        except BaseException:
            del task, waiter  # (a failed acquisition lets go of its task: above)
            raise
        finally:
            self._retire_if_idle()

    async def _abandon(self, waiter: _LocalWaiter) -> None:
        """A waiting task gives up (timeout, cancellation): whatever it was handed meanwhile
        goes on to the next task."""
        if waiter.future.cancel() or waiter.future.cancelled():
            if waiter in self._queue:  # (a turn cancelled with its task may be gone: skipped)
                self._queue.remove(waiter)
            return
        if waiter.future.result() is _Turn.CONTEND:
            self._contending = False
            self._promote()
            return
        holding = waiter.lock._holdings.pop(waiter.task, None)
        if holding is not None:
            await _release.shielded(
                lambda: self.release(waiter.lock, holding), _release.CLEANUP_BOUND
            )

    async def _contend(
        self,
        lock: LeasedLock,
        task: asyncio.Task[Any],
        blocking: bool,
        deadline: float | None,
    ) -> bool:
        self._contending = True  # already, for a task promoted to it
        if not self._listening and self._context.notifier.watching(self._queued):
            self._listen()  # a name contended here lately: its subscription lingers
        # (None: not watching, a waiter queueing elsewhere meanwhile may go unannounced)
        news = self._news if self._watching() else None
        try:
            grant = await lock._acquire_grant(self._context, self.local_handoff, blocking, deadline)
        except BaseException:
            self._contended(lock, task, None, news)
            del task  # (a failed acquisition lets go of its task: above)
            raise
        self._contended(lock, task, grant, news)
        return grant is not None

    def _contended(
        self,
        lock: LeasedLock,
        task: asyncio.Task[Any],
        grant: _spec.Grant | None,
        news: int | None,
    ) -> None:
        """The contender's acquisition through Redis ended: `task` holds the cohort's lease
        now, or (no `grant`) the next waiting task contends. `news`: the announcements heard
        when the call began, if the cohort was watching then (see `_chain_quiet`)."""
        self._contending = False
        if grant is None:
            self._promote()
            return
        self.token = grant.token
        self._next_fence = grant.fence + 1
        self.passes = 0
        self._chain_start = _clock.monotonic()
        self._chain_quiet(grant.alone and news == self._news, self._chain_start)
        lease = lock._new_lease(grant, self._owner(grant.token))
        self._lease = lease
        self._context.keeper.hold(lease)
        self._give(lock, task, grant.fence)

    def contended(
        self, lock: LeasedLock, task: asyncio.Task[Any], grant: _spec.Grant | None
    ) -> None:
        """The acquisition of a task that was alone when it began (`take_over`) ended (not
        watched: its chain counts as waited behind from its start)."""
        self._contended(lock, task, grant, None)
        self._retire_if_idle()

    def take_over(self, solo: _Solo) -> None:
        """Made as a second task comes: the task that was alone is the cohort's contender if
        it still acquires, else its holder (its lease the cohort's from now on, the chain
        started when it got it); a holding lost meanwhile is left to its release."""
        lock, task, since = solo
        holding = lock._holdings.get(task)
        if holding is None:
            self._contending = True
            return
        lease = holding.lease
        if holding.is_lost or lease is None:
            return
        self.token, self._lease = holding.token, lease
        self._next_fence = holding.fence + 1
        self.passes = 0
        self._chain_start = self._held_since = since
        self._chain_quiet(False, since)  # (not watched while it was alone)
        self._holder = (lock, holding)
        lease.owned_by(self._owner(holding.token))

    def _owner(self, token: str) -> Callbacks:
        """The cohort as the owner of its lease of `token`: told of its loss, and how it is
        given back at the loop's end."""
        give_back = functools.partial(
            _release.release, self._context, self._spec, token, self._ttl_ms
        )
        return Callbacks(self._lost, give_back)

    def _give(self, lock: LeasedLock, task: asyncio.Task[Any], fence: int) -> None:
        assert self.token is not None and self._lease is not None
        holding = lock._install(task, self.token, fence, self._lease)
        self._holder = (lock, holding)
        self._held_since = _clock.monotonic()

    def _promote(self) -> None:
        """Make the first waiting task the contender, if nobody is contending or holding."""
        if self._contending or self.token is not None:
            return
        waiter = self._next_waiter()
        if waiter is not None:
            self._contending = True
            waiter.future.set_result(_Turn.CONTEND)

    def _next_waiter(self) -> _LocalWaiter | None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.future.done():
                return waiter
        return None

    # -- release ---------------------------------------------------------------------------

    async def release(
        self, lock: LeasedLock, holding: Holding, until: float | None = None
    ) -> bool | _release.Unanswered | None:
        """Release `holding` (already taken from `lock`): hand it to the next local task, or
        give the lease back through Redis, as every release (`_release.release_until`).
        Returns True when it was held (False if not, None if unsure: see
        `_release.release`); UNANSWERED when Redis did not answer by `until` (by default
        the lease's validity; the call then goes on in the background)."""
        try:
            if self.pass_on(lock, holding):
                return True
            if self._holder is not None and self._holder[1] is holding:
                self._holder = None
            lease = self._lease
            if holding.token != self.token or lease is None:
                # The cohort let go of it already (lost): only tidy up on the server.
                return await _release.release(
                    self._context, self._spec, holding.token, self._ttl_ms
                )
            waiter = self._next_waiter()  # (those who gave up are skipped)
            if waiter is not None:
                self._queue.appendleft(waiter)
            keep = waiter is not None and lease.remaining > 0
            return await self._give_back(lease, lock._spec, until, keep)
        finally:
            self._retire_if_idle()

    def pass_on(self, lock: LeasedLock, holding: Holding) -> bool:
        """Hand `holding` (already taken from `lock`) to the next local task, without a
        round trip, if one waits and one more pass is allowed (`_may_pass`): True if it
        was. A lease whose validity ended unrenewed (a stalled loop) is not passed on (the
        server may have ended it): its release tells the holder."""
        lease = self._lease
        if holding.token != self.token or lease is None or not self._queue:
            return False
        if lease.remaining <= 0 or not self._may_pass():
            return False
        waiter = self._next_waiter()
        if waiter is None:  # (all of them gave up)
            return False
        self._pass(waiter, lock._spec)
        return True

    def _may_pass(self) -> bool:
        """Whether one more local pass is allowed: by count (`local_handoff`); while nobody
        waits elsewhere (none announced, and one would be), whatever the holdings last; else
        less than `CHAIN_BOUND` after a waiter elsewhere may have queued (`_waited_since`;
        the chain's start while it is not watching), and not after a holding of
        `CHAIN_BOUND` or more."""
        if self.passes >= self.local_handoff:
            return False
        since = self._waited_since
        if since is None:
            if self._watching():
                return True
            since = self._chain_start
        now = _clock.monotonic()
        return now - since < CHAIN_BOUND and now - self._held_since < CHAIN_BOUND

    # -- told of waiters elsewhere -----------------------------------------------------------

    def _listen(self) -> None:
        """Be told when a waiter queues elsewhere behind the cohort's token (the acquire
        script's `tell_cohort`), from its first local waiter on (an uncontended cycle
        subscribes to nothing); the subscription is the notifier's, as a waiter's."""
        notifier = self._context.notifier
        if not notifier.retain_soon(self._queued):
            return  # no link for it yet: tried again at the next local waiter
        self._listening = True
        notifier.listen(self._queued, self._heard)

    def _unlisten(self) -> None:
        self._listening = False
        notifier = self._context.notifier
        notifier.unlisten(self._queued, self._heard)
        notifier.release(self._queued)

    def _watching(self) -> bool:
        """Whether a waiter queueing elsewhere now would be announced to it."""
        return self._listening and self._context.notifier.watching(self._queued)

    def _heard(self, hint: Hint, payload: bytes) -> None:
        """A waiter queued elsewhere behind the token `payload` (MESSAGE), or announcements
        may have been lost (RESYNC: the link was lost, or re-subscribed)."""
        self._news += 1
        if self._waited_since is not None:
            return
        if hint is not Hint.MESSAGE:
            self._waited_since = self._chain_start
        elif self.token is not None and payload == self.token.encode():
            self._waited_since = _clock.monotonic()

    def _chain_quiet(self, quiet: bool, start: float) -> None:
        """A chain starts (a grant or a `keep`): `quiet` when nobody waited elsewhere at its
        start and a later arrival will be announced, else counted as waiting since `start`."""
        self._waited_since = None if quiet else start

    def detach(self, holding: Holding) -> None:
        """`holding` leaves the process (`detach()`): the cohort lets go of its lease
        without releasing it (the handle's adopter renews it), and its waiting tasks go on
        through Redis."""
        if self._holder is not None and self._holder[1] is holding:
            self._holder = None
        if holding.token == self.token:
            self._let_go()
            self._promote()
        self._retire_if_idle()

    def _pass(self, waiter: _LocalWaiter, releaser: _spec.Spec) -> None:
        fence, self._next_fence = self._next_fence, self._next_fence + 1
        self.passes += 1
        _release.handed_off(releaser, 1, local=True)
        self._give(waiter.lock, waiter.task, fence)
        waiter.future.set_result(_Turn.HOLD)

    async def _give_back(
        self, lease: Lease, releaser: _spec.Spec, until: float | None, keep: bool
    ) -> bool | _release.Unanswered | None:
        """Give the lease back through the release every holder uses (the client's release
        gate, the lease renewed until the answer). `keep` (local tasks still wait, and no local
        pass is allowed): the release script gives it to the global queue, or, when nobody waits
        there, lets the cohort keep it with a fresh lease and fence block (one round trip
        either way); a release cut short gives it back."""
        token = self.token
        assert token is not None
        context, spec = self._context, self._spec
        self.token, self._lease = None, None  # the release's now (it drops it from the keeper)
        # (sent at, next fence, whether it was watching then) if the script kept it
        kept: list[tuple[float, int, bool]] = []
        news = self._news

        async def keep_or_return() -> bool | None:
            watched = self._watching()
            sent_at = _clock.monotonic()
            written: list[float] = []
            raw, unsure = await _release.release_reply(
                context, spec, token, self._ttl_ms, "keep", sent=written.append
            )
            reply = _release.ReleaseReply.decode(raw)
            sent_at = written[0] if written else sent_at
            status = reply.status
            if status is _release.Released.KEPT:
                kept.append((sent_at, reply.fence, watched))
                return True
            _release.wake_granted(context, spec, reply.grants, sent_at)
            _release.handed_off(releaser, len(reply.grants))
            if unsure and status is _release.Released.NOT_HELD:
                return None
            return status is _release.Released.HELD

        try:
            answer = await _release.release_until(
                context,
                spec,
                token,
                self._ttl_ms,
                lease.valid_until if until is None else until,
                lease=lease,
                first=keep_or_return if keep else None,
            )
        except BaseException:
            kept.clear()  # (none: a call cut short was given back by its clean-up)
            raise
        finally:
            if not kept:
                self._promote()
        if kept:
            sent_at, fence, watched = kept[0]
            self._keep(token, lease, releaser, sent_at, fence)
            self._chain_quiet(watched and news == self._news, sent_at)
        return answer

    def _keep(
        self, token: str, lease: Lease, releaser: _spec.Spec, sent_at: float, fence: int
    ) -> None:
        """The release script let the cohort keep its lease (nobody queued on the server):
        the next local task holds it, the first of a new block (that pass came from Redis)."""
        waiter = self._next_waiter() if self.token is None and not self._contending else None
        if waiter is None:
            # The waiters gave up while the call was in flight (or another contends now):
            # nobody to keep it for.
            self._promote()
            _release.background_release(self._context, self._spec, token, self._ttl_ms)
            return
        self.token, self._lease, self._next_fence = token, lease, fence
        lease.kept(sent_at)
        self._context.keeper.hold(lease)
        self._pass(waiter, releaser)
        self.passes = 0
        self._chain_start = sent_at

    def _retire_if_idle(self) -> None:
        """Forget this cohort once nobody uses it (names may be many and short-lived)."""
        if not self.idle:
            return
        if self._listening:
            self._unlisten()
        if self._cohorts.get(self._key) is self:
            del self._cohorts[self._key]

    def _let_go(self) -> None:
        """The cohort no longer holds the lease (released, handed on, or lost)."""
        if self._lease is not None:
            self._context.keeper.drop(self._lease)
        self.token = None
        self._lease = None

    def _lost(self, reason: str) -> None:
        """The keeper lost the cohort's lease: its current local holder is told as any
        holder would be, and the waiting tasks go on through Redis."""
        holder, self._holder = self._holder, None
        if self.token is not None:
            _release.give_back_lost(self._context, self._spec, self.token, self._ttl_ms)
        self._let_go()
        if holder is not None:
            lock, holding = holder
            lock._lease_lost(holding, reason)
        self._promote()
        self._retire_if_idle()
