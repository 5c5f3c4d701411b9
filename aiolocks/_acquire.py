"""The one acquire skeleton every primitive uses: try script -> park -> re-try.

A primitive supplies a `Spec` (its keys and scripts); this module does the waiting,
subscription, heartbeats and the cancellation clean-up, so no primitive re-implements
them. Script conventions (see `_scripts/*.lua`):

- member = "<token>:<ttl_ms>:<tag>:<kind>", the acquisition's queue entry; tag names the
  caller's client (`WaitQueue.tag`): a grant to a waiter with the caller's tag is not
  published, as the caller wakes that waiter from the reply.
- acquire: KEYS = spec.keys, ARGV = member, 'try'|'wait', channel, *spec.args; returns
  {1, fence, grants...} granted, {0, wait_ms, floor, grants...} queued, {-1, wait_ms,
  floor, grants...} busy and not queued (wait_ms: until the first lease in the way ends,
  -1 unknown; floor: the name's fence floor, above every fence handed out before the call
  and below every later one: a grant of the token at or below it is stale), {-2, value}
  refused: the stored configuration differs (e.g. a semaphore's limit), nothing changed.
- release: KEYS = spec.keys, ARGV = member, channel, *spec.args; withdraws the token
  whatever state it reached; returns {held, token, fence, ttl, token, fence, ttl, ...}
  with every grant it made ({-1, pttl} for a mutex release with 'carry' that did not hold
  it and queued the carried members behind another holder: that lease's end).
- renew: KEYS = spec.renew_keys (the lease key, then the keys kept as long as the lease),
  ARGV = token, ttl_ms; returns 1 while still held.
- heartbeat: KEYS = spec.heartbeat_keys (the waiters key, then the keys kept as long as a
  waiter); see `_leases`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import _telemetry
from ._cancel import cancelling
from ._context import ClientContext
from ._errors import (
    AUTHENTICATION_ERRORS,
    CLUSTERDOWN_ERRORS,
    CONNECTION_ERRORS,
    INVALID_RESPONSE_ERRORS,
    NOPERMISSION_ERRORS,
    READONLY_ERRORS,
    REDIS_ERRORS,
    TIMEOUT_ERRORS,
    TRYAGAIN_ERRORS,
)
from ._leases import Lease, validity
from ._lot import Carry, Waiter, Wake
from ._scripts import Script

__all__ = [
    "Grant",
    "Miss",
    "Spec",
    "acquire",
    "completed",
    "release",
    "release_surely",
    "settled",
    "shielded",
    "unstopped",
    "withdraw",
]

T = TypeVar("T")

# Clean-up after a failed or cancelled acquisition (and a release interrupted by a
# cancellation) is awaited at most this long; it goes on in the background after that,
# for at most max(CLEANUP_BOUND, ttl): past the ttl the server forgets the token by itself.
CLEANUP_BOUND = 5.0
# How far past the caller's deadline its clean-up is awaited before it goes on in the
# background (`acquire(timeout=t)` returns within t + this + scheduling).
GRACE = 0.05
# One try (blocking=False) waits for the server at most the client's socket_timeout, or
# this long when it has none; past it the call raises ServerUnavailable.
TRY_BOUND = 2.0
# A grant whose lease, counted from a moment known to precede it, has less than this part
# of its ttl left is confirmed with the server before it is reported (see _Late).
_CONFIRM_BELOW, _MAX_CONFIRMS = 0.5, 3
# How long a task that asks for a carrying primitive (a mutex) while another task of the
# same client holds it waits for that holder's release to queue it, before it queues itself.
CARRY_WAIT = 0.002
# Back-off between re-checks of a queued waiter while Redis cannot be reached.
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0
# What a server that restarts or fails over answers for a while: a queued waiter waits on.
_PASSING_OUTAGE = (
    *CONNECTION_ERRORS,  # BusyLoadingError too: a restart loading its data
    *TIMEOUT_ERRORS,
    *CLUSTERDOWN_ERRORS,  # a Cluster node back but not yet serving its slots
    *TRYAGAIN_ERRORS,  # a slot in the middle of a move
    *READONLY_ERRORS,  # a demoted primary, before the client finds the new one
)

# A call cut off by these may or may not have run on the server.
_LOST_REPLY = (*CONNECTION_ERRORS, *TIMEOUT_ERRORS)
_NOT_SUBSCRIBED: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)
_UNANSWERED: tuple[type[Exception], ...] = (*_LOST_REPLY, *INVALID_RESPONSE_ERRORS, OSError)

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
    # Several holders at once (a semaphore, a read-write lock): a grant ends no lease.
    shared: bool = False
    # Builds the error for a REFUSED reply (given the stored value); primitives that store
    # configuration set it.
    refused: Callable[[int], Exception] | None = None
    # Its release script can queue this client's later arrivals (`WaitQueue.defer`): a task
    # that asks while another task of the client holds it waits for that holder's release
    # to queue it, instead of a call of its own (up to CARRY_WAIT).
    carries: bool = False
    # The instance's cumulative counts (`statistics()`), kept by `_telemetry`'s hooks.
    counters: _telemetry.Counters = field(default_factory=_telemetry.Counters, compare=False)


@dataclass(frozen=True, slots=True)
class Grant:
    """A successful acquisition: its fence, and when its lease started counting (monotonic)."""

    token: str
    fence: int
    granted_at: float


@dataclass(frozen=True, slots=True)
class Miss:
    """Why an acquisition ended without the primitive: what the caller's error tells."""

    unanswered: bool  # the server had not answered the call in flight when time ran out
    wait_ms: int = -1  # the last answer: until the first lease in the way ends (-1 unknown)
    failure: str | None = None  # the last re-check's connection error, if it failed

    def situation(self) -> str:
        """The situation, in words, for `LockTimeout`'s message."""
        if self.unanswered:
            return "Redis did not answer in time (a stalled server or link, not contention)"
        if self.failure is not None:
            return f"Redis could not be reached at the last re-check ({self.failure})"
        if self.wait_ms >= 0:
            return (
                "held by another holder (the first lease in the way had "
                f"{self.wait_ms} ms left at the last check)"
            )
        return "held by another holder"


