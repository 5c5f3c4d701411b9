"""One lease keeper per client: renews every held lease and heartbeats every queued waiter.

Leases and waiter groups wait in one heap keyed by when they next need the server, so
the keeper's work per lease per period is O(log N), whatever N. When one comes due, every
other due within a tenth of a period goes with it, on purpose: leases renewed together
stay together, so the calls per period track the batches, not the leases. What is due goes
out as one renewal (`_renewal.renew`) in a task of its own; what its replies say renews,
retries or loses each lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._base import _telemetry
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import REDIS_ERRORS
from .._waiting._lot import Waiter
from ._lease import HeartbeatGroup, Lease, validity
from ._renewal import BATCH, Outcomes, renew

if TYPE_CHECKING:
    from .._transport._autopipe import Staged

__all__ = ["LeaseKeeper", "Runner"]

log = logging.getLogger("aiolocks")

# Script calls in one pipeline at most; a round with more due waits for the next turn of
# the event loop, so a burst of renewals never holds the loop (and acquisitions) long.
_ROUND = 8
# Renewal pipelines in flight at most: one normally; more only while the server is slow.
_LANES = 4
# A lease due within this share of its renewal period from now is renewed with the one due.
_COALESCE = 0.1
_RETRY_MIN = 0.01
# An idle keeper task ends after this long with nothing to renew.
_IDLE_EXIT = 1.0


class Runner(Protocol):
    """What the keeper needs of its client's script runner (`_context.ClientContext`)."""

    @property
    def client(self) -> AnyRedis: ...

    async def pipeline(self, calls: list[Staged]) -> list[Any]:
        """Run several scripts in one round trip; each result is a value or an exception."""
        ...


# What the heap holds: a lease, a group of waiters, or a bucket of leases renewed together
# (same ttl, so due together); a bucket costs one heap entry however many it holds.
_Item = Lease | HeartbeatGroup | list[Lease]


