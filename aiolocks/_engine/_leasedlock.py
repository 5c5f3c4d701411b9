"""LeasedLock: the base of every primitive whose acquisitions are task-owned leases.

What a user calls on a mutex, a semaphore or a side of a read-write lock: `acquire()` /
`release()`, `async with`, the decorator form, `detach()` / `adopt()`, the current task's
`fencing_token`, `lost` and `statistics()`. A subclass supplies the `Spec` (its keys and
scripts); the state and hooks underneath are `LockCore`'s (`_lockcore.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import secrets
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import ParamSpec, Self, TypeVar

from .._base import _spec, _telemetry
from .._base._clients import AnyRedis
from .._base._errors import (
    LockLost,
    LockNotOwned,
    LockReentry,
    LockTimeout,
    ServerUnavailable,
    map_redis_errors,
)
from .._base._handle import LockHandle
from .._base._query import AsyncWithOnly
from . import _acquire, _handover, _release
from ._cohort import cohort_for, cohort_token
from ._context import ClientContext, context_for
from ._holding import Holding, current_task
from ._lockcore import LockCore
from ._replicas import confirm_replicated
from ._settings import validate_timeout
from ._statistics import LockStatistics, snapshot

__all__ = ["LeasedLock"]

P = ParamSpec("P")
R = TypeVar("R")

# Why the current task's last acquisition through Redis failed, for `LockTimeout`'s message
# (a context variable: `acquire()` runs in the caller's task, as does `__aenter__`).
_last_miss: contextvars.ContextVar[_spec.Miss | None] = contextvars.ContextVar(
    "aiolocks_last_miss", default=None
)


class LeasedLock(LockCore, AsyncWithOnly):
    """Base of every primitive whose acquisitions are task-owned leases."""

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
        task = current_task()
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
                respec=None if self._spec.refused is None else self._current_spec,
            )
        if isinstance(grant, _spec.Miss):
            self._missed(grant, try_bound, token)
            return None
        if self._replicas:
            await confirm_replicated(self, context, grant)
        return grant

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

    async def release(self) -> None:
        """Release the current task's holding.

        Raises `LockNotOwned` if the task holds nothing (a holding of a task that has
        finished is adopted), and `LockLost` if the lease had been lost meanwhile.
        """
        holding = self._take_holding()
        self._uncap(holding)
        _telemetry.on_release(self._spec, holding.token)
        context = context_for(self._client)
        if holding.is_lost:
            if not self._local_handoff:
                self._stop_renewal(context, holding)  # a cohort's lease is the cohort's to drop
            # Best-effort: the key is gone or someone else's; this only tidies the queue, and
            # never delays the report (a link that stalled may be why the lease was lost).
            until = time.monotonic() + _release.GRACE
            await _release.withdraw(
                context, self._spec, holding.token, self._ttl_ms, until, call=holding.give_back
            )
            raise self._lost_error(holding)
        with map_redis_errors(self._name):
            # Waited for no longer than the lease is known valid: past that, whether it
            # was released or lost cannot be told, and the report must not wait.
            valid_until = None if holding.lease is None else holding.lease.valid_until
            try:
                if self._local_handoff:
                    cohort = cohort_for(context, self._spec, self._ttl_ms, self._local_handoff)
                    answer = await cohort.release(self, holding, valid_until)
                else:
                    answer = await self._release_surely(context, holding)
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
        _telemetry.on_lease_lost(self._spec, holding.token)
        return self._lost_error(holding)

    # -- hand-over to another process --------------------------------------------------

    def detach(self) -> LockHandle:
        """Let go of the current task's holding here without releasing it, for another
        process to `adopt()`: renewal here stops, so adopt it within the `ttl`.

        Raises `LockNotOwned` if the task holds nothing, `LockLost` if the lease had been
        lost, and `LockError` for a `local_handoff` holding (its lease is the process's).
        """
        return _handover.detach(self)

    async def adopt(self, handle: LockHandle) -> None:
        """Take over a holding another process `detach()`ed: the current task holds it now,
        renewed and released here, with the handle's `fencing_token`.

        The server hands it to a new token of this process in one script, so a handle is
        adopted once only, across every process. Raises `LockLost` at once if that holding
        has ended (or its handle was adopted already): nothing is acquired anew, nothing
        queued. Raises `LockError` for a handle of another kind, name or prefix.
        """
        await _handover.adopt(self, handle)

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
        return snapshot(self)

    # -- async with and decorator ------------------------------------------------------

    async def __aenter__(self) -> Self:
        _last_miss.set(None)
        if not await self.acquire(timeout=self._timeout):
            assert self._timeout is not None
            miss = _last_miss.get()
            raise LockTimeout(self._name, self._timeout, None if miss is None else miss.situation())
        holding = self._holdings[current_task()]
        holding.body = True
        if holding.is_lost:  # lost before the body even started
            holding.cancel_body()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if current_task() not in self._holdings:
            return  # released inside the body already
        try:  # (the release takes back a cancellation that a loss made: `end_body`)
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
