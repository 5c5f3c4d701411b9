"""The one acquisition every primitive runs: try its script, park, re-try until granted.

A primitive supplies a `Spec` (`_spec`); `acquire` runs an `_Acquisition` through a few
states, one method each, so no primitive re-implements waiting, subscription, heartbeats
or the clean-up:

    start ─(blocking, channel watched here)─> PARK        (else TRY)
    TRY     call the acquire script ('try'; 'wait' once parked: it queues the token)
            ─granted─> done        ─taken, not blocking─> done (Miss)
            ─queued/taken─> PARK (not parked yet) or SLEEP
            ─Redis unreachable, parked and answered before─> OUTAGE
            ─reconfigured meanwhile (a stale spec refused)─> TRY
    PARK    join the local queue (heartbeats), subscribe to the channel ─> TRY
    SLEEP   wait for a grant, a re-check hint, the lot's lease timer or the deadline
            ─granted─> done    ─deadline─> done (Miss)    ─else─> TRY
    OUTAGE  past the deadline: done (Miss); else a back-off ─granted─> done  ─else─> TRY

"granted ─> done" is "─> TRY" instead for a grant learnt too late to trust its lease
(`LateGrants`, below: the script re-run confirms it). However it ends (a grant, a miss,
an error, a cancellation), `_Acquisition.leave` takes the waiter out of the local queue
and, if the server may hold state for the token, withdraws it (`_release.withdraw`).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

from .._base import _clock
from .._base._errors import (
    AUTHENTICATION_ERRORS,
    INVALID_RESPONSE_ERRORS,
    NOPERMISSION_ERRORS,
    REDIS_ERRORS,
    cancelling,
)
from .._base._spec import (
    LOST_REPLY,
    PASSING_OUTAGE,
    RETRY_MAX,
    RETRY_MIN,
    Grant,
    Miss,
    Spec,
)
from .._leases._keeper import validity
from .._waiting._waitqueue import Waiter, Wake
from ._context import ClientContext
from ._release import (
    CLEANUP_BOUND,
    GRACE,
    Granted,
    InFlight,
    background_release,
    bounded,
    granted_in,
    wake_granted,
    withdraw,
)

__all__ = [
    "TRY_BOUND",
    "AcquireReply",
    "LateGrants",
    "Status",
    "acquire",
    "confirm",
    "late_grant",
]

# One try (blocking=False) waits for the server at most the client's socket_timeout, or
# this long when it has none; past it the call raises ServerUnavailable.
TRY_BOUND = 2.0

_NOT_SUBSCRIBED: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError)
_UNANSWERED: tuple[type[Exception], ...] = (*LOST_REPLY, *INVALID_RESPONSE_ERRORS, OSError)

# An acquisition's miss before any answer.
_NOT_YET = Miss(unanswered=False)

log = logging.getLogger("aiolocks")


class Status(enum.IntEnum):
    """The acquire script's status (the first element of its reply)."""

    GRANTED = 1  # the token holds it (also when it already did: the script is idempotent)
    QUEUED = 0  # a 'wait' call: queued behind the leases in the way
    TAKEN = -1  # held by others, and the token not queued (a 'try' call)
    REFUSED = -2  # the stored configuration differs (e.g. a semaphore's limit): nothing changed


_STATUSES = {status.value: status for status in Status}


class AcquireReply(NamedTuple):
    """Every acquire script's reply, decoded: {GRANTED, fence, grants...}, {QUEUED or TAKEN,
    wait_ms, floor, grants...}, {REFUSED, stored}; grants: those the call made to others.
    A mutex taken free answers its fence alone, an integer (mutex_acquire.lua)."""

    status: Status
    fence: int = 0  # GRANTED: the token's fence
    wait_ms: int = -1  # QUEUED, TAKEN: until the first lease in the way ends (-1 unknown)
    # QUEUED, TAKEN: the name's fence floor, above every fence handed out before the call
    # and below every later one (a grant of the token at or below it is stale)
    floor: int | None = None
    stored: int = 0  # REFUSED: the stored value the script refused the call's against
    grants: tuple[Granted, ...] = ()

    @classmethod
    def decode(cls, reply: Sequence[Any] | int) -> AcquireReply:
        if isinstance(reply, int):
            return cls(Status.GRANTED, reply)
        status = _STATUSES[int(reply[0])]
        if status is Status.GRANTED:
            return cls(status, int(reply[1]), grants=granted_in(reply, 2))
        if status is Status.REFUSED:
            return cls(status, stored=int(reply[1]))
        return cls(status, 0, int(reply[1]), int(reply[2]), grants=granted_in(reply, 3))