class LeaseKeeper:
    """Renews leases at ttl/3 and heartbeats waiters at ttl/3, batched, in one task."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._cluster = is_cluster(runner.client)
        self._leases: set[Lease] = set()
        self._groups: dict[bytes, HeartbeatGroup] = {}
        # (when it next needs the server, tie-breaker, item). A lease's `queued` is the due
        # of its one live entry: entries of a lease dropped or moved meanwhile stay until
        # they surface, and are passed over then.
        self._heap: list[tuple[float, int, _Item]] = []
        self._order = itertools.count()
        self._batches: set[asyncio.Task[None]] = set()
        self._lanes: asyncio.Semaphore | None = None
        self._task: asyncio.Task[None] | None = None
        self._sleeper: asyncio.Future[None] | None = None
        self._wake_at = float("inf")

    # -- registration ------------------------------------------------------------------

    def hold(self, lease: Lease) -> None:
        """Keep `lease` renewed from its `next_due` on (again, if it was held already:
        the keeper then goes by its `next_due` as it is now)."""
        self._leases.add(lease)
        due = lease.queued = min(lease.next_due, lease.valid_until)
        self._push(due, lease)

    def drop(self, lease: Lease) -> None:
        self._leases.discard(lease)
        lease.queued = None

    def releases(self) -> list[Callable[[], Awaitable[object]]]:
        """How to give back every lease held now."""
        return [lease.owner.give_back for lease in self._leases]

    def watch_waiter(self, keys: tuple[bytes, ...], waiter: Waiter) -> None:
        """Heartbeat `waiter` with its primitive's `keys` (the waiters key first)."""
        group = self._groups.get(keys[0])
        if group is None:
            group = self._groups[keys[0]] = HeartbeatGroup(keys)
        group.waiters[waiter.token] = waiter
        period = waiter.ttl_ms / 3000.0
        group.period = min(group.period, period)
        due = time.monotonic() + period
        if due < group.next_due:
            group.next_due = group.queued = due
            self._push(due, group)

    def unwatch_waiter(self, keys: tuple[bytes, ...], waiter: Waiter) -> None:
        group = self._groups.get(keys[0])
        if group is not None:
            group.waiters.pop(waiter.token, None)
            if not group.waiters:
                del self._groups[keys[0]]
                group.queued = None

    def _push(self, due: float, item: _Item) -> None:
        heapq.heappush(self._heap, (due, next(self._order), item))
        if len(self._heap) > 2 * (len(self._leases) + len(self._groups)) + 1024:
            # In place: a round being taken off the heap holds on to this list.
            self._heap[:] = [entry for entry in self._heap if self._live(entry[0], entry[2])]
            heapq.heapify(self._heap)
        self._schedule(due)

    def _live(self, due: float, item: _Item) -> bool:
        if isinstance(item, list):
            return any(lease.queued == due and lease in self._leases for lease in item)
        if item.queued != due:
            return False
        if isinstance(item, Lease):
            return item in self._leases
        return self._groups.get(item.keys[0]) is item

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
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            due = self._first_due()
            if due is not None or self._leases or self._groups or self._batches:
                idle_since = None  # (a lease in flight comes back when its batch settles)
            elif idle_since is None:
                idle_since = now  # idle: linger a while, so short holds do not start a task each
            elif now - idle_since >= _IDLE_EXIT:
                return
            if due is None and idle_since is not None:
                due = idle_since + _IDLE_EXIT
            if due is None or due > now:
                await self._sleep(due, now)
                continue
            self._launch(now)
            await asyncio.sleep(0)  # a long round of due leases lets everything else run

    def _first_due(self) -> float | None:
        """When the first heap entry is due (a bucket is not looked into: one whose leases
        all left meanwhile costs a wake-up that finds nothing to do)."""
        heap = self._heap
        while heap:
            due, _, item = heap[0]
            if isinstance(item, list) or self._live(due, item):
                return due
            heapq.heappop(heap)
        return None

    async def _sleep(self, due: float | None, now: float) -> None:
        loop = asyncio.get_running_loop()
        self._wake_at = float("inf") if due is None else due
        self._sleeper = loop.create_future()
        handle = None
        if due is not None:
            handle = loop.call_at(loop.time() + (due - now), _resolve, self._sleeper)
        try:
            await self._sleeper
        finally:
            if handle is not None:
                handle.cancel()
            self._sleeper = None
            self._wake_at = float("inf")

    def _launch(self, now: float) -> None:
        """Take what is due (and what falls due within its coalescing window) off the heap,
        up to about one round, and send it as one batch in a task of its own."""
        heap = self._heap
        leases: list[Lease] = []
        groups: list[HeartbeatGroup] = []
        weight = 0
        while heap and weight + len(leases) < _ROUND * BATCH:
            due, _, item = heap[0]
            if isinstance(item, HeartbeatGroup):
                if not self._live(due, item):
                    heapq.heappop(heap)
                    continue
                if due > now + item.period * _COALESCE:
                    break
                heapq.heappop(heap)
                item.queued = None
                groups.append(item)
                weight += len(item.waiters)
                continue
            bucket = item if isinstance(item, list) else [item]
            horizon = now + bucket[0].ttl / 3 * _COALESCE
            if due > horizon:
                break
            heapq.heappop(heap)
            for lease in bucket:
                if lease.queued == due and lease in self._leases:
                    self._take(lease, now, horizon, leases)
        if leases or groups:
            batch = asyncio.get_running_loop().create_task(self._renew(leases, groups, now))
            self._batches.add(batch)
            batch.add_done_callback(self._settled)

    def _take(self, lease: Lease, now: float, horizon: float, leases: list[Lease]) -> None:
        lease.queued = None
        if lease.valid_until <= now:
            self._lose(lease, "Redis could not be reached before the lease ran out")
            return
        moved = min(lease.next_due, lease.valid_until)
        if moved > horizon:  # renewed meanwhile by other means (a cohort keeping it)
            lease.queued = moved
            self._push(moved, lease)
            return
        leases.append(lease)

    def _settled(self, batch: asyncio.Task[None]) -> None:
        self._batches.discard(batch)
        if not self._batches and self._sleeper is not None and not self._sleeper.done():
            self._sleeper.set_result(None)  # perhaps idle now: the loop decides

    async def _renew(self, leases: list[Lease], groups: list[HeartbeatGroup], now: float) -> None:
        renewed = await renew(self._send, leases, groups, now, self._cluster)
        if renewed is not None:  # (None: shutting down)
            self._settle(leases, groups, *renewed)

    async def _send(self, calls: list[Staged]) -> list[Any]:
        if self._lanes is None:
            self._lanes = asyncio.Semaphore(_LANES)
        async with self._lanes:
            return await self._runner.pipeline(calls)

    # -- results -----------------------------------------------------------------------

    def _settle(
        self,
        leases: list[Lease],
        groups: list[HeartbeatGroup],
        outcomes: Outcomes,
        sent_at: float,
    ) -> None:
        buckets: dict[float, list[Lease]] = {}  # renewed, by ttl: due together from now on
        for lease in leases:
            if lease not in self._leases or lease.lost:
                continue  # released while the renewal was in flight
            outcome = outcomes.leases.get(lease, 1)
            if outcome == 1:
                lease.valid_until = validity(sent_at, lease.ttl)
                lease.next_due = lease.queued = sent_at + lease.ttl / 3
                buckets.setdefault(lease.ttl, []).append(lease)
            elif isinstance(outcome, Exception):
                self._retry(lease)
            else:
                self._lose(lease, "another owner holds it now (or its key was deleted)")
        for ttl, bucket in buckets.items():
            self._push(sent_at + ttl / 3, bucket)
        if _telemetry.recorder is not None:
            _telemetry.on_renewal(leases, [outcomes.leases.get(lease, 1) for lease in leases])
        for group in groups:
            self._settle_heartbeat(group, group in outcomes.failed)
        for waiter in outcomes.purged:
            waiter.recheck()  # purged as dead (or granted): it must re-run acquire
        for waiter in outcomes.queued:
            waiter.still_queued(sent_at)  # not granted when the heartbeat ran

    def _retry(self, lease: Lease) -> None:
        now = time.monotonic()
        if lease.valid_until <= now:
            self._lose(lease, "Redis could not be reached before the lease ran out")
            return
        lease.next_due = now + max(_RETRY_MIN, min(lease.ttl / 10, lease.remaining / 2))
        due = lease.queued = min(lease.next_due, lease.valid_until)
        self._push(due, lease)

    def _settle_heartbeat(self, group: HeartbeatGroup, failed: bool) -> None:
        if self._groups.get(group.keys[0]) is not group:
            return  # its last waiter left meanwhile
        shortest = min(w.ttl_ms for w in group.waiters.values()) / 3000.0
        group.period = shortest
        due = time.monotonic() + (max(_RETRY_MIN, shortest / 10) if failed else shortest)
        group.next_due = group.queued = due
        self._push(due, group)

    def _lose(self, lease: Lease, reason: str) -> None:
        self._leases.discard(lease)
        lease.queued = None
        lease.lost = True
        if lease.releasing:
            return  # its release reports it (see `_release.release_until`)
        try:
            lease.owner.lease_lost(reason)
        except Exception:  # a holder's callback must never kill the keeper
            log.exception("aiolocks: lease-lost callback failed")

    async def aclose(self) -> None:
        self._leases.clear()
        self._groups.clear()
        self._heap.clear()
        tasks = [*self._batches, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, *REDIS_ERRORS):
                await task
        self._task = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
