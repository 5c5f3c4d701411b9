"""One renewal on the wire (`renew`): the script calls that renew some leases and heartbeat
some waiters, sent in one pipeline, and their replies read back per lease and per waiter.

A call carries up to `BATCH` entries (on Cluster, of one slot), so the calls per period
track the batches, not the leases. Every renewal is idempotent, so a pipeline left
unanswered for a while is sent again beside itself and the first answer is taken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import redis.exceptions
from redis.crc import key_slot

from .._base._errors import cancelling
from .._waiting._lot import Waiter
from ._lease import HeartbeatGroup, Lease
from ._renewbatch import OP, RENEW_BATCH, Entry, pack

if TYPE_CHECKING:
    from .._transport._autopipe import Staged

__all__ = [
    "BATCH",
    "Call",
    "Outcomes",
    "heartbeat_calls",
    "lease_calls",
    "read_replies",
    "renew",
    "send_hedged",
]

log = logging.getLogger("aiolocks")

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
    deadline = max(deadline, time.monotonic() + _LATE_MIN)  # (this task starts late)
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
        replies, sent_at = [exc] * len(calls), time.monotonic()
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
    next_try = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise failure or TimeoutError("no reply before the leases' validity ended")
            if now >= next_try:
                # Its outcome is read even if nobody waits for it any more, so a late
                # error is never logged as "never retrieved".
                call = asyncio.ensure_future(pipeline(staged))
                call.add_done_callback(_read_outcome)
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
                result = redis.exceptions.ResponseError(_text(result))
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


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _read_outcome(call: asyncio.Future[Any]) -> None:
    if not call.cancelled():
        call.exception()
