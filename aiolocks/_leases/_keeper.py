"""Leases and their keeper: what is held, how it is renewed, and the one keeper per client.

Read top to bottom:

- What is held: a `Lease` (its validity, on the monotonic clock, counted from when the
  request that granted or last renewed it was *sent*: `validity`), the `Holding` that owns
  it (one acquisition of one task), and a `HeartbeatGroup` of waiters. When a renewal
  finds another owner, or the validity runs out while Redis cannot be reached, the lease
  is reported lost (to its `owner`), never silently dropped.
- One renewal on the wire (`renew`): the script calls that renew some leases and heartbeat
  some waiters, sent in one pipeline, their replies read back per lease and per waiter. A
  call carries up to `BATCH` entries (on Cluster, of one slot), so the calls per period
  track the batches, not the leases. Every renewal is idempotent, so a pipeline left
  unanswered for a while is sent again beside itself and the first answer is taken.
- The keeper (`LeaseKeeper`, one per client): renews every held lease and heartbeats every
  queued waiter. Leases and waiter groups wait in one heap keyed by when they next need the
  server, so its work per lease per period is O(log N), whatever N. When one comes due,
  every other due within a tenth of a period goes with it, on purpose: leases renewed
  together stay together. What is due goes out as one renewal in a task of its own; what
  its replies say renews, retries or loses each lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import redis.exceptions
from redis.crc import key_slot

from .._base import _clock, _telemetry
from .._base._adapter import text
from .._base._clients import AnyRedis, is_cluster
from .._base._errors import REDIS_ERRORS, cancelling, retrieved, stop_tasks
from .._scripts import Script
from .._waiting._waitqueue import Waiter
from ._renewbatch import OP, RENEW_BATCH, Entry, pack

if TYPE_CHECKING:
    from .._transport._runner import Staged

__all__ = [
    "BATCH",
    "Callbacks",
    "HeartbeatGroup",
    "Holding",
    "Lease",
    "LeaseKeeper",
    "LeaseOwner",
    "Owner",
    "Runner",
    "current_task",
    "renew",
    "validity",
]

log = logging.getLogger("aiolocks")

# -- what is held: a lease, its holding, a group of waiters --------------------------------

# Validity is shortened by this much of the ttl (plus 2 ms) to allow for clock drift
# between this host and the server, as in the Redlock analysis.
_DRIFT = 0.01


def validity(sent_at: float, ttl: float) -> float:
    """The monotonic time until which a lease granted (or renewed) by a call sent at `sent_at`
    is known to be held."""
    return sent_at + ttl * (1 - _DRIFT) - 0.002


class LeaseOwner(Protocol):
    """Whom a lease tells of its loss, and how it is given back when the event loop ends
    while it is held (a `Holding` is its own lease's owner: no callback objects)."""

    def lease_lost(self, reason: str) -> None: ...

    def give_back(self) -> Awaitable[object]: ...


class Callbacks:
    """A `LeaseOwner` made of two callables (a cohort's lease, a multi-lock's names)."""

    __slots__ = ("give_back", "lease_lost")

    def __init__(
        self, lease_lost: Callable[[str], None], give_back: Callable[[], Awaitable[object]]
    ) -> None:
        self.lease_lost = lease_lost
        self.give_back = give_back


async def _nothing() -> None:
    return None


# The owner of a lease whose holding was released (`Lease.disowned`): nothing to tell.
_NO_OWNER = Callbacks(lambda reason: None, _nothing)


class Lease:
    """One held lease: how to renew it, until when it is known valid, whom to tell if lost."""

    __slots__ = (
        "args",
        "entry",
        "keys",
        "lost",
        "next_due",
        "owner",
        "queued",
        "releasing",
        "script",
        "ttl",
        "valid_until",
    )

    def __init__(
        self,
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        ttl: float,
        granted_at: float,
        owner: LeaseOwner,
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.ttl = ttl
        self.valid_until = validity(granted_at, ttl)
        self.next_due = granted_at + ttl / 3
        self.owner = owner
        self.lost = False
        # Being released: a loss is the release's to report, not the keeper's.
        self.releasing = False
        self.queued: float | None = None  # the key of its live heap entry (the keeper's)
        self.entry: Entry | None = None  # its part of a batch call, made once

    @property
    def remaining(self) -> float:
        return max(0.0, self.valid_until - _clock.monotonic())

    # Its fields are written here only (the keeper, a release, a cohort call these).

    def renewed(self, sent_at: float) -> None:
        """A call sent at `sent_at` renewed it: valid a ttl from then, due a third later."""
        self.valid_until = validity(sent_at, self.ttl)
        self.next_due = sent_at + self.ttl / 3

    def owned_by(self, owner: LeaseOwner) -> None:
        """Tell `owner` of its loss from now on (a cohort takes over a holding's lease)."""
        self.owner = owner

    def due_at(self, when: float) -> None:
        """Renew it at `when` (the keeper goes by it once the lease is held again)."""
        self.next_due = when

    def release_begun(self) -> None:
        """Its release is on its way: a loss is the release's to report, not the keeper's."""
        self.releasing = True

    def kept(self, sent_at: float) -> None:
        """Its release let the same token keep it (a cohort out of local passes, nobody
        waiting elsewhere: a fresh lease from `sent_at`): held again, no longer being released.
        Never earlier than it was: renewals answered while the keep was in flight extended the
        same token's lease, and the server kept the later of the two."""
        if validity(sent_at, self.ttl) > self.valid_until:
            self.renewed(sent_at)
        self.releasing = False
        self.lost = False

    def ended(self) -> None:
        """No longer held (lost, or capped by `max_hold`): nothing renews it any more."""
        self.lost = True

    def disowned(self) -> None:
        """Its holding is released, and the lease never held again: it no longer refers to
        its owner. A holding that owns its own lease refers to it too, and the pair would
        be freed only by the garbage collector, with the holding's task and lock."""
        self.owner = _NO_OWNER


class Owner(Protocol):
    """What a holding calls on the lock it belongs to (its lease's two callbacks)."""

    def _lease_lost(self, holding: Holding, reason: str) -> None: ...

    def _keeper_lost(self, holding: Holding, reason: str) -> None: ...

    async def _give_back_holding(self, holding: Holding) -> bool | None: ...


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease.

    Kept small, as a process may hold 100,000 at once and the garbage collector goes
    through every one at each full collection: the `lost` event is made only when asked
    for, and the `async with` body is cancelled through its task, without a cancel scope.
    """

    __slots__ = (
        "body",
        "cancelled",
        "cap",
        "fence",
        "lease",
        "lock",
        "lost_event",
        "lost_reason",
        "task",
        "token",
    )

    def __init__(self, lock: Owner, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.lock = lock
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost_reason: str | None = None  # set once: the holding is lost
        self.lost_event: asyncio.Event | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`
        self.body = False  # its task is in the body of `async with`: a loss cancels it
        self.cancelled = False  # a loss cancelled its task (to be taken back at the exit)

    @property
    def is_lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def lost(self) -> asyncio.Event:
        """Set when the holding is lost; made when first asked for."""
        if self.lost_event is None:
            self.lost_event = asyncio.Event()
            if self.lost_reason is not None:
                self.lost_event.set()
        return self.lost_event

    def mark_lost(self, reason: str) -> None:
        """Record the loss and set the `lost` event, if one was made."""
        self.lost_reason = reason
        if self.lost_event is not None:
            self.lost_event.set()

    def cancel_body(self) -> None:
        """Cancel the task's `async with` body at the loss, as a cancel scope would: at
        once if the task waits, else at its next wait (never the task's own clean-up)."""
        if not self.body or self.cancelled:
            return
        if self.task is asyncio.current_task():
            asyncio.get_running_loop().call_soon(self.cancel_body)
            return
        self.cancelled = True
        self.task.cancel()

    def end_body(self) -> None:
        """The body has ended: the cancellation `cancel_body` asked for is taken back (as
        a cancel scope's exit does), so that only others' requests stay counted."""
        self.body = False
        if self.cancelled:
            self.cancelled = False
            self.task.uncancel()

    # As its lease's owner (`LeaseOwner`): the lease calls these on the holding
    # itself, so no callback object is made per holding (a burst of 100,000 holdings would
    # be that many more objects for every full collection of the garbage collector).
    def lease_lost(self, reason: str) -> None:
        self.lock._keeper_lost(self, reason)

    def released(self) -> None:
        """Its release through Redis ended (answered or not), or it was detached: its own
        lease lets go of it (`Lease.disowned`), so both are freed as soon as nothing else
        refers to them."""
        if self.lease is not None and self.lease.owner is self:
            self.lease.disowned()

    async def give_back(self) -> bool | None:
        return await self.lock._give_back_holding(self)


def current_task() -> asyncio.Task[Any]:
    """The task that acquires, releases or hands over: holdings belong to it."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("aiolocks must be used from inside an asyncio task")
    return task


class HeartbeatGroup:
    """The waiters of one primitive's queue (one `waiters` key) in this process; `keys` are
    the waiters key, then the keys heartbeat.lua keeps alive with them."""

    __slots__ = ("keys", "next_due", "period", "queued", "slot", "waiters")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self.waiters: dict[str, Waiter] = {}
        self.next_due = float("inf")
        self.period = float("inf")  # a third of its shortest waiter's ttl
        self.queued: float | None = None
        self.slot = -1  # its Cluster slot, once asked


# -- one renewal on the wire ---------------------------------------------------------------

# Leases (or heartbeated waiters) per script call, measured by `bench_scale.py --calls`:
# client CPU per lease falls from ~40 µs at 10 per call to ~7 µs at 250 (~5 µs at 500),
# while one call holds the server for ~9 µs per lease (~2.3 ms at 250, at load average
# 4-5 on 2 CPUs): near the floor on the client, and never long on the server.
BATCH = 250
# A renewal call is sent again beside itself after a third of its shortest ttl, at least this.
_PATIENCE_MIN = 1.0
# However late its task starts, a renewal waits at least this long for its reply.
_LATE_MIN = 0.01


class Call:
    """One script call of a renewal: what it carries, and for whom."""

    __slots__ = ("keys", "packed", "single", "targets", "weight")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.packed: list[bytes] = []
        # Per entry: a lease, or (group, its waiters, the first one's index in them).
        self.targets: list[Lease | tuple[HeartbeatGroup, list[Waiter], int]] = []
        self.weight = 0
        self.single: Staged | None = None  # a lease whose script the batch does not know

    def staged(self) -> Staged:
        if self.single is not None:
            return self.single
        return (RENEW_BATCH, tuple(self.keys), (b"".join(self.packed),))


def lease_calls(leases: list[Lease], cluster: bool) -> list[Call]:
    """The script calls renewing `leases`: up to `BATCH` each; on Cluster, per slot."""
    calls: list[Call] = []
    by_slot: dict[int, list[Lease]] = {}
    for lease in leases:
        entry = lease.entry
        if entry is None:
            entry = lease.entry = _entry(lease, cluster)
        if entry is not None:
            by_slot.setdefault(entry.slot, []).append(lease)
            continue
        single = Call()  # a script the batch does not know: on its own
        single.single = (lease.script, lease.keys, lease.args)
        single.targets.append(lease)
        calls.append(single)
    for group in by_slot.values():
        for first in range(0, len(group), BATCH):
            call = Call()
            for lease in group[first : first + BATCH]:
                entry = lease.entry
                assert entry is not None  # made above
                call.keys.extend(entry.keys)
                call.packed.append(entry.packed)
                call.targets.append(lease)
            calls.append(call)
    return calls


def heartbeat_calls(groups: list[HeartbeatGroup], cluster: bool) -> list[Call]:
    """The script calls heartbeating `groups`: up to `BATCH` waiters each (a group of
    more is split); on Cluster, per slot."""
    calls: list[Call] = []
    open_calls: dict[int, Call] = {}
    for group in groups:
        if cluster and group.slot < 0:
            group.slot = key_slot(group.keys[0])
        waiters = list(group.waiters.values())
        for first in range(0, len(waiters), BATCH):
            chunk = waiters[first : first + BATCH]
            call = open_calls.get(group.slot)
            if call is None or call.weight + len(chunk) > BATCH:
                call = open_calls[group.slot] = Call()
                calls.append(call)
            call.weight += len(chunk)
            call.keys.extend(group.keys)
            members = [w.member for w in chunk]
            call.packed.append(pack(OP["heartbeat"], len(group.keys), members))
            call.targets.append((group, waiters, first))
    return calls


def _entry(lease: Lease, cluster: bool) -> Entry | None:
    op = OP.get(lease.script.name)
    if op is None or lease.script.name == "heartbeat":
        return None
    entry = Entry(op, lease.keys, lease.args)
    if cluster:
        entry.slot = key_slot(lease.keys[0])
    return entry


async def renew(
    pipeline: Callable[[list[Staged]], Awaitable[list[Any]]],
    leases: list[Lease],
    groups: list[HeartbeatGroup],
    now: float,
    cluster: bool,
) -> tuple[Outcomes, float] | None:
    """Renew `leases` and heartbeat `groups`, taken as due at `now`: (what the replies
    said, when the answered pipeline was sent). None if the task is being cancelled."""
    calls = lease_calls(leases, cluster) + heartbeat_calls(groups, cluster)
    # The batch fails when the first of its leases stops being known valid (a waiter's
    # queue entry, heartbeated a period ago, lives two periods more); a call not
    # answered within a third of its shortest lease (at least 1 s) gets a fresh copy
    # sent beside it.
    deadline = now + min(
        [lease.valid_until - now for lease in leases] + [2 * group.period for group in groups]
    )
    deadline = max(deadline, _clock.monotonic() + _LATE_MIN)  # (this task starts late)
    patience = min([lease.ttl / 3 for lease in leases] + [group.period for group in groups])
    # Not sooner than 1 s: for a short ttl, a second connection opened (TLS, under load)
    # beside a call that is merely slow did more harm than good.
    patience = max(patience, _PATIENCE_MIN)
    try:
        replies, sent_at = await send_hedged(
            pipeline, [call.staged() for call in calls], deadline, patience
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if cancelling():
            return None  # shutting down: a dropped socket raced the cancellation
        log.debug("aiolocks: renewal failed: %r", exc)
        replies, sent_at = [exc] * len(calls), _clock.monotonic()
    return read_replies(calls, replies), sent_at


async def send_hedged(
    pipeline: Callable[[list[Staged]], Awaitable[list[Any]]],
    staged: list[Staged],
    deadline: float,
    patience: float,
) -> tuple[list[Any], float]:
    """Send `staged` in one `pipeline`: (its replies, when it was sent). Unanswered after
    `patience`, the same is sent again beside it and the first answer is taken (every
    renewal is idempotent): a call stuck in redis-py's retry back-off after a failover
    is overtaken by a fresh one, while a call that is merely slow (a busy event loop, a
    busy server) still counts. TimeoutError at `deadline`."""
    pending: dict[asyncio.Future[list[Any]], float] = {}
    failure: Exception | None = None
    next_try = _clock.monotonic()
    try:
        while True:
            now = _clock.monotonic()
            if now >= deadline:
                raise failure or TimeoutError("no reply before the leases' validity ended")
            if now >= next_try:
                # Its outcome is read even if nobody waits for it any more, so a late
                # error is never logged as "never retrieved".
                call = asyncio.ensure_future(pipeline(staged))
                call.add_done_callback(retrieved)
                pending[call] = now
                next_try = now + patience
            done, _ = await asyncio.wait(
                pending, timeout=min(deadline, next_try) - now, return_when=FIRST_COMPLETED
            )
            for answered in done:
                sent_at = pending.pop(answered)
                error = None if answered.cancelled() else answered.exception()
                if error is None and not answered.cancelled():
                    return answered.result(), sent_at
                if isinstance(error, Exception):
                    failure = error
            if failure is not None and not pending:
                raise failure
    finally:
        for left in pending:
            left.cancel()


class Outcomes:
    """What the replies of one renewal said."""

    __slots__ = ("failed", "leases", "purged", "queued")

    def __init__(self) -> None:
        # Per lease that did not renew: 0 (another owner holds it) or the call's exception.
        self.leases: dict[Lease, Any] = {}
        self.failed: set[HeartbeatGroup] = set()  # groups whose heartbeat failed
        self.purged: list[Waiter] = []  # waiters purged as dead (or granted) meanwhile
        self.queued: list[Waiter] = []  # waiters the heartbeat found still queued


def read_replies(calls: list[Call], replies: list[Any]) -> Outcomes:
    """Read the replies of `calls` (a value, or an exception for a call that failed)."""
    outcomes = Outcomes()
    heard: list[tuple[HeartbeatGroup, list[Waiter], int]] = []  # heartbeats answered
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, Exception) or call.single is not None:
            for target in call.targets:
                if isinstance(target, Lease):
                    if isinstance(reply, Exception) or int(reply) != 1:
                        outcomes.leases[target] = reply if isinstance(reply, Exception) else 0
                else:
                    outcomes.failed.add(target[0])
            continue
        heard.extend(t for t in call.targets if not isinstance(t, Lease))
        for index in range(0, len(reply), 2):
            target, result = call.targets[int(reply[index]) - 1], reply[index + 1]
            if isinstance(result, bytes | str):  # that entry raised an error
                result = redis.exceptions.ResponseError(text(result))
            if isinstance(target, Lease):
                outcomes.leases[target] = result if isinstance(result, Exception) else 0
            elif isinstance(result, Exception):
                outcomes.failed.add(target[0])
            else:
                group, waiters, first = target
                outcomes.purged.extend(waiters[first + int(i) - 1] for i in result or ())
    gone = set(outcomes.purged)
    for group, waiters, first in heard:
        if group not in outcomes.failed:
            for waiter in waiters[first : first + BATCH]:
                if waiter not in gone:
                    outcomes.queued.append(waiter)  # not granted when the heartbeat ran
    return outcomes


# -- the keeper ----------------------------------------------------------------------------

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
        # Why it stopped (`aclose`, `lose_all`): a lease handed to it since is lost at once,
        # and it starts no task (nothing it arms outlives its client's engine).
        self._stopped: str | None = None

    # -- registration ------------------------------------------------------------------

    def hold(self, lease: Lease) -> None:
        """Keep `lease` renewed from its `next_due` on (again, if it was held already:
        the keeper then goes by its `next_due` as it is now). Lost at once if the keeper
        has stopped (an acquisition answered after its client was closed)."""
        if self._stopped is not None:
            self._lose(lease, self._stopped)
            return
        self._leases.add(lease)
        due = lease.queued = min(lease.next_due, lease.valid_until)
        self._push(due, lease)

    def drop(self, lease: Lease) -> None:
        self._leases.discard(lease)
        lease.queued = None
        self._idle()

    def releases(self) -> list[Callable[[], Awaitable[object]]]:
        """How to give back every lease held now."""
        return [lease.owner.give_back for lease in self._leases]

    def watch_waiter(self, keys: tuple[bytes, ...], waiter: Waiter) -> None:
        """Heartbeat `waiter` with its primitive's `keys` (the waiters key first); not once
        the keeper has stopped (the waiter's next call ends its wait)."""
        if self._stopped is not None:
            return
        group = self._groups.get(keys[0])
        if group is None:
            group = self._groups[keys[0]] = HeartbeatGroup(keys)
        group.waiters[waiter.token] = waiter
        period = waiter.ttl_ms / 3000.0
        group.period = min(group.period, period)
        due = _clock.monotonic() + period
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
                self._idle()

    def _idle(self) -> None:
        """Nothing left to keep: every entry of the heap is stale, so the task is woken to
        linger `_IDLE_EXIT` and end, not to sleep until a stale entry's due (it holds the
        client's engine: a client dropped without `aclose()` is collected after it)."""
        if self._leases or self._groups or not self._heap:
            return
        self._heap.clear()  # in place, as in `_push`
        # Woken only if it would sleep longer than that (until a stale entry's due): one
        # sleeping till its linger's end anyway is left alone, so a holding after holding
        # costs no wake-up of the task and no timer.
        if (
            self._sleeper is not None
            and not self._sleeper.done()
            and self._wake_at > _clock.monotonic() + _IDLE_EXIT
        ):
            self._sleeper.set_result(None)

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
        if self._stopped is not None:
            return
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
            now = _clock.monotonic()
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
            handle = loop.call_later(due - now, _resolve, self._sleeper)
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
                    self._take(lease, now, leases)
        if leases or groups:
            batch = asyncio.get_running_loop().create_task(self._renew(leases, groups, now))
            self._batches.add(batch)
            batch.add_done_callback(self._settled)

    def _take(self, lease: Lease, now: float, leases: list[Lease]) -> None:
        # (Its entry is live, so it is due as pushed: whatever moves a held lease's due
        # pushes it anew, as a cohort's kept lease is dropped and held again.)
        lease.queued = None
        if not self._lapsed(lease, now):
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
        now = _clock.monotonic()
        for lease in leases:
            if lease not in self._leases or lease.lost:
                continue  # released while the renewal was in flight
            outcome = outcomes.leases.get(lease, 1)
            if outcome == 1:
                if self._lapsed(lease, now):
                    continue  # answered after its validity ended (a batch waits _LATE_MIN)
                lease.renewed(sent_at)
                lease.queued = lease.next_due
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
        now = _clock.monotonic()
        if self._lapsed(lease, now):
            return
        lease.next_due = now + max(_RETRY_MIN, min(lease.ttl / 10, lease.remaining / 2))
        due = lease.queued = min(lease.next_due, lease.valid_until)
        self._push(due, lease)

    def _settle_heartbeat(self, group: HeartbeatGroup, failed: bool) -> None:
        if self._groups.get(group.keys[0]) is not group:
            return  # its last waiter left meanwhile
        shortest = min(w.ttl_ms for w in group.waiters.values()) / 3000.0
        group.period = shortest
        due = _clock.monotonic() + (max(_RETRY_MIN, shortest / 10) if failed else shortest)
        group.next_due = group.queued = due
        self._push(due, group)

    def _lapsed(self, lease: Lease, now: float) -> bool:
        """Whether `lease`'s validity has ended by `now`: then it is lost, whatever a renewal
        answered after that says (its holder ran unsure of it meanwhile)."""
        if lease.valid_until > now:
            return False
        self._lose(lease, "Redis could not be reached before the lease ran out")
        return True

    def _lose(self, lease: Lease, reason: str) -> None:
        self._leases.discard(lease)
        lease.queued = None
        lease.ended()
        if lease.releasing:
            return  # its release reports it (see `_release.release_until`)
        try:
            lease.owner.lease_lost(reason)
        except Exception:  # a holder's callback must never kill the keeper
            log.exception("aiolocks: lease-lost callback failed")

    def lose_all(self, reason: str) -> None:
        """Report every lease held lost, for `reason` (its client was closed: none can be
        renewed or released any more); a lease being released is its release's to report.
        A lease handed to the keeper later is lost at once, for the same reason."""
        self._stopped = reason
        for lease in list(self._leases):
            self._lose(lease, reason)

    async def aclose(self) -> None:
        if self._stopped is None:
            self._stopped = "the engine of its client stopped (its event loop ended)"
        self._leases.clear()
        self._groups.clear()
        self._heap.clear()
        tasks = [*self._batches, *([self._task] if self._task is not None else [])]
        await stop_tasks(tasks)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, *REDIS_ERRORS):
                await task  # (ended: its outcome read)
        self._task = None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