def acquire(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    *,
    blocking: bool,
    deadline: float | None,
    respec: Callable[[], Spec] | None = None,
) -> Coroutine[Any, Any, Grant | Miss]:
    """Acquire `spec` for `token` (the coroutine that does it, made here); a `Miss` when
    not blocking and busy, or when `deadline` passed (blocking or not: a deadline bounds
    the whole call, Redis round trips included).

    Cancellation or an error at any point leaves nothing behind in Redis: a shielded,
    bounded clean-up withdraws the token and, if it had been granted, hands the
    primitive on; past the deadline it goes on in the background. `respec` gives the
    instance's current spec: a refusal by a stale one (e.g. `set_limit()` meanwhile) is
    retried with it.
    """
    member = context.waitqueue.member(token, ttl_ms, spec.side)
    late = LateGrants(ttl_ms)
    return _Acquisition(
        context, spec, respec, token, ttl_ms, blocking, deadline, member, late
    ).run()


class _State(enum.Enum):
    TRY = "try"
    PARK = "park"
    SLEEP = "sleep"
    OUTAGE = "outage"


TRY, PARK, SLEEP, OUTAGE = _State
# What a state leads to: the next state, or how the acquisition ends.
_Next: TypeAlias = "_State | Grant | Miss"


@dataclass(eq=False, slots=True)
class _Acquisition:
    """One call of `acquire`: what it has learnt so far, and one method per state."""

    context: ClientContext
    spec: Spec  # the instance's, renewed by `respec` when a stale one is refused
    respec: Callable[[], Spec] | None
    token: str
    ttl_ms: int
    blocking: bool
    deadline: float | None
    member: str  # its queue entry
    late: LateGrants
    waiter: Waiter | None = None  # parked: its place in the local queue
    subscribed: bool = False  # it holds a reference on the channel's subscription
    on_server: bool = False  # the server may hold state for this token (queued, granted)
    heard_from: bool = False  # the server answered it once: an outage is waited out now
    unanswered: bool = False  # it ends as Redis left a call unanswered: a short clean-up
    backoff: float = RETRY_MIN  # the next wait while Redis cannot be reached
    miss: Miss = _NOT_YET  # what it ends with if time runs out now
    # Its last acquire call: when it was made, when it went out (behind a burst: later)
    # and, while unanswered, the call itself (`InFlight`).
    sent_at: float = 0.0
    calls: int = 0  # acquire calls made (a grant to the first: see `Grant.alone`)
    written: list[float] = field(default_factory=list)
    in_flight: InFlight[list[Any]] | None = None

    async def run(self) -> Grant | Miss:
        """The state diagram of the module docstring, then `leave`."""
        try:
            step: _Next = PARK if self.parks_first() else TRY
            while isinstance(step, _State):
                if step is TRY:
                    step = await self.try_script()
                elif step is PARK:
                    step = await self.park()
                elif step is SLEEP:
                    step = self.woken(await self.parked().sleep())
                else:  # OUTAGE
                    step = await self.outage()
            return step  # a Grant or a Miss
        except TimeoutError:
            # `bounded` ran out of time while Redis was slow: same as the deadline.
            return Miss(unanswered=True, wait_ms=self.miss.wait_ms)
        except _UNANSWERED:
            self.unanswered = True  # the caller learns it now; the clean-up can only wait
            raise
        finally:
            if (withdrawal := self.leave()) is not None:
                await withdrawal

    def parks_first(self) -> bool:
        """Blocking, on a channel this client already watches: contended, most likely, so it
        parks before its first call, which then queues it."""
        return self.blocking and self.context.notifier.watching(self.spec.channel)

    async def try_script(self) -> _Next:
        """TRY: run the acquire script and go by its answer. The call is awaited until the
        deadline; one that may grant or queue the token is left to finish if the caller
        leaves (`InFlight`)."""
        context, spec, waiter = self.context, self.spec, self.waiter
        self.sent_at = _clock.monotonic()
        if waiter is not None and waiter.queued_at == 0.0:
            waiter.still_queued(self.sent_at)  # unknown to the server before this call
        self.on_server = True
        self.calls += 1
        written: list[float] = []
        self.written = written
        mode = "try" if waiter is None else "wait"
        try:
            pending = context.run(
                spec.acquire,
                spec.keys,
                (self.member, mode, spec.channel, *spec.args),
                sent=written.append,
            )
            in_flight = self.in_flight = InFlight(pending, context)
            reply: list[Any] | int = await in_flight.reply(self.deadline)
            self.in_flight = None
        except (*AUTHENTICATION_ERRORS, *NOPERMISSION_ERRORS):
            self.on_server = self.heard_from  # refused before it ran: nothing changed by this call
            raise
        except PASSING_OUTAGE as exc:
            if not self.heard_from or self.waiter is None or cancelling():
                raise  # the first try: the caller learns Redis is unreachable
            # Queued already: a server that restarts or fails over must not end the wait.
            log.debug("aiolocks: re-check of %r failed; retrying", self.spec.name, exc_info=True)
            self.miss = Miss(unanswered=False, wait_ms=self.miss.wait_ms, failure=repr(exc))
            return OUTAGE
        self.backoff, self.heard_from = RETRY_MIN, True
        if written:
            self.sent_at = written[0]
        return self.answer(AcquireReply.decode(reply))

    def answer(self, reply: AcquireReply) -> _Next:
        """Where an acquire reply leads: the grants it made (this token's, other local
        waiters'), or whether to park or sleep."""
        waiter, sent_at, status = self.waiter, self.sent_at, reply.status
        if waiter is not None and reply.floor is not None:
            waiter.not_holding(reply.floor)  # drops a grant this answer overtook
        wake_granted(self.context, self.spec, reply.grants, sent_at)  # maybe local ones
        if status is Status.GRANTED:
            # (late: answered after a stall, re-run)
            return self.granted(reply.fence, sent_at, alone=self.calls == 1)
        if status is Status.REFUSED:
            return self.refused(reply.stored)
        wait_ms = reply.wait_ms
        self.miss = Miss(unanswered=False, wait_ms=wait_ms)
        if waiter is not None:
            if status is Status.QUEUED:
                waiter.still_queued(sent_at)
            if waiter.fence is not None:
                return self.granted(waiter.fence, waiter.granted_at)
        if status is Status.TAKEN:
            self.on_server = False
            if not self.blocking:
                return self.miss
        if waiter is None:
            return PARK
        # Unknown (or a holder key without expiry, not set by us): wait a ttl, not a spin.
        waiter.lot.note_lease(wait_ms if wait_ms >= 0 else self.ttl_ms)
        return SLEEP

    def refused(self, stored: int) -> _Next:
        """The script refused a configuration other than the stored one (`stored`)."""
        fresh = None if self.respec is None else self.respec()
        if fresh is not None and fresh.args != self.spec.args:
            self.spec = fresh  # reconfigured meanwhile (set_limit): go on with the new one
            return TRY
        self.on_server = self.waiter is not None  # an earlier call may have queued it
        assert self.spec.refused is not None, "a script refused without a reason"
        raise self.spec.refused(stored)

    async def park(self) -> _Next:
        """PARK: join the local queue (the keeper heartbeats it) and subscribe."""
        context, spec = self.context, self.spec
        waiter = context.waitqueue.park(
            spec.channel, self.token, self.ttl_ms, spec.side, spec.shared, self.deadline
        )
        self.waiter = waiter
        context.keeper.watch_waiter(spec.heartbeat_keys, waiter)
        self.subscribed = await _subscribe(context, spec, self.deadline)
        return TRY

    async def outage(self) -> _Next:
        """OUTAGE: Redis could not be reached; re-try after a back-off (or sooner, on a
        reconnect or a grant), until the caller's own deadline."""
        if self.deadline is not None and _clock.monotonic() >= self.deadline:
            return self.miss
        waiter = self.parked()
        wake = await waiter.sleep(_clock.monotonic() + self.backoff)
        self.backoff = min(self.backoff * 2, RETRY_MAX)
        return self.granted_to(waiter) if wake is Wake.GRANTED else TRY

    def woken(self, wake: Wake) -> _Next:
        """Where a parked waiter's wake leads: its grant, its deadline, or a re-try."""
        if wake is Wake.GRANTED:
            return self.granted_to(self.parked())
        if wake is Wake.DEADLINE:
            return self.miss
        return TRY

    def granted_to(self, waiter: Waiter) -> _Next:
        assert waiter.fence is not None
        return self.granted(waiter.fence, waiter.granted_at)

    def granted(self, fence: int, at: float, alone: bool = False) -> _Next:
        """A grant whose lease counts from `at`: the end, unless it came too late (TRY)."""
        if self.late.confirm(at, self.waiter):
            return TRY
        self.on_server = False
        return Grant(self.token, fence, at, alone)

    def parked(self) -> Waiter:
        assert self.waiter is not None
        return self.waiter

    def leave(self) -> Awaitable[None] | None:
        """However it ended: leave the local queue and the subscription; what withdraws
        what the server may hold for the token, to await, if it may hold any. (Not a
        coroutine: an acquisition granted at once has nothing to withdraw.)"""
        context, spec, waiter = self.context, self.spec, self.waiter
        if waiter is not None:
            context.waitqueue.remove(waiter)
            context.keeper.unwatch_waiter(spec.heartbeat_keys, waiter)
        if self.subscribed:
            context.notifier.release(spec.channel)
        return self.withdraw() if self.on_server else None

    async def withdraw(self) -> None:
        context, spec, token, ttl_ms = self.context, self.spec, self.token, self.ttl_ms
        if context.autopipe is None:
            # Its clean-up may overtake, on another connection, a call that grants or
            # queues it (through the auto-pipeline, one connection keeps their order): a
            # grant read for it from now on is handed on. Past the ttl (and the bound of
            # a clean-up) any entry such a call left has been purged.
            within = ttl_ms / 1000.0 + CLEANUP_BOUND
            hand_on = functools.partial(background_release, context, spec, token, ttl_ms)
            context.waitqueue.depart(token, within, hand_on)
        # Awaited until the caller's deadline (a little past it), or, without one, up to
        # CLEANUP_BOUND; past that it goes on in the background.
        deadline = self.deadline
        until = None if deadline is None else max(deadline, _clock.monotonic()) + GRACE
        if self.unanswered:
            until = _clock.monotonic() + GRACE
        after = None if self.in_flight is None else self.in_flight.after(self.wake_granted)
        await withdraw(context, spec, token, ttl_ms, until, after=after)

    def wake_granted(self, reply: list[Any] | int) -> None:
        """The local waiters granted by the reply of the call the acquisition left in flight."""
        sent_at = self.written[0] if self.written else self.sent_at
        wake_granted(self.context, self.spec, AcquireReply.decode(reply).grants, sent_at)


