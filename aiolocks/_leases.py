"""One lease keeper per client: renews every held lease and heartbeats every queued waiter.

Renewals that fall due together go out as one pipeline. Each lease keeps a conservative
local validity on the monotonic clock, counted from when the request that granted or
last renewed it was *sent*; when a renewal finds another owner, or the validity runs out
while Redis cannot be reached, the lease is reported lost, never silently dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis.exceptions

from . import _telemetry
from ._scripts import Script, load
from ._waitqueue import Waiter

if TYPE_CHECKING:
    from ._context import ClientContext

__all__ = ["Lease", "LeaseKeeper"]

log = logging.getLogger("aiolocks")

HEARTBEAT = load("heartbeat")
# Validity is shortened by this much of the ttl (plus 2 ms) to allow for clock drift
# between this host and the server, as in the Redlock analysis.
_DRIFT = 0.01
_RETRY_MIN = 0.01
# An idle keeper task ends after this long with nothing to renew.
_IDLE_EXIT = 1.0


def validity(sent_at: float, ttl: float) -> float:
    """The monotonic time until which a lease granted (or renewed) by a call sent at `sent_at`
    is known to be held."""
    return sent_at + ttl * (1 - _DRIFT) - 0.002


class Lease:
    """One held lease: how to renew it, until when it is known valid, whom to tell if lost."""

    __slots__ = ("args", "keys", "lost", "next_due", "on_lost", "script", "ttl", "valid_until")

    def __init__(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        ttl: float,
        granted_at: float,
        on_lost: Callable[[str], None],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.ttl = ttl
        self.valid_until = validity(granted_at, ttl)
        self.next_due = granted_at + ttl / 3
        self.on_lost = on_lost
        self.lost = False

    @property
    def remaining(self) -> float:
        return max(0.0, self.valid_until - time.monotonic())


class _HeartbeatGroup:
    """The waiters of one primitive's queue (one `waiters` key) in this process; `keys` are
    the waiters key, then the keys heartbeat.lua keeps alive with them."""

    __slots__ = ("keys", "next_due", "waiters")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self.waiters: dict[str, Waiter] = {}
        self.next_due = float("inf")


class LeaseKeeper:
    """Renews leases at ttl/3 and heartbeats waiters at ttl/3, batched, in one task."""

    def __init__(self, context: ClientContext) -> None:
        self._context = context
        self._leases: set[Lease] = set()
        self._groups: dict[bytes, _HeartbeatGroup] = {}
        self._task: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Future[None] | None = None
        self._wake_at = float("inf")

    # -- registration ------------------------------------------------------------------

    def hold(self, lease: Lease) -> None:
        self._leases.add(lease)
        self._schedule(lease.next_due)

    def drop(self, lease: Lease) -> None:
        self._leases.discard(lease)

    def watch_waiter(self, keys: tuple[bytes, ...], waiter: Waiter) -> None:
        """Heartbeat `waiter` with its primitive's `keys` (the waiters key first)."""
        group = self._groups.get(keys[0])
        if group is None:
            group = self._groups[keys[0]] = _HeartbeatGroup(keys)
        group.waiters[waiter.token] = waiter
        due = time.monotonic() + waiter.ttl_ms / 3000.0
        if due < group.next_due:
            group.next_due = due
            self._schedule(due)

    def unwatch_waiter(self, keys: tuple[bytes, ...], waiter: Waiter) -> None:
        group = self._groups.get(keys[0])
        if group is not None:
            group.waiters.pop(waiter.token, None)
            if not group.waiters:
                del self._groups[keys[0]]

    def _schedule(self, due: float) -> None:
        if self._task is None or self._task.done():
            self._wake_at = due
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="aiolocks-lease-keeper"
            )
        elif due < self._wake_at and self._sleeper is not None and not self._sleeper.done():
            self._sleeper.set_result(None)

    # -- the task ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            if not (self._leases or self._groups):
                # Idle: linger a while, so short holds do not start a task each.
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= _IDLE_EXIT:
                    return
                due = idle_since + _IDLE_EXIT
            else:
                idle_since = None
                due = min(
                    [min(lease.next_due, lease.valid_until) for lease in self._leases]
                    + [group.next_due for group in self._groups.values()]
                )
            if due > now:
                self._wake_at = due
                self._sleeper = loop.create_future()
                handle = loop.call_at(loop.time() + (due - now), _resolve, self._sleeper)
                try:
                    await self._sleeper
                finally:
                    handle.cancel()
                    self._sleeper = None
                    self._wake_at = float("inf")
                continue
            await self._renew_due(now)

    async def _renew_due(self, now: float) -> None:
        self._expire_overdue()
        leases = [lease for lease in self._leases if lease.next_due <= now]
        groups = [group for group in self._groups.values() if group.next_due <= now]
        calls: list[tuple[Script, tuple[bytes, ...], tuple[Any, ...]]] = [
            (lease.script, lease.keys, lease.args) for lease in leases
        ]
        members = [list(group.waiters.values()) for group in groups]
        calls += [
            (HEARTBEAT, group.keys, tuple(w.member for w in waiters))
            for group, waiters in zip(groups, members, strict=True)
        ]
        # Never wait past the moment a held lease stops being known valid, nor longer than a
        # third of the shortest lease in the batch: redis-py's own retries with back-off can
        # keep one call busy for seconds after the server is back (a failover, a restart),
        # and a fresh call a moment later gets through where that one is still sleeping.
        bound = min((lease.valid_until for lease in self._leases), default=now + 5.0) - now
        bound = min([bound, *(lease.ttl / 3 for lease in leases)])
        sent_at = time.monotonic()
        # If the keeper is cancelled (the loop shutting down) while the call ignores its own
        # cancellation (redis-py can, mid-read), wait_for leaves the call's later error
        # unread: read it here, so it is never logged as "never retrieved".
        call = asyncio.ensure_future(self._context.pipeline(calls))
        call.add_done_callback(_read_outcome)
        try:
            results = await asyncio.wait_for(call, max(bound, _RETRY_MIN))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if cancelling():
                return  # shutting down: a dropped socket raced the cancellation
            log.debug("aiolocks: renewal failed: %r", exc)
            results = [exc] * len(calls)
        for lease, result in zip(leases, results[: len(leases)], strict=True):
            self._settle_lease(lease, result, sent_at)
        _telemetry.on_renewal(leases, results[: len(leases)])
        for group, waiters, result in zip(groups, members, results[len(leases) :], strict=True):
            self._settle_heartbeat(group, waiters, result, sent_at)
        self._expire_overdue()

    def _settle_lease(self, lease: Lease, result: Any, sent_at: float) -> None:
        if lease not in self._leases:
            return  # released while the renewal was in flight
        if isinstance(result, Exception):
            now = time.monotonic()
            lease.next_due = now + max(_RETRY_MIN, min(lease.ttl / 10, lease.remaining / 2))
            return
        if int(result) == 1:
            lease.valid_until = validity(sent_at, lease.ttl)
            lease.next_due = sent_at + lease.ttl / 3
        else:
            self._lose(lease, "another owner holds it now (or its key was deleted)")

    def _settle_heartbeat(
        self, group: _HeartbeatGroup, waiters: list[Waiter], result: Any, sent_at: float
    ) -> None:
        now = time.monotonic()
        shortest = min((w.ttl_ms for w in group.waiters.values()), default=3000)
        if isinstance(result, Exception):
            group.next_due = now + max(_RETRY_MIN, shortest / 30000.0)
            return
        group.next_due = now + shortest / 3000.0
        missing = {int(index) - 1 for index in result or ()}
        for index, waiter in enumerate(waiters):
            if index in missing:
                waiter.recheck()  # purged as dead (or granted): it must re-run acquire
            else:
                waiter.still_queued(sent_at)  # not granted when the heartbeat ran

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for lease in list(self._leases):
            if lease.valid_until <= now:
                self._lose(lease, "Redis could not be reached before the lease ran out")

    def _lose(self, lease: Lease, reason: str) -> None:
        self._leases.discard(lease)
        lease.lost = True
        try:
            lease.on_lost(reason)
        except Exception:  # a holder's callback must never kill the keeper
            log.exception("aiolocks: lease-lost callback failed")

    async def aclose(self) -> None:
        self._leases.clear()
        self._groups.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, redis.exceptions.RedisError):
                await self._task
            self._task = None


def cancelling() -> bool:
    """True when the current task is being cancelled (a shutdown racing a dropped socket
    can surface from redis-py as ConnectionError instead of CancelledError)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _read_outcome(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