async def acquire(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    *,
    blocking: bool,
    deadline: float | None,
    respec: Callable[[], Spec] | None = None,
) -> Grant | Miss:
    """Acquire `spec` for `token`; a `Miss` when not blocking and busy, or when `deadline`
    passed (blocking or not: a deadline bounds the whole call, Redis round trips included).

    Cancellation or an error at any point leaves nothing behind in Redis: a shielded,
    bounded clean-up withdraws the token and, if it had been granted, hands the
    primitive on; past the deadline it goes on in the background. `respec` gives the
    instance's current spec: a refusal by a stale one (e.g. `set_limit()` meanwhile) is
    retried with it.
    """
    waiter: Waiter | None = None
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    retained = False
    dirty = False  # the server may hold state for this token
    mode = "try"
    miss = Miss(unanswered=False)
    late = _Late(ttl_ms)
    unreachable = False
    call = True  # the next step is a call to the acquire script (else: sleep first)
    carrying = False  # waiting for a local holder's release to carry it
    in_flight: asyncio.Future[Any] | None = None  # its own call, while unanswered
    try:
        if blocking and context.notifier.watching(spec.channel):
            waiter = _park(context, spec, token, ttl_ms, deadline)
            retained = await _retain(context, spec, deadline)
            mode = "wait"
        outage = _RETRY_MIN
        answered = False  # the server has answered this acquisition at least once
        may_defer = waiter is not None
        while True:
            if may_defer:
                may_defer = False  # once per acquisition, when it parks
                assert waiter is not None
                if context.waitqueue.defer(waiter):
                    carrying = True
                    wake = await _carried(context, waiter)
                    carrying = False
                    if waiter.carry is Carry.TAKEN:
                        dirty = True  # a release call may have queued it
                    if wake is Wake.GRANTED and not late.confirm(waiter.granted_at, waiter):
                        assert waiter.fence is not None
                        dirty = False
                        return _granted(context, spec, token, waiter.fence, waiter.granted_at)
                    if wake is Wake.DEADLINE:
                        return miss
            if not call:
                call = True
                assert waiter is not None
                wake = await waiter.sleep()
                if wake is Wake.GRANTED:
                    if late.confirm(waiter.granted_at, waiter):
                        continue
                    assert waiter.fence is not None
                    dirty = False
                    return _granted(context, spec, token, waiter.fence, waiter.granted_at)
                if wake is Wake.DEADLINE:
                    return miss
                continue
            sent_at = time.monotonic()
            if waiter is not None and mode == "wait" and waiter.queued_at == 0.0:
                waiter.still_queued(sent_at)  # unknown to the server before this call
            dirty = True
            written: list[float] = []  # when the call went out (behind a burst: later)
            try:
                pending = context.run(
                    spec.acquire,
                    spec.keys,
                    (member, mode, spec.channel, *spec.args),
                    sent=written.append,
                )
                in_flight = unstopped(context, pending)
                shielded_call = pending if in_flight is None else asyncio.shield(in_flight)
                reply = await _bounded(shielded_call, deadline)
                in_flight = None
            except (*AUTHENTICATION_ERRORS, *NOPERMISSION_ERRORS):
                dirty = answered  # refused before it ran: nothing changed by this call
                raise
            except _PASSING_OUTAGE as exc:
                if not answered or waiter is None or cancelling():
                    raise  # the first try: the caller learns Redis is unreachable
                # Queued already: a server that restarts or fails over must not end the
                # wait. Re-try after a back-off (or sooner, on a reconnect), until the
                # caller's own deadline.
                log.debug("aiolocks: re-check of %r failed; retrying", spec.name, exc_info=True)
                miss = Miss(unanswered=False, wait_ms=miss.wait_ms, failure=repr(exc))
                if deadline is not None and time.monotonic() >= deadline:
                    return miss
                wake = await waiter.sleep(time.monotonic() + outage)
                outage = min(outage * 2, _RETRY_MAX)
                if wake is Wake.GRANTED:
                    if late.confirm(waiter.granted_at, waiter):
                        continue
                    assert waiter.fence is not None
                    dirty = False
                    return _granted(context, spec, token, waiter.fence, waiter.granted_at)
                continue
            outage, answered = _RETRY_MIN, True
            sent_at = written[0] if written else sent_at
            status, value = int(reply[0]), int(reply[1])
            grants = 2 if status in (GRANTED, REFUSED) else 3  # queued, busy: then the floor
            if waiter is not None and grants == 3:
                waiter.not_holding(int(reply[2]))  # drops a grant this answer overtook
            if len(reply) > grants:
                wake_granted(context, spec, reply, grants, sent_at)  # others, maybe local
            if status == GRANTED:
                if late.confirm(sent_at, waiter):
                    continue  # answered after a stall: re-run (it re-arms the lease)
                dirty = False
                return _granted(context, spec, token, value, sent_at)
            if status == REFUSED:
                fresh = None if respec is None else respec()
                if fresh is not None and fresh.args != spec.args:
                    spec = fresh  # reconfigured meanwhile (set_limit): go on with the new one
                    continue
                dirty = mode == "wait"  # refused now, but an earlier call may have queued it
                assert spec.refused is not None, "a script refused without a reason"
                raise spec.refused(value)
            miss = Miss(unanswered=False, wait_ms=value)
            if waiter is not None:
                if status == QUEUED:
                    waiter.still_queued(sent_at)
                if waiter.fence is not None:
                    if late.confirm(waiter.granted_at, waiter):
                        continue
                    dirty = False
                    return _granted(context, spec, token, waiter.fence, waiter.granted_at)
            if status == BUSY:
                dirty = False
                if not blocking:
                    return miss
            if waiter is None:
                waiter = _park(context, spec, token, ttl_ms, deadline)
                retained = await _retain(context, spec, deadline)
                mode = "wait"
                may_defer = True
                continue
            # Unknown (or a holder key without expiry, not set by us): wait a ttl, not a spin.
            waiter.lot.note_lease(value if value >= 0 else ttl_ms)
            call = False  # sleep, at the top of the loop
    except TimeoutError:
        # `_bounded` ran out of time while Redis was slow: same as the deadline.
        return Miss(unanswered=True, wait_ms=miss.wait_ms)
    except _UNANSWERED:
        unreachable = True  # the caller learns it now; the clean-up can only wait for Redis
        raise
    finally:
        if waiter is not None:
            if carrying and waiter.carry is Carry.TAKEN:
                dirty = True  # interrupted while a release that carries it was in flight
            context.waitqueue.remove(waiter)
            context.keeper.unwatch_waiter(spec.heartbeat_keys, waiter)
        if retained:
            context.notifier.release(spec.channel)
        if dirty:
            if context.autopipe is None:
                # Its clean-up may overtake, on another connection, a call that grants or
                # queues it (through the auto-pipeline, one connection keeps their order): a
                # grant read for it from now on is handed on. Past the ttl (and the bound of
                # a clean-up) any entry such a call left has been purged.
                within = ttl_ms / 1000.0 + CLEANUP_BOUND
                hand_on = functools.partial(_background_release, context, spec, token, ttl_ms)
                context.waitqueue.depart(token, within, hand_on)
            # Awaited until the caller's deadline (a little past it), or, without one, up to
            # CLEANUP_BOUND; past that it goes on in the background.
            until = None if deadline is None else max(deadline, time.monotonic()) + GRACE
            if unreachable:
                until = time.monotonic() + GRACE
            after = None
            if in_flight is not None:
                after = _answered(context, spec, in_flight, sent_at, written)
            await withdraw(context, spec, token, ttl_ms, until, after=after)