async def _subscribe(context: ClientContext, spec: Spec, deadline: float | None) -> bool:
    """Subscribe (`Notifier.retain`) for a parked waiter; False when it holds no reference.

    The notifier tolerates a failed subscription (the waiter wakes on its timer); a failure
    of what it asks the server first (`CONFIG GET`, once per client) is tolerated the same
    way: the server has answered this acquisition, and one lost command must not end it.
    The next waiter asks again.
    """
    try:
        await bounded(context.notifier.retain(spec.channel, spec.watch_key), deadline)
    except TimeoutError:
        raise  # the caller's deadline (a builtin TimeoutError is an OSError too)
    except (*AUTHENTICATION_ERRORS, *NOPERMISSION_ERRORS):
        raise
    except _NOT_SUBSCRIBED as exc:
        log.debug("aiolocks: no subscription for %r (%r); waiting on its timer", spec.name, exc)
        return False
    return True


# -- a grant confirmed with the server before it is reported ----------------------------

# A grant whose lease, counted from a moment known to precede it, has less than this part
# of its ttl left is confirmed with the server before it is reported (see LateGrants).
_CONFIRM_BELOW, _MAX_CONFIRMS = 0.5, 3


def late_grant(granted_at: float, ttl_ms: int) -> bool:
    """A grant whose lease, counted from `granted_at`, has less than half its validity left:
    to be confirmed with the server before it is reported (see `LateGrants`)."""
    ttl = ttl_ms / 1000.0
    return validity(granted_at, ttl) - _clock.monotonic() < ttl * _CONFIRM_BELOW


