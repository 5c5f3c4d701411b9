"""Local hand-off (lock cohorting): a process that holds a lease passes it among its own
waiting tasks, up to a limit, before it goes back to the global FIFO queue.

After Dice, Marathe and Shavit, "Lock Cohorting" (PPoPP 2012). The tasks of one process
that want one lock with the same settings form a cohort. At most one of them (the
contender) acquires through Redis at a time; the others wait here, in FIFO order, without
any Redis state. When the cohort holds the lease, a release hands it to the next local
task without a round trip, up to `local_handoff` times in a row and for at most
`CHAIN_BOUND` seconds since the lease came from Redis, and never after a holding of
`CHAIN_BOUND` or more; then the release script is asked to give it to the global queue,
or, when nobody waits there, to let the cohort keep it. So a waiter in another process
waits beyond strict FIFO at most `local_handoff` local holdings and at most `CHAIN_BOUND`
of them (plus the holding in progress when the bound passes).

Fences stay strictly increasing across all holders: a cohort's token ends in "+<local_handoff+1>"
and every grant of it reserves that many consecutive fences (see `_prelude.lua`); local
hand-offs use the rest of the block, and any later grant is above it.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections import deque
from typing import Any, Protocol

from .._base import _clock
from .._base._spec import Grant, Spec
from .._leases._keeper import Callbacks, Holding, Lease, LeaseOwner
from . import _release
from ._context import ClientContext
from ._release import Released, Unanswered

__all__ = [
    "CHAIN_BOUND",
    "DEFAULT_LOCAL_HANDOFF",
    "MAX_LOCAL_HANDOFF",
    "Cohort",
    "Member",
    "cohort_for",
    "cohort_token",
    "cohorts_of",
    "is_cohort_token",
]


MAX_LOCAL_HANDOFF = 10_000
# `RedisMutex`'s default `local_handoff`: measured best of 4 and 16 (docs/benchmarks.md).
DEFAULT_LOCAL_HANDOFF = 16
# Local passes stop once the lease has stayed in this process so long since it came from
# Redis, and after any holding this long. Go's sync.Mutex turns fair after a 1 ms wait, but
# a pass through Redis costs ~100x a thread's hand-off (a round trip): 10 ms keeps 0.1-5 ms
# bodies passing locally and makes 20 ms ones strict FIFO (docs/benchmarks.md).
CHAIN_BOUND = 0.010

_Key = tuple[bytes, int, int]  # (channel, ttl_ms, local_handoff)


class Member(Protocol):
    """What a cohort calls on a lock whose tasks it serves (`LeasedLock` is one)."""

    _spec: Spec
    _holdings: dict[asyncio.Task[Any], Holding]

    async def _acquire_grant(
        self, context: ClientContext, local_handoff: int, blocking: bool, deadline: float | None
    ) -> Grant | None: ...

    def _new_lease(self, grant: Grant, owner: LeaseOwner) -> Lease: ...

    def _install(
        self, task: asyncio.Task[Any], token: str, fence: int, lease: Lease | None = None
    ) -> Holding: ...

    def _lease_lost(self, holding: Holding, reason: str) -> None: ...


class _Turn(enum.Enum):
    """What a waiting task of the cohort is told."""

    HOLD = "hold"  # it holds the lock now, handed on locally
    CONTEND = "contend"  # it is the cohort's contender now: acquire through Redis


class _LocalWaiter:
    __slots__ = ("future", "lock", "task")

    def __init__(self, lock: Member, task: asyncio.Task[Any]) -> None:
        self.lock = lock
        self.task = task
        self.future: asyncio.Future[_Turn] = asyncio.get_running_loop().create_future()


def cohorts_of(context: ClientContext) -> dict[_Key, Cohort]:
    """The cohorts of `context`, by (channel, ttl_ms, local_handoff); idle ones leave."""
    cohorts: dict[_Key, Cohort] = context.keep("cohorts", dict)
    return cohorts


def cohort_for(context: ClientContext, spec: Spec, ttl_ms: int, local_handoff: int) -> Cohort:
    """The cohort of this process for one lock and one setting of ttl and local_handoff."""
    key = (spec.channel, ttl_ms, local_handoff)
    cohorts = cohorts_of(context)
    cohort = cohorts.get(key)
    if cohort is None:
        cohort = cohorts[key] = Cohort(context, spec, ttl_ms, local_handoff)
    return cohort


def cohort_token(token: str, local_handoff: int) -> str:
    """The token a cohort acquires with: a grant of it reserves `local_handoff + 1` fences."""
    return f"{token}+{local_handoff + 1}"


def is_cohort_token(token: str) -> bool:
    """True for a token `cohort_token` made (a cohort's lease, shared by its holdings)."""
    return "+" in token


class Cohort:
    """The tasks of one process (one client, one loop) that want one lock with one setting
    of `ttl` and `local_handoff`."""

    def __init__(self, context: ClientContext, spec: Spec, ttl_ms: int, local_handoff: int):
        self._context = context
        self._cohorts = cohorts_of(context)  # where it is kept while in use
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
        self._held_since = 0.0  # when the current holder got it
        self._holder: tuple[Member, Holding] | None = None

    @property
    def idle(self) -> bool:
        return self.token is None and not self._contending and not self._queue

    # -- acquire ---------------------------------------------------------------------------

    async def acquire(
        self, lock: Member, task: asyncio.Task[Any], blocking: bool, deadline: float | None
    ) -> bool:
        """Acquire for `task`: through Redis if the cohort is idle, else after the local
        tasks ahead of it (or as the next contender, if the lease leaves the process)."""
        try:
            return await self._acquire(lock, task, blocking, deadline)
        finally:
            self._retire_if_idle()

    async def _acquire(
        self, lock: Member, task: asyncio.Task[Any], blocking: bool, deadline: float | None
    ) -> bool:
        if self.idle:
            return await self._contend(lock, task, blocking, deadline)
        if not blocking:
            return False  # busy here: held by, or being acquired for, another local task
        waiter = _LocalWaiter(lock, task)
        self._queue.append(waiter)
        try:
            timeout = None if deadline is None else max(0.0, deadline - _clock.monotonic())
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

    async def _abandon(self, waiter: _LocalWaiter) -> None:
        """A waiting task gives up (timeout, cancellation): whatever it was handed meanwhile
        goes on to the next task."""
        if not waiter.future.done():
            waiter.future.cancel()
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
        lock: Member,
        task: asyncio.Task[Any],
        blocking: bool,
        deadline: float | None,
    ) -> bool:
        self._contending = True  # already, for a task promoted to it
        grant = None
        try:
            grant = await lock._acquire_grant(self._context, self.local_handoff, blocking, deadline)
        finally:
            self._contending = False
            if grant is None:
                self._promote()
        if grant is None:
            return False
        self.token = grant.token
        self._next_fence = grant.fence + 1
        self.passes = 0
        self._chain_start = _clock.monotonic()
        give_back = functools.partial(
            _release.release, self._context, self._spec, grant.token, self._ttl_ms
        )
        lease = lock._new_lease(grant, Callbacks(self._lost, give_back))
        self._lease = lease
        self._context.keeper.hold(lease)
        self._give(lock, task, grant.fence)
        return True

    def _give(self, lock: Member, task: asyncio.Task[Any], fence: int) -> None:
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
        self, lock: Member, holding: Holding, until: float | None = None
    ) -> bool | Unanswered | None:
        """Release `holding` (already taken from `lock`): hand it to the next local task, or
        give the lease back through Redis, as every release (`_release.release_until`).
        Returns True when it was held (False if not, None if unsure: see
        `_release.release`); UNANSWERED when Redis did not answer by `until` (by default
        the lease's validity; the call then goes on in the background)."""
        try:
            if self._holder is not None and self._holder[1] is holding:
                self._holder = None
            lease = self._lease
            if holding.token != self.token or lease is None:
                # The cohort let go of it already (lost): only tidy up on the server.
                return await _release.release(
                    self._context, self._spec, holding.token, self._ttl_ms
                )
            # A lease whose validity ended unrenewed (a stalled loop) is not passed on
            # locally (the server may have ended it): its release tells the holder.
            valid = lease.remaining > 0
            waiter = self._next_waiter()
            if waiter is not None and valid and self._may_pass():
                self._pass(waiter, lock._spec)
                return True
            if waiter is not None:
                self._queue.appendleft(waiter)
            keep = waiter is not None and valid
            return await self._give_back(lease, lock._spec, until, keep)
        finally:
            self._retire_if_idle()

    def _may_pass(self) -> bool:
        """Whether one more local pass is allowed: by count (`local_handoff`), by the time the lease
        has stayed here, and not after a long holding."""
        if self.passes >= self.local_handoff:
            return False
        now = _clock.monotonic()
        return now - self._chain_start < CHAIN_BOUND and now - self._held_since < CHAIN_BOUND

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

    def _pass(self, waiter: _LocalWaiter, releaser: Spec) -> None:
        fence, self._next_fence = self._next_fence, self._next_fence + 1
        self.passes += 1
        _release.handed_off(releaser, 1, local=True)
        self._give(waiter.lock, waiter.task, fence)
        waiter.future.set_result(_Turn.HOLD)

    async def _give_back(
        self, lease: Lease, releaser: Spec, until: float | None, keep: bool
    ) -> bool | Unanswered | None:
        """Give the lease back through the release every holder uses (the client's release
        gate, the lease renewed until the answer). `keep` (local tasks still wait, and no local
        pass is allowed): the release script gives it to the global queue, or, when nobody waits
        there, lets the cohort keep it with a fresh lease and fence block (one round trip
        either way); a release cut short gives it back."""
        token = self.token
        assert token is not None
        context, spec = self._context, self._spec
        self.token, self._lease = None, None  # the release's now (it drops it from the keeper)
        kept: list[tuple[float, int]] = []  # (sent at, next fence) if the script kept it

        async def keep_or_return() -> bool | None:
            sent_at = _clock.monotonic()
            written: list[float] = []
            reply, unsure = await _release.release_reply(
                context, spec, token, self._ttl_ms, "keep", sent=written.append
            )
            sent_at = written[0] if written else sent_at
            status = reply.status
            if status is Released.KEPT:
                kept.append((sent_at, reply.fence))
                return True
            _release.wake_granted(context, spec, reply.grants, sent_at)
            _release.handed_off(releaser, len(reply.grants))
            return None if unsure and status is Released.NOT_HELD else status is Released.HELD

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
            self._keep(token, lease, releaser, *kept[0])
        return answer

    def _keep(self, token: str, lease: Lease, releaser: Spec, sent_at: float, fence: int) -> None:
        """The release script let the cohort keep its lease: the next local task holds it,
        the first of a new block (that pass came from Redis)."""
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
        if self.idle and self._cohorts.get(self._key) is self:
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
