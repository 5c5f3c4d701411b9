"""Task-owned holdings with leases: the part of a lock's behaviour every primitive shares.

An instance may be shared by many tasks, like `asyncio.Lock`: each acquisition is its own
holding (own token, own fence, own lease) owned by the task that made it. A subclass
supplies the `Spec` (its keys and scripts); this class does acquire/release/`async with`,
lease-loss reporting and the decorator form.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, Self, TypeVar

import anyio

from . import _acquire, _awaiting, _confirm, _release, _spec, _telemetry, _withdraw
from ._clients import AnyRedis, ensure_async_client, is_cluster
from ._cohort import cohort_for, cohort_token
from ._context import ClientContext, context_for
from ._errors import (
    LockError,
    LockLost,
    LockNotOwned,
    LockReentry,
    LockTimeout,
    NotReplicated,
    ServerUnavailable,
    map_redis_errors,
)
from ._handle import LockHandle
from ._keys import DEFAULT_PREFIX, validate_name, validate_prefix
from ._leases import Lease
from ._scripts import Script

__all__ = ["DEFAULT_TTL", "Holding", "LeasedLock", "LockStatistics", "validate_timeout"]

log = logging.getLogger("aiolocks")

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TTL = 30.0
DEFAULT_REPLICA_TIMEOUT = 1.0

LostCallback = Callable[[LockLost], object]

# Why the current task's last acquisition through Redis failed, for `LockTimeout`'s message
# (a context variable: `acquire()` runs in the caller's task, as does `__aenter__`).
_last_miss: contextvars.ContextVar[_spec.Miss | None] = contextvars.ContextVar(
    "aiolocks_last_miss", default=None
)


# The longest lease: its end in server milliseconds must stay exact in Lua's numbers.
MAX_TTL = 1e9


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


def _validate_replicas(replicas: object, client: AnyRedis) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, not {type(replicas).__name__}")
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas!r}")
    if replicas and is_cluster(client):
        # WAIT must follow the grant on the same connection, to the same node: a Cluster
        # pipeline sends a keyless WAIT to any node.
        raise ValueError("replicas= is not supported with a RedisCluster client")
    return replicas


def _validate_replica_timeout(timeout: object) -> int:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"replica_timeout must be a number of seconds, not {type(timeout).__name__}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"replica_timeout must be finite seconds > 0, got {timeout!r}")
    return max(1, round(timeout * 1000))


def _validate_ttl(ttl: object) -> float:
    seconds = _seconds(ttl, "ttl", "a number of seconds")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
    if seconds < 0.01:
        raise ValueError(f"ttl must be at least 0.01 s (renewal runs every ttl/3), got {ttl!r}")
    if seconds > MAX_TTL:
        raise ValueError(f"ttl must be at most {MAX_TTL:g} s, got {ttl!r}")
    return seconds


def _validate_max_hold(max_hold: object) -> float | None:
    if max_hold is None:
        return None
    seconds = _seconds(max_hold, "max_hold", "a number of seconds or None")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"max_hold must be a finite number of seconds > 0, got {max_hold!r}")
    return seconds


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


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease."""

    __slots__ = ("cap", "fence", "lease", "lock", "lost", "lost_reason", "task", "token")

    def __init__(self, lock: LeasedLock, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.lock = lock
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`

    # Its lease's callbacks, as methods: one object each per holding, where a partial of
    # the lock's method was three (a burst of 100,000 holdings is that many more objects
    # for every full collection of the garbage collector to go through).
    def lease_lost(self, reason: str) -> None:
        self.lock._lease_lost(self, reason)

    async def give_back(self) -> bool | None:
        return await self.lock._release_call(context_for(self.lock._client), self.token)


class LeasedLock:
    """Base of every primitive whose acquisitions are task-owned leases."""

    _kind = "lock"
    _local_handoff = 0  # > 0: tasks of this process pass the lease on (see _cohort.py)
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
        self._prefix = validate_prefix(prefix)
        self._ttl = _validate_ttl(ttl)
        self._ttl_ms = max(1, round(self._ttl * 1000))
        self._timeout = validate_timeout(timeout)
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        self._on_lost = on_lost
        self._replicas = _validate_replicas(replicas, self._client)
        self._replica_timeout_ms = _validate_replica_timeout(replica_timeout)
        self._max_hold = _validate_max_hold(max_hold)
        if self._max_hold is not None and self._local_handoff:
            # A cohort's lease outlives each local holding; capping one would end the chain.
            raise ValueError("max_hold cannot be combined with local_handoff")
        self._holdings: dict[asyncio.Task[Any], Holding] = {}
        self._scopes: dict[asyncio.Task[Any], anyio.CancelScope] = {}
        self._waiting = 0
        self._spec = self._make_spec()

    def _make_spec(self) -> _spec.Spec:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self._name

    @property
    def ttl(self) -> float:
        return self._ttl

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"<{kind} {self._name!r} ttl={self._ttl:g} held_here={len(self._holdings)}>"

    # -- acquire / release -------------------------------------------------------------

    @_telemetry.observe_acquire
    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquire for the current task; False if not blocking and busy, or on timeout.

        `timeout` bounds the whole call, Redis round trips included; `timeout=0` means
        one try, the same as `blocking=False`. Raises `LockReentry` if the current task
        already holds this instance.
        """
        timeout = validate_timeout(timeout)
        if not blocking and timeout is not None:
            raise ValueError("a timeout cannot be given with blocking=False")
        if timeout == 0:
            # A zero deadline would end the call before its one try reached Redis.
            blocking, timeout = False, None
        task = _current_task()
        held = self._holdings.get(task)
        reason = "the current task already holds it (not reentrant)"
        if held is None:
            held = self._held_elsewhere(task)
            reason = "the current task holds the other side (that would deadlock)"
        if held is not None:
            raise LockReentry(self._name, reason, token=held.token)
        context = context_for(self._client)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting += 1
        try:
            if self._local_handoff:
                cohort = cohort_for(context, self._spec, self._ttl_ms, self._local_handoff)
                return await cohort.acquire(self, task, blocking, deadline)
            grant = await self._acquire_grant(context, 0, blocking, deadline)
        finally:
            self._waiting -= 1
        if grant is None:
            return False
        self._hold(context, task, grant)
        return True

    async def _acquire_grant(
        self, context: ClientContext, bound: int, blocking: bool, deadline: float | None
    ) -> _spec.Grant | None:
        """One acquisition through Redis (replication confirmed, if asked for); `bound` > 0
        makes it a local hand-off cohort's, which reserves `bound + 1` fences."""
        token = secrets.token_hex(16)
        if bound:
            token = cohort_token(token, bound)
        try_bound, deadline = self._try_deadline(blocking, deadline)
        with map_redis_errors(self._name):
            grant = await _acquire.acquire(
                context,
                self._spec,
                token,
                self._ttl_ms,
                blocking=blocking,
                deadline=deadline,
                respec=lambda: self._spec,
            )
        if isinstance(grant, _spec.Miss):
            self._missed(grant, try_bound, token)
            return None
        if self._replicas:
            await self._confirm_replicated(context, grant)
        return grant

    def _try_deadline(
        self, blocking: bool, deadline: float | None
    ) -> tuple[float | None, float | None]:
        """(the try's bound, the deadline): one try (not blocking) waits for the server at
        most the try bound (`_try_bound`), as the server may stall."""
        if blocking:
            return None, deadline
        try_bound = _try_bound(self._client)
        return try_bound, time.monotonic() + try_bound

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

    async def _confirm_replicated(self, context: ClientContext, grant: _spec.Grant) -> None:
        """Have `replicas` replicas acknowledge the grant before it is reported; give it
        back and raise `NotReplicated` if they do not within `replica_timeout`."""
        given_back = False
        # The acquire script again (it may grant the token anew), on a pooled connection of
        # its own even with auto-pipelining: in a task that leaving does not stop, and the
        # give-back is sent after its reply (`_awaiting.unstopped`).
        confirming = _confirm.confirm(
            context, self._spec, grant.token, self._ttl_ms, self._replicas,
            self._replica_timeout_ms,
        )  # fmt: skip
        in_flight = asyncio.ensure_future(confirming)
        try:
            with map_redis_errors(self._name):
                status, acked = await asyncio.shield(in_flight)
            if status != _spec.GRANTED:
                raise LockLost(
                    self._name, "lost before its replication was confirmed", token=grant.token
                )
            if acked < self._replicas:
                given_back = True
                await _awaiting.shielded(
                    lambda: _release.release(context, self._spec, grant.token, self._ttl_ms),
                    _withdraw.CLEANUP_BOUND,
                )
                raise NotReplicated(
                    self._name,
                    f"{acked} of {self._replicas} replica(s) acknowledged the grant within "
                    f"{self._replica_timeout_ms} ms; it was given back",
                    token=grant.token,
                )
        except BaseException:
            if not given_back:
                await _withdraw.withdraw(
                    context, self._spec, grant.token, self._ttl_ms, None,
                    after=_awaiting.settled(in_flight),
                )  # fmt: skip
            raise

    def _hold(self, context: ClientContext, task: asyncio.Task[Any], grant: _spec.Grant) -> None:
        """`task` holds this instance now, by `grant`: its lease renewed, its cap armed."""
        holding = self._install(task, grant.token, grant.fence)
        holding.lease = self._new_lease(grant, holding.lease_lost)
        holding.lease.release = holding.give_back
        context.keeper.hold(holding.lease)
        self._cap(context, holding, grant.granted_at)

    def _new_lease(self, grant: _spec.Grant, on_lost: Callable[[str], None]) -> Lease:
        return Lease(
            self._spec.renew,
            self._spec.renew_keys,
            (grant.token, self._ttl_ms),
            self._ttl,
            grant.granted_at,
            on_lost,
        )

    def _install(
        self, task: asyncio.Task[Any], token: str, fence: int, lease: Lease | None = None
    ) -> Holding:
        """Record that `task` holds this instance now."""
        holding = Holding(self, task, token, fence)
        holding.lease = lease
        self._holdings[task] = holding
        return holding

    def _cap(self, context: ClientContext, holding: Holding, since: float) -> None:
        """Arm `max_hold` for `holding`, counted from `since` (monotonic)."""
        if self._max_hold is None or holding.lease is None:
            return
        delay = max(0.0, since + self._max_hold - time.monotonic())
        holding.cap = asyncio.get_running_loop().call_later(
            delay, self._max_hold_reached, context, holding
        )

    def _max_hold_reached(self, context: ClientContext, holding: Holding) -> None:
        """Stop renewing `holding` and report it lost; its lease then ends on the server by
        itself (or sooner, when the cancelled body releases it)."""
        holding.cap = None
        lease = holding.lease
        if lease is None or lease.lost or holding.lost.is_set():
            return
        self._stop_renewal(context, holding)
        lease.lost = True
        assert self._max_hold is not None
        self._lease_lost(
            holding, f"held for max_hold={self._max_hold:g} s, so its renewal was stopped"
        )

    @staticmethod
    def _uncap(holding: Holding) -> None:
        if holding.cap is not None:
            holding.cap.cancel()
            holding.cap = None

    async def release(self) -> None:
        """Release the current task's holding.

        Raises `LockNotOwned` if the task holds nothing (a holding of a task that has
        finished is adopted), and `LockLost` if the lease had been lost meanwhile.
        """
        holding = self._take_holding()
        self._uncap(holding)
        _telemetry.on_release(self._spec, holding.token)
        context = context_for(self._client)
        if holding.lost.is_set():
            if not self._local_handoff:
                self._stop_renewal(context, holding)  # a cohort's lease is the cohort's to drop
            # Best-effort: the key is gone or someone else's; this only tidies the queue, and
            # never delays the report (a link that stalled may be why the lease was lost).
            until = time.monotonic() + _withdraw.GRACE
            await _withdraw.withdraw(
                context, self._spec, holding.token, self._ttl_ms, until, call=holding.give_back
            )
            raise self._lost_error(holding)
        with map_redis_errors(self._name):
            # Waited for no longer than the lease is known valid: past that, whether it
            # was released or lost cannot be told, and the report must not wait.
            valid_until = None if holding.lease is None else holding.lease.valid_until
            if self._local_handoff:
                cohort = cohort_for(context, self._spec, self._ttl_ms, self._local_handoff)
                answer = await cohort.release(self, holding, valid_until)
            else:
                answer = await self._release_surely(context, holding)
            if isinstance(answer, _awaiting.Unanswered):
                holding.lost_reason = (
                    "Redis did not answer its release before the lease's validity ended "
                    "(the release goes on in the background)"
                )
                _telemetry.on_lease_lost(self._spec, holding.token)
                holding.lost.set()
                raise self._lost_error(holding)
            held = answer
        if held is None:
            # The first call's reply was lost and the retry found it released: that was the
            # first call, unless the lease had ended, which its validity rules out.
            held = holding.lease is None or holding.lease.remaining > 0
        if not held:
            holding.lost_reason = "it was no longer held when released"
            _telemetry.on_lease_lost(self._spec, holding.token)
            holding.lost.set()
            raise self._lost_error(holding)

    # -- hand-over to another process --------------------------------------------------

    def detach(self) -> LockHandle:
        """Let go of the current task's holding here without releasing it, for another
        process to `adopt()`: renewal here stops, so adopt it within the `ttl`.

        Raises `LockNotOwned` if the task holds nothing, `LockLost` if the lease had been
        lost, and `LockError` for a `local_handoff` holding (its lease is the process's).
        """
        self._check_handover()
        holding = self._find_holding()
        if holding.lost.is_set():
            raise self._lost_error(holding)
        del self._holdings[holding.task]
        self._uncap(holding)
        context = context_for(self._client)
        self._stop_renewal(context, holding)
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
        task = _current_task()
        if task in self._holdings or self._held_elsewhere(task) is not None:
            raise LockReentry(self._name, "the current task already holds it")
        context = context_for(self._client)
        token = secrets.token_hex(16)
        script, keys = self._adopt_call()
        sent_at = time.monotonic()
        pending = context.run(script, keys, (handle.token, token, self._ttl_ms))
        in_flight = _awaiting.unstopped(context, pending)  # no auto-pipeline: see there
        try:
            with map_redis_errors(self._name):
                taken = await (pending if in_flight is None else asyncio.shield(in_flight))
        except BaseException:
            # The script may have run: give back what the new token may hold (after its
            # reply, if it is still on its way), awaited up to CLEANUP_BOUND, then in the
            # background.
            release = functools.partial(self._release_call, context, token)
            after = None if in_flight is None else _awaiting.settled(in_flight)
            await _withdraw.withdraw(
                context, self._spec, token, self._ttl_ms, None, release, after=after
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
        if self._local_handoff:
            raise LockError(
                self._name, "a local_handoff instance cannot hand a holding over: its lease "
                "is shared by this process's tasks",
            )  # fmt: skip

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        """The script (and its keys) that moves a holding to a new token, for `adopt()`."""
        raise NotImplementedError

    def _stop_renewal(self, context: ClientContext, holding: Holding) -> None:
        """Take `holding`'s lease(s) out of the keeper (released, detached or capped)."""
        if holding.lease is not None:
            context.keeper.drop(holding.lease)

    async def _release_call(self, context: ClientContext, token: str) -> bool | None:
        """Run the release script(s) for `token` once (see `_release.release`)."""
        return await _release.release(context, self._spec, token, self._ttl_ms)

    async def _release_surely(
        self, context: ClientContext, holding: Holding
    ) -> bool | _awaiting.Unanswered | None:
        """`_release_call` for `holding`, completed even if the caller is cancelled
        meanwhile; its lease is renewed until the release is answered, which is waited for
        while the lease is known valid (`Unanswered` past it, the release going on in the
        background)."""
        if holding.lease is None:
            self._stop_renewal(context, holding)
            return await _withdraw.release_surely(context, self._spec, holding.token, self._ttl_ms)
        lease = holding.lease
        return await _withdraw.release_until(
            context, self._spec, holding.token, self._ttl_ms, lease.valid_until, lease=lease
        )

    def _held_elsewhere(self, task: asyncio.Task[Any]) -> Holding | None:
        """A holding of `task` that makes acquiring this one a self-deadlock (e.g. the other
        side of a read-write lock); none by default."""
        return None

    def _take_holding(self) -> Holding:
        holding = self._find_holding()
        del self._holdings[holding.task]
        return holding

    def _find_holding(self) -> Holding:
        """The current task's holding, else one of a task that has finished."""
        task = _current_task()
        holding = self._holdings.get(task)
        if holding is not None:
            return holding
        for owner, held in self._holdings.items():
            if owner.done():  # e.g. acquired inside asyncio.wait_for's own task
                return held
        raise LockNotOwned(self._name, "the current task does not hold it")

    def _lost_error(self, holding: Holding) -> LockLost:
        return LockLost(self._name, f"lease lost: {holding.lost_reason}", token=holding.token)

    def _lease_lost(self, holding: Holding, reason: str) -> None:
        holding.lost_reason = reason
        _telemetry.on_lease_lost(self._spec, holding.token)
        holding.lost.set()
        scope = self._scopes.get(holding.task)
        if scope is not None and self._holdings.get(holding.task) is holding:
            scope.cancel()
        if self._on_lost is not None:
            try:
                self._on_lost(self._lost_error(holding))
            except Exception:
                log.exception("aiolocks: on_lost callback of %r failed", self._name)

    # -- the current task's holding ----------------------------------------------------

    def _current(self) -> Holding | None:
        task = asyncio.current_task()
        return None if task is None else self._holdings.get(task)

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
            lost=holding is not None and holding.lost.is_set(),
            acquisitions=counters.acquisitions,
            timeouts=counters.timeouts,
            leases_lost=counters.leases_lost,
            handoffs=counters.handoffs,
        )

    # -- async with and decorator ------------------------------------------------------

    async def __aenter__(self) -> Self:
        _last_miss.set(None)
        if not await self.acquire(timeout=self._timeout):
            assert self._timeout is not None
            miss = _last_miss.get()
            raise LockTimeout(self._name, self._timeout, None if miss is None else miss.situation())
        task = _current_task()
        scope = anyio.CancelScope()
        scope.__enter__()
        self._scopes[task] = scope
        holding = self._holdings[task]
        if holding.lost.is_set():  # lost before the body even started
            scope.cancel()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = _current_task()
        scope = self._scopes.pop(task, None)
        if scope is not None:
            scope.__exit__(exc_type, exc, tb)  # swallows only its own cancellation
        if task not in self._holdings:
            return  # released inside the body already
        try:
            await self.release()
        except LockLost as lost:
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                raise lost from exc
            raise lost from None

    def __call__(self, func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        """Use the instance as a decorator: each call of `func` runs holding it."""

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self:
                return await func(*args, **kwargs)

        return locked_call


def _try_bound(client: AnyRedis) -> float:
    """How long one try (blocking=False) waits for the server: the client's socket_timeout
    when it has one, else `_acquire.TRY_BOUND`."""
    pool = getattr(client, "connection_pool", None)
    options = getattr(pool, "connection_kwargs", None) or getattr(client, "connection_kwargs", {})
    timeout = options.get("socket_timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    return _acquire.TRY_BOUND


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("aiolocks must be used from inside an asyncio task")
    return task