class LateGrants:
    """Decides, for one acquisition, whether a grant is reported or first confirmed.

    A grant's lease is counted from a moment known to precede it (the sending of a call
    that found the token not yet granted, or of the granting call). When the news came late
    (a stalled loop, a slow link) that leaves little or no validity: the acquire script is
    then re-run, which re-arms the lease if it is still the token's (it is idempotent) or
    queues it again if the server already ended it. Up to 3 confirmations per acquisition:
    a server that answers slower than that (round trips near the ttl) gets the grant with
    what validity is left, and the keeper renews at once, or reports the loss if none is.
    """

    __slots__ = ("confirms", "ttl_ms")

    def __init__(self, ttl_ms: int) -> None:
        self.ttl_ms = ttl_ms
        self.confirms = 0

    def confirm(self, granted_at: float, waiter: Waiter | None) -> bool:
        """True: confirm the grant (re-run the acquire script; `waiter` forgets it)."""
        if not late_grant(granted_at, self.ttl_ms):
            return False
        if self.confirms >= _MAX_CONFIRMS:
            return False  # a server slower than the ttl: no loop of calls; the keeper judges
        self.confirms += 1
        if waiter is not None:
            waiter.forget_grant()
        return True


async def confirm(
    context: ClientContext, spec: Spec, token: str, ttl_ms: int, replicas: int, timeout_ms: int
) -> tuple[Status, int]:
    """Re-run the acquire script for a granted `token` (a write: it re-arms the lease) and
    `WAIT` on the same connection: (its status, replicas that acknowledged).

    Replication is in order, so a replica that has this write also has the grant before
    it, whichever client made that grant (a hand-off is made by the releaser).
    """
    member = context.waitqueue.member(token, ttl_ms, spec.side)
    reply, acked = await context.run_then_wait(
        spec.acquire, spec.keys, (member, "try", spec.channel, *spec.args), replicas, timeout_ms
    )
    return AcquireReply.decode(reply).status, int(acked)