def unstopped(context: ClientContext, call: Awaitable[T]) -> asyncio.Future[T] | None:
    """`call` (a script call that may grant or queue a token) in a task of its own, to await
    shielded: leaving (a cancellation, a deadline) stops the wait, not the call, and the
    token's clean-up is sent after its reply (`withdraw`'s `after`, `settled`).
    Only where the clean-up would not follow it on one connection (auto-pipelining off,
    Cluster: each call on a pooled connection, where the clean-up could overtake it and find
    nothing, and the call then grant or queue the departed token for its ttl). None through
    the auto-pipeline: `call` is awaited as it is."""
    if context.autopipe is not None:
        return None
    return asyncio.ensure_future(call)


async def settled(in_flight: asyncio.Future[T]) -> T | None:
    """The reply of a call `unstopped` left in flight, once it came; None if it failed (a
    lost reply: the clean-up sent next withdraws whatever it did)."""
    try:
        return await in_flight
    except Exception:
        return None


async def _answered(
    context: ClientContext,
    spec: Spec,
    in_flight: asyncio.Future[Any],
    sent_at: float,
    written: list[float],
) -> None:
    """Wait for the acquire call a departed acquisition left in flight, and wake the local
    waiters its reply granted (`written`: when the call went out, if it was told)."""
    reply = await settled(in_flight)
    if reply is None:
        return
    grants = 2 if int(reply[0]) in (GRANTED, REFUSED) else 3
    if len(reply) > grants:
        wake_granted(context, spec, reply, grants, written[0] if written else sent_at)


