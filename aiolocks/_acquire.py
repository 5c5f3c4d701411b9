"""The one acquire skeleton every primitive uses: try script -> park -> re-try.

A primitive supplies a `Spec` (its keys and scripts); this module does the waiting,
subscription, heartbeats and the cancellation clean-up, so no primitive re-implements
them. Script conventions (see `_scripts/*.lua`):

- member = "<token>:<ttl_ms>:<tag>:<kind>", the acquisition's queue entry; tag names the
  caller's client (`WaitQueue.tag`): a grant to a waiter with the caller's tag is not
  published, as the caller wakes that waiter from the reply.
- acquire: KEYS = spec.keys, ARGV = member, 'try'|'wait', channel, *spec.args; returns
  {1, fence} granted, {0, wait_ms} queued, {-1, wait_ms} busy and not queued (wait_ms:
  until the first lease in the way ends, -1 unknown), {-2, value} refused: the stored
  configuration differs (e.g. a semaphore's limit), nothing changed.
- release: KEYS = spec.keys, ARGV = member, channel, *spec.args; withdraws the token
  whatever state it reached; returns {held, token, fence, ttl, token, fence, ttl, ...}
  with every grant it made.
- renew: KEYS = spec.renew_keys (the lease key, then the keys kept as long as the lease),
  ARGV = token, ttl_ms; returns 1 while still held.
- heartbeat: KEYS = spec.heartbeat_keys (the waiters key, then the keys kept as long as a
  waiter); see `_leases`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.exceptions

from . import _telemetry
from ._context import ClientContext
from ._leases import cancelling
from ._scripts import Script
from ._waitqueue import Waiter, Wake

__all__ = ["Grant", "Spec", "acquire", "completed", "release", "release_surely", "shielded"]

T = TypeVar("T")

# Clean-up after a failed or cancelled acquisition waits at most this long for Redis;
# past it, the server forgets the token by itself when its ttl ends.
CLEANUP_BOUND = 5.0
# Back-off between re-checks of a queued waiter while Redis cannot be reached.
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0
# What a server that restarts or fails over answers for a while: a queued waiter waits on.
_PASSING_OUTAGE = (
    redis.exceptions.ConnectionError,  # BusyLoadingError too: a restart loading its data
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # a Cluster node back but not yet serving its slots
    redis.exceptions.TryAgainError,  # a slot in the middle of a move
    redis.exceptions.ReadOnlyError,  # a demoted primary, before the client finds the new one
)

log = logging.getLogger("aiolocks")

GRANTED, QUEUED, BUSY, REFUSED = 1, 0, -1, -2


@dataclass(frozen=True, slots=True)
class Spec:
    """What a primitive instance gives the engine: its keys, channel and scripts."""

    name: str
    kind: str  # of its queue members: 'x' exclusive, 'r' / 'w' read / write side
    keys: tuple[bytes, ...]
    heartbeat_keys: tuple[bytes, ...]  # the waiters key, then the keys kept alive with it
    channel: bytes
    watch_key: bytes | None  # a key whose del/expired events mean "re-check"
    acquire: Script
    release: Script
    renew: Script
    renew_keys: tuple[bytes, ...]
    args: tuple[Any, ...] = ()
    # Builds the error for a REFUSED reply (given the stored value); primitives that store
    # configuration set it.
    refused: Callable[[int], Exception] | None = None
    # The instance's cumulative counts (`statistics()`), kept by `_telemetry`'s hooks.
    counters: _telemetry.Counters = field(default_factory=_telemetry.Counters, compare=False)


@dataclass(frozen=True, slots=True)
class Grant:
    """A successful acquisition: its fence, and when its lease started counting (monotonic)."""

    token: str
    fence: int
    granted_at: float


async def acquire(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    *,
    blocking: bool,
    deadline: float | None,
) -> Grant | None:
    """Acquire `spec` for `token`; None when not blocking and busy, or when `deadline` passed.

    Cancellation or an error at any point leaves nothing behind in Redis: a shielded,
    bounded clean-up withdraws the token and, if it had been granted, hands the
    primitive on.
    """
    waiter: Waiter | None = None
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    retained = False
    dirty = False  # the server may hold state for this token
    mode = "try"
    try:
        if blocking and context.notifier.watching(spec.channel):
            waiter = _park(context, spec, token, ttl_ms)
            await context.notifier.retain(spec.channel, spec.watch_key)
            retained = True
            mode = "wait"
        outage = _RETRY_MIN
        answered = False  # the server has answered this acquisition at least once
        while True:
            sent_at = time.monotonic()
            dirty = True
            try:
                reply = await _bounded(
                    context.run(spec.acquire, spec.keys, (member, mode, spec.channel, *spec.args)),
                    deadline,
                )
            except _PASSING_OUTAGE:
                if not answered or waiter is None or cancelling():
                    raise  # the first try: the caller learns Redis is unreachable
                # Queued already: a server that restarts or fails over must not end the
                # wait. Re-try after a back-off (or sooner, on a reconnect), until the
                # caller's own deadline.
                log.debug("aiolocks: re-check of %r failed; retrying", spec.name, exc_info=True)
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                wake = await waiter.sleep(_earliest(deadline, time.monotonic() + outage))
                outage = min(outage * 2, _RETRY_MAX)
                if wake is Wake.GRANTED:
                    assert waiter.fence is not None
                    dirty = False
                    return Grant(token, waiter.fence, waiter.granted_at)
                continue
            outage, answered = _RETRY_MIN, True
            status, value = int(reply[0]), int(reply[1])
            if len(reply) > 2:
                wake_granted(context, spec, reply, 2)  # others it let in, maybe local
            if status == GRANTED:
                dirty = False
                return Grant(token, value, sent_at)
            if status == REFUSED:
                dirty = mode == "wait"  # refused now, but an earlier call may have queued it
                assert spec.refused is not None, "a script refused without a reason"
                raise spec.refused(value)
            if waiter is not None and waiter.fence is not None:
                dirty = False
                return Grant(token, waiter.fence, waiter.granted_at)
            if status == BUSY:
                dirty = False
                if not blocking:
                    return None
            if waiter is None:
                waiter = _park(context, spec, token, ttl_ms)
                await _bounded(context.notifier.retain(spec.channel, spec.watch_key), deadline)
                retained = True
                mode = "wait"
                continue
            # Unknown (or a holder key without expiry, not set by us): wait a ttl, not a spin.
            waiter.lot.note_lease(value if value >= 0 else ttl_ms)
            wake = await waiter.sleep(deadline)
            if wake is Wake.GRANTED:
                assert waiter.fence is not None
                dirty = False
                return Grant(token, waiter.fence, waiter.granted_at)
            if wake is Wake.DEADLINE:
                return None
    except TimeoutError:
        return None  # `_bounded` ran out of time while Redis was slow: same as the deadline
    finally:
        if waiter is not None:
            context.waitqueue.remove(waiter)
            context.keeper.unwatch_waiter(spec.heartbeat_keys, waiter)
        if retained:
            context.notifier.release(spec.channel)
        if dirty:
            await shielded(lambda: release(context, spec, token, ttl_ms), CLEANUP_BOUND)


async def confirm(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, replicas: int, timeout_ms: int
) -> tuple[int, int]:
    """Re-run the acquire script for a granted `token` (a write: it re-arms the lease) and
    `WAIT` on the same connection: (acquire status, replicas that acknowledged).

    Replication is in order, so a replica that has this write also has the grant before
    it, whichever client made that grant (a hand-off is made by the releaser).
    """
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    reply, acked = await context.run_then_wait(
        spec.acquire, spec.keys, (member, "try", spec.channel, *spec.args), replicas, timeout_ms
    )
    return int(reply[0]), int(acked)


def _earliest(deadline: float | None, other: float) -> float:
    return other if deadline is None else min(deadline, other)


async def release(context: ClientContext, spec: Spec, token: str, ttl_ms: int) -> bool | None:
    """Run the release script for `token`; True if it held the primitive, False if not.

    A call cut off by a connection error is run once more; if that one finds the token not
    holding, the answer is None: the first call may have released it (its reply was lost)
    or the lease may have been lost, and only the caller's lease can tell which.
    When the script hands the primitive to a waiter of this same client, that waiter is
    woken here rather than by the pub/sub round trip.
    """
    reply, unsure = await release_reply(context, spec, token, ttl_ms)
    wake_granted(context, spec, reply, 1)
    _telemetry.on_handoff(spec, (len(reply) - 1) // 3)
    held = int(reply[0]) == 1
    return None if unsure and not held else held


async def release_reply(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, *extra: Any
) -> tuple[list[Any], bool]:
    """Run the release script for `token` (with `extra` arguments after the spec's), once, or
    once more after a connection error; returns its reply, and whether a first call was cut
    off (it may have done the work, and the reply is then the retry's)."""
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    args = (member, spec.channel, *spec.args, *extra)
    try:
        return await context.run(spec.release, spec.keys, args, retry=False), False
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return await context.run(spec.release, spec.keys, args, retry=False), True


def wake_granted(context: ClientContext, spec: Spec, reply: list[Any], start: int) -> None:
    """Wake the local waiters among the grants a script reported (token, fence, ttl triples
    from `reply[start]` on); the others are told by pub/sub."""
    lot = context.waitqueue.lot(spec.channel)
    for at in range(start, len(reply) - 2, 3):
        if lot is not None:
            lot.note_lease(int(reply[at + 2]))
        context.waitqueue.unpark(_text(reply[at]), int(reply[at + 1]))


async def release_surely(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int
) -> bool | None:
    """`release`, completed even if the caller is cancelled meanwhile.

    The fast path awaits the script directly (no extra task). If a cancellation interrupts
    it, the script is run again shielded: it is idempotent, so a release that did reach the
    server answers "not held" the second time and changes nothing. Then the cancellation
    is re-raised.
    """
    try:
        return await release(context, spec, token, ttl_ms)
    except asyncio.CancelledError:
        await shielded(lambda: release(context, spec, token, ttl_ms), CLEANUP_BOUND)
        raise


def _park(context: ClientContext, spec: Spec, token: str, ttl_ms: int) -> Waiter:
    waiter = context.waitqueue.park(spec.channel, token, ttl_ms, spec.kind)
    context.keeper.watch_waiter(spec.heartbeat_keys, waiter)
    return waiter


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _bounded(awaitable: Awaitable[T], deadline: float | None) -> T:
    if deadline is None:
        return await awaitable
    loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
    async with asyncio.timeout_at(loop_deadline):
        return await awaitable


async def shielded(call: Callable[[], Awaitable[T]], bound: float) -> T | None:
    """Run `call()` to completion even if the caller is cancelled meanwhile, for at most
    `bound` seconds; errors (the timeout included) give None. A cancellation of the
    caller is re-raised once the call is done."""

    async def bounded() -> T | None:
        try:
            return await asyncio.wait_for(call(), bound)
        except Exception:
            return None

    return await completed(bounded())


async def completed(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` (in a task of its own) to the end even if the caller is cancelled
    meanwhile; that cancellation is re-raised once it is done, and wins over its outcome.
    The caller's own CancelledError is re-raised, so that an anyio scope knows it as its own.
    """
    task = asyncio.ensure_future(awaitable)
    cancellation: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as caught:
            if not task.cancelled() and cancellation is None:
                cancellation = caught  # the caller's: never swallowed
        except BaseException:
            break  # the task's own error: result() raises it below
    if cancellation is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise cancellation
    return task.result()