def _granted(context: ClientContext, spec: Spec, token: str, fence: int, at: float) -> Grant:
    if spec.carries:
        context.waitqueue.note_held(spec.channel, token)
    return Grant(token, fence, at)


async def _carried(context: ClientContext, waiter: Waiter) -> Wake:
    """Wait for a local holder's release to carry `waiter` (`WaitQueue.defer`): GRANTED,
    DEADLINE (the caller's), or RECHECK: the waiter is to call on its own now (not taken
    within CARRY_WAIT, a re-check, the lot's timer). Once a release has taken it, it waits
    for that release's answer: a grant, or, queued on the server, its grant as any waiter's.
    """
    until = time.monotonic() + CARRY_WAIT
    while True:
        wake = await waiter.sleep(until if waiter.carry is Carry.WAITING else None)
        if wake is Wake.UNTIL and waiter.carry is Carry.TAKEN:
            continue  # taken just as the wait ran out: its release's answer wakes it
        context.waitqueue.undefer(waiter)  # it calls now (no-op if a release took it)
        return wake if wake in (Wake.GRANTED, Wake.DEADLINE) else Wake.RECHECK


def late_grant(granted_at: float, ttl_ms: int) -> bool:
    """A grant whose lease, counted from `granted_at`, has less than half its validity left:
    to be confirmed with the server before it is reported (see `_Late`)."""
    return _Late(ttl_ms).confirm(granted_at, None)


class _Late:
    """Decides whether a grant is reported or first confirmed with the server.

    A grant's lease is counted from a moment known to precede it (the sending of a call
    that found the token not yet granted, or of the granting call). When the news came late
    (a stalled loop, a slow link) that leaves little or no validity: the acquire script is
    then re-run, which re-arms the lease if it is still the token's (it is idempotent) or
    queues it again if the server already ended it. Up to 3 confirmations per acquisition:
    a server that answers slower than that (round trips near the ttl) gets the grant with
    what validity is left, and the keeper renews at once, or reports the loss if none is.
    """

    __slots__ = ("confirms", "ttl")

    def __init__(self, ttl_ms: int) -> None:
        self.ttl = ttl_ms / 1000.0
        self.confirms = 0

    def confirm(self, granted_at: float, waiter: Waiter | None) -> bool:
        remaining = validity(granted_at, self.ttl) - time.monotonic()
        if remaining >= self.ttl * _CONFIRM_BELOW:
            return False
        if self.confirms >= _MAX_CONFIRMS:
            return False  # a server slower than the ttl: no loop of calls; the keeper judges
        self.confirms += 1
        if waiter is not None:
            waiter.forget_grant()
        return True


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


async def release(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, *, carry: bool = False
) -> bool | None:
    """Run the release script for `token`; True if it held the primitive, False if not.

    A call cut off by a connection error is run once more; if that one finds the token not
    holding, the answer is None: the first call may have released it (its reply was lost)
    or the lease may have been lost, and only the caller's lease can tell which.
    When the script hands the primitive to a waiter of this same client, that waiter is
    woken here rather than by the pub/sub round trip. `carry` (a holder's release of a
    carrying primitive): the call also queues the local waiters deferred behind it.
    """
    carried = context.waitqueue.take_deferred(spec.channel) if carry and spec.carries else []
    extra = ("carry", *(waiter.member for waiter in carried)) if carried else ()
    sent_at = time.monotonic()
    written: list[float] = []  # when the call went out (behind a burst: later)
    reply, unsure = await release_reply(context, spec, token, ttl_ms, *extra, sent=written.append)
    sent_at = written[0] if written else sent_at
    wake_granted(context, spec, reply, 1, sent_at)
    status = int(reply[0])
    for waiter in carried:
        if waiter.fence is None:
            waiter.still_queued(sent_at)  # queued by this release: it sleeps on, unwoken
            if status == BUSY:  # behind another holder (the releaser had lost it)
                pttl = int(reply[1])
                waiter.lot.note_lease(pttl if pttl >= 0 else waiter.ttl_ms)
    if status == BUSY:
        reply = reply[:1]  # no grants, only that holder's lease
    _telemetry.on_handoff(spec, (len(reply) - 1) // 3)  # a carried grant is one too
    held = status == 1
    return None if unsure and not held else held


async def release_reply(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    *extra: Any,
    sent: Callable[[float], None] | None = None,
) -> tuple[list[Any], bool]:
    """Run the release script for `token` (with `extra` arguments after the spec's), once, or
    once more after a connection error; returns its reply, and whether a first call was cut
    off (it may have done the work, and the reply is then the retry's). `sent`: as for
    `ClientContext.run`.

    The retry carries nobody: the carried waiters were told to re-check when the first
    reply was lost (`granting`), and queue or find their grant themselves. Carried again,
    one that the first call granted and that has since released would be granted anew.
    """
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    args = (member, spec.channel, *spec.args, *extra)
    context.waitqueue.note_released(spec.channel, token)
    try:
        return await granting(context, spec, spec.release, args, sent=sent), False
    except _LOST_REPLY:
        if extra[:1] == ("carry",):
            args = (member, spec.channel, *spec.args)
        return await granting(context, spec, spec.release, args, sent=sent), True


async def granting(
    context: ClientContext,
    spec: Spec,
    script: Script,
    args: tuple[Any, ...],
    *,
    retry: bool = False,
    sent: Callable[[float], None] | None = None,
) -> list[Any]:
    """Run a script that may grant to waiters of this client (a release, `set_limit`), once,
    or (`retry`) once more after a connection error.

    Such grants are not published: this client learns them from the reply. If the reply is
    lost (a dropped connection, a cancellation), every local waiter of the name re-checks
    at once, so one the script made owner learns it now rather than at its next heartbeat
    (the acquire script answers "granted" to an owner).
    """
    try:
        reply: list[Any] = await context.run(script, spec.keys, args, retry=False, sent=sent)
        return reply
    except BaseException as exc:
        context.waitqueue.recheck_all(spec.channel)
        if not retry or not isinstance(exc, _LOST_REPLY):
            raise
    return await granting(context, spec, script, args)


def wake_granted(
    context: ClientContext, spec: Spec, reply: list[Any], start: int, sent_at: float
) -> None:
    """Wake the local waiters among the grants a script reported (token, fence, ttl triples
    from `reply[start]` on); the others are told by pub/sub. `sent_at`: when the script call
    was sent, a moment that precedes its grants."""
    lot = context.waitqueue.lot(spec.channel)
    for at in range(start, len(reply) - 2, 3):
        token, fence = _text(reply[at]), int(reply[at + 1])
        if context.waitqueue.stale(token, fence):
            continue  # ended since: a later answer found the token not holding
        if lot is not None:
            lot.note_lease(int(reply[at + 2]), grant=True)
        context.waitqueue.unpark(token, fence, sent_at, spec.channel)


async def release_surely(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, until: float | None = None
) -> bool | None:
    """`release`, completed even if the caller is cancelled meanwhile.

    The fast path awaits the script directly (no extra task). If a cancellation interrupts
    it, the script is run again (it is idempotent: a release that did reach the server
    answers "not held" the second time and changes nothing), awaited until `until` (or
    CLEANUP_BOUND) and then left to finish in the background; the cancellation is then
    re-raised.
    """
    try:
        return await release(context, spec, token, ttl_ms, carry=True)
    except asyncio.CancelledError:
        await withdraw(context, spec, token, ttl_ms, until)
        raise


class Unanswered:
    """The marker `release_until` returns when Redis did not answer in time."""


UNANSWERED = Unanswered()


async def release_until(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    until: float,
    call: Callable[[], Awaitable[bool | None]] | None = None,
    lease: Lease | None = None,
) -> bool | Unanswered | None:
    """`release_surely`, waited for until the monotonic time `until` at most (a lease's
    validity): past it the answer is UNANSWERED and the release goes on in the background.
    `call` replaces the release of `spec` (a multi-lock releases several).

    With `lease` (still held by the keeper), the keeper goes on renewing it until the
    release is answered, and the wait follows its validity as renewals move it: a release
    queued behind a burst (more calls than the link carries at once) keeps its lease and
    is answered however long it waits; only a Redis that answers nothing, renewals
    included, runs the validity out. A loss the keeper finds meanwhile is reported by the
    release's answer (or by its validity ending), not by the keeper."""
    first = release(context, spec, token, ttl_ms, carry=True) if call is None else call()
    if lease is not None:
        lease.on_lost = _told_by_the_release
    bound: _ValidityBound | None = None
    try:
        async with asyncio.timeout(None) as scope:
            bound = _ValidityBound(scope, until, lease)
            try:
                return await first
            finally:
                bound.cancel()
                if lease is not None:
                    context.keeper.drop(lease)
    except TimeoutError:
        await withdraw(context, spec, token, ttl_ms, time.monotonic(), call)
        return UNANSWERED
    except asyncio.CancelledError:
        end = until if bound is None else bound.end()
        await withdraw(context, spec, token, ttl_ms, max(end, time.monotonic() + GRACE), call)
        raise


def _told_by_the_release(reason: str) -> None:
    """A lease being released is not reported lost by the keeper (see `release_until`)."""


class _ValidityBound:
    """Expires a timeout scope at `until`, or, given a lease, when its validity ends,
    following it as the keeper moves it later: one timer, re-armed once per renewal at most."""

    __slots__ = ("handle", "lease", "scope", "until")

    def __init__(self, scope: asyncio.Timeout, until: float, lease: Lease | None) -> None:
        self.scope = scope
        self.until = until
        self.lease = lease
        self.handle = self._arm()

    def end(self) -> float:
        return self.until if self.lease is None else max(self.until, self.lease.valid_until)

    def _arm(self) -> asyncio.TimerHandle:
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (self.end() - time.monotonic()), self._due)

    def _due(self) -> None:
        if self.end() > time.monotonic():
            self.handle = self._arm()  # renewed meanwhile
        else:
            self.scope.reschedule(asyncio.get_running_loop().time())

    def cancel(self) -> None:
        self.handle.cancel()


async def withdraw(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    until: float | None,
    call: Callable[[], Awaitable[Any]] | None = None,
    *,
    after: Awaitable[Any] | None = None,
) -> bool:
    """Run the release script for `token` in a task of its own that outlives the caller:
    awaited (shielded from the caller's cancellation, which is re-raised afterwards) until
    the monotonic time `until`, or for CLEANUP_BOUND when None. True if it finished by then;
    otherwise it goes on in the background, for at most max(CLEANUP_BOUND, ttl) (past the
    ttl the server has forgotten the token by itself), and a failure is logged. `after`:
    awaited first, in that task, for at most as long (the reply of the token's own call in
    flight, see `_answered`; past it, that call is abandoned and the release sent)."""
    task = _background_release(context, spec, token, ttl_ms, call, after)
    wait = CLEANUP_BOUND if until is None else max(0.0, until - time.monotonic())
    if not task.done():
        await completed(asyncio.wait((task,), timeout=wait))
    return task.done()


def _background_release(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    call: Callable[[], Awaitable[Any]] | None = None,
    after: Awaitable[Any] | None = None,
) -> asyncio.Future[None]:
    """Start `call` (by default the release script for `token`) in a background task that
    retries it while the server cannot be reached, for at most max(CLEANUP_BOUND, ttl);
    after `after`, if given (awaited for at most as long)."""
    bound = max(CLEANUP_BOUND, ttl_ms / 1000.0)
    if call is None:
        call = functools.partial(release, context, spec, token, ttl_ms)
    task = asyncio.ensure_future(_withdraw(call, spec.name, token, bound, after))
    for running in (_BACKGROUND, context.cleanups):
        running.add(task)
        task.add_done_callback(running.discard)
    return task


async def _withdraw(
    call: Callable[[], Awaitable[Any]],
    name: str,
    token: str,
    bound: float,
    after: Awaitable[Any] | None = None,
) -> None:
    """Run `call` (the release of `token`), trying again (with a back-off) while the server
    cannot be reached, for at most `bound` seconds; after `after`, awaited as long at most."""
    if after is not None:
        try:
            await asyncio.wait_for(after, bound)
        except TimeoutError:
            log.debug("aiolocks: a call of %r (token %s) unanswered; cleaning up", name, token)
    give_up = time.monotonic() + bound
    delay = _RETRY_MIN
    while True:
        try:
            await asyncio.wait_for(call(), give_up - time.monotonic())
            return
        except asyncio.CancelledError:
            raise  # the loop is shutting down
        except Exception as exc:
            if cancelling():
                # The cancellation met a connect or a socket and came out of redis-py as a
                # connection error: stop here, or the loop's end waits out the whole bound.
                raise asyncio.CancelledError from exc
            outage = isinstance(exc, _PASSING_OUTAGE) and not isinstance(exc, AUTHENTICATION_ERRORS)
            if not outage or time.monotonic() + delay >= give_up:
                log.warning(
                    "aiolocks: clean-up of %r (token %s) not confirmed (%r); the server "
                    "forgets the token when its ttl ends",
                    name,
                    token,
                    exc,
                )
                return
        await asyncio.sleep(delay)  # an outage back-off, as a queued waiter's re-check
        delay = min(delay * 2, _RETRY_MAX)


# Clean-ups left to finish in the background (a reference, so they are not collected).
_BACKGROUND: set[asyncio.Future[None]] = set()


def _park(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, deadline: float | None
) -> Waiter:
    waiter = context.waitqueue.park(
        spec.channel, token, ttl_ms, spec.kind, spec.shared, spec.carries, deadline
    )
    context.keeper.watch_waiter(spec.heartbeat_keys, waiter)
    return waiter


async def _retain(context: ClientContext, spec: Spec, deadline: float | None) -> bool:
    """Subscribe (`Notifier.retain`) for a parked waiter; False when it holds no reference.

    The notifier tolerates a failed subscription (the waiter wakes on its timer); a failure
    of what it asks the server first (`CONFIG GET`, once per client) is tolerated the same
    way: the server has answered this acquisition, and one lost command must not end it.
    The next waiter asks again.
    """
    try:
        await _bounded(context.notifier.retain(spec.channel, spec.watch_key), deadline)
    except TimeoutError:
        raise  # the caller's deadline (a builtin TimeoutError is an OSError too)
    except (*AUTHENTICATION_ERRORS, *NOPERMISSION_ERRORS):
        raise
    except _NOT_SUBSCRIBED as exc:
        log.debug("aiolocks: no subscription for %r (%r); waiting on its timer", spec.name, exc)
        return False
    return True


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


async def answered_by(awaitable: Awaitable[T], until: float | None) -> T | Unanswered:
    """`completed`, waited for until the monotonic time `until` at most (a lease's
    validity): past it the answer is UNANSWERED and the call goes on in the background
    (a cancelled caller also leaves it running: it completes either way)."""
    if until is None:
        return await completed(awaitable)
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
    except BaseException:
        task.add_done_callback(_log_failure)
        raise
    if task in done:
        return task.result()
    task.add_done_callback(_log_failure)
    return UNANSWERED


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("aiolocks: a release left to finish failed: %r", task.exception())


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
