"""Release and clean-up: every release, and every withdrawal of a token, goes through here.

One module decides what is retried, how often and for how long (`RETRY_POLICY` below):

- `release`: the release script for a token, run once, and once more after a lost reply
  (a dropped connection; every engine script is idempotent); grants it made to this
  client's waiters are woken from its reply (`wake_granted`), not by pub/sub.
- `release_until`: a holder's release, behind the client's release gate, waited for while
  its lease is known valid (the keeper renews it meanwhile); past that, or cancelled, it
  goes on as a clean-up.
- `withdraw` / `background_release`: clean-up that outlives its caller (a cancelled or
  failed acquisition, an interrupted release): a task of its own, awaited up to a bound,
  then retried in the background while Redis cannot be reached, until the server forgets
  the token by itself (its ttl).
- the awaiting helpers (`InFlight`, `completed`, `bounded`, `shielded`): a call whose
  reply a cancellation or a deadline must not cut short.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from .._base import _clock, _telemetry
from .._base._adapter import text
from .._base._errors import AUTHENTICATION_ERRORS, EngineClosed, cancelling
from .._base._spec import LOST_REPLY, PASSING_OUTAGE, RETRY_MAX, RETRY_MIN, Spec
from .._leases._keeper import Lease
from .._scripts import Script
from ._context import ClientContext

__all__ = [
    "CLEANUP_BOUND",
    "GRACE",
    "UNANSWERED",
    "Granted",
    "InFlight",
    "ReleaseReply",
    "Released",
    "Unanswered",
    "background_release",
    "bounded",
    "completed",
    "give_back_lost",
    "granted_in",
    "granting",
    "handed_off",
    "release",
    "release_reply",
    "release_surely",
    "release_until",
    "shielded",
    "wake_granted",
    "withdraw",
]

T = TypeVar("T")

log = logging.getLogger("aiolocks")


# -- the replies of the scripts that grant, decoded once --------------------------------


class Granted(NamedTuple):
    """A grant a script made (a hand-off, a permit): to which token, its fence, its ttl."""

    token: str
    fence: int
    ttl_ms: int


def granted_in(reply: Sequence[Any], start: int) -> tuple[Granted, ...]:
    """The grants a script reports from `reply[start]` on (token, fence, ttl triples): the
    one reading of them, for every script that grants (acquire, release, set_limit)."""
    if len(reply) <= start:
        return ()
    return tuple(
        Granted(text(reply[at]), int(reply[at + 1]), int(reply[at + 2]))
        for at in range(start, len(reply) - 2, 3)
    )


class Released(enum.IntEnum):
    """The release script's status (the first element of its reply)."""

    NOT_HELD = 0  # the token did not hold it (any queue entry of it is withdrawn now)
    HELD = 1  # it held it: released
    KEPT = 2  # 'keep' (a local hand-off cohort), nobody queued: still held, a new fence block


_RELEASED = {status.value: status for status in Released}


class ReleaseReply(NamedTuple):
    """The release script's reply: {status, grants...}, or {KEPT, fence}; a status alone
    may come as an integer (a mutex's free release, mutex_release.lua)."""

    status: Released
    grants: tuple[Granted, ...] = ()
    fence: int = 0  # KEPT: the first fence of the block the holder keeps passing from

    @classmethod
    def decode(cls, reply: Sequence[Any] | int) -> ReleaseReply:
        if isinstance(reply, int):
            return _STATUS_ALONE[reply]
        status = _RELEASED[int(reply[0])]
        if status is Released.KEPT:
            return cls(status, (), int(reply[1]))
        return cls(status, granted_in(reply, 1))


_STATUS_ALONE = {status.value: ReleaseReply(status) for status in Released}  # (made once)


async def release(context: ClientContext, spec: Spec, token: str, ttl_ms: int) -> bool | None:
    """Run the release script for `token`; True if it held the primitive, False if not.

    A call cut off by a connection error is run once more; if that one finds the token not
    holding, the answer is None: the first call may have released it (its reply was lost)
    or the lease may have been lost, and only the caller's lease can tell which.
    When the script hands the primitive to a waiter of this same client, that waiter is
    woken here rather than by the pub/sub round trip.
    """
    sent_at = _clock.monotonic()
    written: list[float] = []  # when the call went out (behind a burst: later)
    raw, unsure = await release_reply(context, spec, token, ttl_ms, sent=written.append)
    reply = ReleaseReply.decode(raw)
    if reply.grants:
        wake_granted(context, spec, reply.grants, written[0] if written else sent_at)
        handed_off(spec, len(reply.grants))
    held = reply.status is Released.HELD
    return None if unsure and not held else held


def handed_off(spec: Spec, count: int, *, local: bool = False) -> None:
    """A release let `count` waiters in (it may be 0): by the release script's grants, or
    `local`ly, a `local_handoff` cohort passing its lease to its next task. Counted for
    `statistics()`, and told to the telemetry recorder if one is installed."""
    if count:
        spec.counters.handoffs += count
        if _telemetry.recorder is not None:
            _telemetry.on_handoff(spec, count, local=local)


# The retry policy of every release and clean-up, decided here only:
# - a script call that may grant (a release, `set_limit`) whose reply is lost (LOST_REPLY:
#   a dropped connection, a timeout) is sent once more, at once, and never a third time
#   (`_granting`; the runner's own retry is off for it, so the two cannot stack);
# - a clean-up that outlives its caller (`_retried`) tries again while the server cannot be
#   reached (PASSING_OUTAGE, not a refused authentication), backing off from RETRY_MIN,
#   doubling up to RETRY_MAX, for at most max(CLEANUP_BOUND, the token's ttl): past that the
#   server has forgotten the token by itself.


def release_reply(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    *extra: Any,
    sent: Callable[[float], None] | None = None,
) -> Awaitable[tuple[Any, bool]]:
    """Run the release script for `token` (with `extra` arguments after the spec's), once, or
    once more after a connection error; returns its reply (for `ReleaseReply.decode`), and
    whether a first call was cut off (it may have done the work, and the reply is then the
    retry's). `sent`: as for `ClientContext.run`. (Not a coroutine: one level less in
    every release.)
    """
    member = context.waitqueue.member(token, ttl_ms, spec.side)
    args = (member, spec.channel, *spec.args, *extra)
    return _granting(context, spec, spec.release, args, True, sent)


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
    reply: list[Any] = (await _granting(context, spec, script, args, retry, sent))[0]
    return reply


async def _granting(
    context: ClientContext,
    spec: Spec,
    script: Script,
    args: tuple[Any, ...],
    retry: bool,
    sent: Callable[[float], None] | None,
) -> tuple[Any, bool]:
    """`granting`, and whether a first call was cut off (the reply is then the second's)."""
    for again in (False, True):
        try:
            reply: Any = await context.run(script, spec.keys, args, retry=False, sent=sent)
            return reply, again
        except BaseException as exc:
            context.waitqueue.recheck_all(spec.channel)
            if again or not retry or not isinstance(exc, LOST_REPLY):
                raise
    raise AssertionError("unreachable")


def wake_granted(
    context: ClientContext, spec: Spec, grants: tuple[Granted, ...], sent_at: float
) -> None:
    """Wake the local waiters among the `grants` a script reported; the others are told by
    pub/sub. `sent_at`: when the script call was sent, a moment that precedes its grants."""
    if not grants:
        return
    lot = context.waitqueue.lot(spec.channel)
    for token, fence, ttl_ms in grants:
        if context.waitqueue.stale(token, fence):
            continue  # ended since: a later answer found the token not holding
        if lot is not None:
            lot.note_lease(ttl_ms, grant=True)
        context.waitqueue.unpark(token, fence, sent_at, spec.channel)


# -- clean-up that outlives its caller --------------------------------------------------

# Clean-up after a failed or cancelled acquisition (and a release interrupted by a
# cancellation) is awaited at most this long; it goes on in the background after that,
# for at most max(CLEANUP_BOUND, ttl): past the ttl the server forgets the token by itself.
CLEANUP_BOUND = 5.0
# How far past the caller's deadline its clean-up is awaited before it goes on in the
# background (`acquire(timeout=t)` returns within t + this + scheduling).
GRACE = 0.05


# Clean-ups left to finish in the background (a reference, so they are not collected).
_BACKGROUND: set[asyncio.Future[None]] = set()


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
    flight, see `InFlight.after`; past it, that call is abandoned and the release sent)."""
    task = background_release(context, spec, token, ttl_ms, call, after)
    wait = CLEANUP_BOUND if until is None else max(0.0, until - _clock.monotonic())
    if not task.done():
        await completed(asyncio.wait((task,), timeout=wait))
    return task.done()


def background_release(
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
    task = asyncio.ensure_future(_retried(call, spec.name, token, bound, after))
    for running in (_BACKGROUND, context.cleanups):
        running.add(task)
        task.add_done_callback(running.discard)
    again = functools.partial(_retried, call, spec.name, token, bound)
    task.add_done_callback(functools.partial(_cut_short, context, again, after))
    return task


def give_back_lost(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    call: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The keeper lost `token`'s lease (its validity ended while Redis did not answer, or
    another owner holds the name): give the token back now, in the background, as every
    clean-up (`background_release`). A lease that ran out of validity on this side may
    still be the token's on the server (a renewal ran there, its reply late): the name
    would stay owned by a token no task holds, while others wait, until its holder's
    task released it (as late as it likes) or its ttl ended. Not on a closed client (its
    user closed it: the engine makes no call on it)."""
    if not context.closed:
        background_release(context, spec, token, ttl_ms, call)


def _cut_short(
    context: ClientContext,
    again: Callable[[], Awaitable[None]],
    after: Awaitable[Any] | None,
    task: asyncio.Future[None],
) -> None:
    """A clean-up task that ended cancelled: only the loop's end cancels one (asyncio.run
    cancels every task left, even one created in the step in which `main` returned, before
    its first step). It is run again at the loop's end (`ClientContext.interrupted`); the
    call in flight it was to wait for is gone with the loop, so it is not waited for."""
    if not task.cancelled():
        return
    if inspect.iscoroutine(after) and inspect.getcoroutinestate(after) == inspect.CORO_CREATED:
        after.close()  # never started: closed, not left to warn "never awaited"
    if not context.closed:
        context.interrupted.append(again)


async def _retried(
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
    give_up = _clock.monotonic() + bound
    delay = RETRY_MIN
    while True:
        try:
            await asyncio.wait_for(call(), give_up - _clock.monotonic())
            return
        except asyncio.CancelledError:
            raise  # the loop is shutting down
        except EngineClosed:
            log.debug("aiolocks: clean-up of %r (token %s) dropped: client closed", name, token)
            return  # its user closed the client: the server forgets the token by its ttl
        except Exception as exc:
            if cancelling():
                # The cancellation met a connect or a socket and came out of redis-py as a
                # connection error: stop here, or the loop's end waits out the whole bound.
                raise asyncio.CancelledError from exc
            outage = isinstance(exc, PASSING_OUTAGE) and not isinstance(exc, AUTHENTICATION_ERRORS)
            if not outage or _clock.monotonic() + delay >= give_up:
                log.warning(
                    "aiolocks: clean-up of %r (token %s) not confirmed (%r); the server "
                    "forgets the token when its ttl ends",
                    name,
                    token,
                    exc,
                )
                return
        await asyncio.sleep(delay)  # an outage back-off, as a queued waiter's re-check
        delay = min(delay * 2, RETRY_MAX)


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
        return await release(context, spec, token, ttl_ms)
    except asyncio.CancelledError:
        await withdraw(context, spec, token, ttl_ms, until)
        raise


async def release_until(
    context: ClientContext,
    spec: Spec,
    token: str,
    ttl_ms: int,
    until: float,
    call: Callable[[], Awaitable[bool | None]] | None = None,
    lease: Lease | None = None,
    first: Callable[[], Awaitable[bool | None]] | None = None,
) -> bool | Unanswered | None:
    """`release_surely`, waited for until the monotonic time `until` at most (a lease's
    validity): past it the answer is UNANSWERED and the release goes on in the background.
    `call` replaces the release of `spec` (a multi-lock releases several); `first` replaces
    the first call only, not the clean-up after a cancellation or a timeout (a cohort that
    asks to keep its lease: cleaning up, it gives it back).

    With `lease` (still held by the keeper), the keeper goes on renewing it until the
    release is answered, and the wait follows its validity as renewals move it: a release
    queued behind a burst (more calls than the link carries at once) keeps its lease and
    is answered however long it waits; only a Redis that answers nothing, renewals
    included, runs the validity out. A loss the keeper finds meanwhile is reported by the
    release's answer (or by its validity ending), not by the keeper. At most
    `RELEASES_IN_FLIGHT` releases of a client are in flight; the others wait for a place
    (`_context.Gate`), their validity followed from when they have one."""
    if lease is not None:
        lease.release_begun()  # the keeper renews it on, but reports no loss of it
    bound: _ValidityBound | None = None
    try:
        # Behind a burst of releases, in arrival order, the lease renewed meanwhile.
        if (place := context.releases.enter()) is not None:
            await place
        once = first or call
        calling = release(context, spec, token, ttl_ms) if once is None else once()
        async with asyncio.timeout(None) as scope:
            try:
                bound = _ValidityBound(scope, until, lease)
                return await calling
            finally:
                context.releases.leave()
                if bound is not None:
                    bound.cancel()
                if lease is not None:
                    context.keeper.drop(lease)
    except TimeoutError:
        await withdraw(context, spec, token, ttl_ms, _clock.monotonic(), call)
        return UNANSWERED
    except asyncio.CancelledError:
        if lease is not None:  # (cancelled while waiting for its place)
            context.keeper.drop(lease)
            until = max(until, lease.valid_until)
        end = until if bound is None else bound.end()
        await withdraw(context, spec, token, ttl_ms, max(end, _clock.monotonic() + GRACE), call)
        raise


_NO_CONTEXT = contextvars.Context()


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
        # Itself the callback, in one shared empty context: no bound method and no copy
        # of the caller's context per release (objects the garbage collector goes through).
        loop = asyncio.get_running_loop()
        return loop.call_later(self.end() - _clock.monotonic(), self, context=_NO_CONTEXT)

    def __call__(self) -> None:
        if self.end() > _clock.monotonic():
            self.handle = self._arm()  # renewed meanwhile
        else:
            self.scope.reschedule(asyncio.get_running_loop().time())

    def cancel(self) -> None:
        self.handle.cancel()


# -- awaiting what a cancellation or a deadline must not cut short ----------------------


class Unanswered:
    """The marker `release_until` returns when Redis did not answer in time."""


UNANSWERED = Unanswered()


class InFlight(Generic[T]):
    """A call that may take or grant something for a token (an acquire, an adoption, a
    multi-lock's try, a replica-confirmed grant, a rate limiter's reservation), whose reply
    a caller that leaves (a cancellation, a deadline, an error) must not lose: leaving stops
    the wait, not the call, and the caller's clean-up runs after its reply (`after`), never
    before it, so it cannot overtake the call and find nothing while the call then takes
    for a departed token. The one mechanism for that.

    With `context`, the call is carried in a task of its own only where a clean-up would not
    follow it on one connection (auto-pipelining off, Cluster: each call on a pooled
    connection); through the auto-pipeline it is awaited as it is (one connection keeps the
    clean-up behind it). Without `context`, always in a task of its own (a call on a
    connection of its own, or one whose reply the clean-up needs)."""

    __slots__ = ("_call", "_task")

    def __init__(self, call: Awaitable[T], context: ClientContext | None = None) -> None:
        self._call: Awaitable[T] | None = None
        self._task: asyncio.Future[T] | None = None
        if context is not None and context.autopipe is not None:
            self._call = call
        else:
            self._task = asyncio.ensure_future(call)

    def reply(self, deadline: float | None = None) -> Awaitable[T]:
        """The call's reply, awaited until the monotonic time `deadline` at most (`bounded`)."""
        if self._task is None:
            assert self._call is not None
            return bounded(self._call, deadline)
        return bounded(asyncio.shield(self._task), deadline)

    async def outcome(self) -> T | None:
        """The reply once it came, for a caller that left; None if the call failed (a lost
        reply: the clean-up sent next undoes whatever it did) or was not carried on."""
        if self._task is None:
            return None
        try:
            return await self._task
        except Exception:
            return None

    def after(self, then: Callable[[T], object] | None = None) -> Awaitable[None] | None:
        """What a clean-up awaits first (`withdraw`'s `after`): the reply (then `then(reply)`,
        if it came); None when the call was not carried on (nothing to wait for)."""
        return None if self._task is None else self._after(then)

    async def _after(self, then: Callable[[T], object] | None) -> None:
        reply = await self.outcome()
        if reply is not None and then is not None:
            then(reply)


def bounded(awaitable: Awaitable[T], deadline: float | None) -> Awaitable[T]:
    """`awaitable`, awaited until the monotonic time `deadline` at most (TimeoutError);
    without a deadline, `awaitable` itself (no coroutine more in the chain)."""
    if deadline is None:
        return awaitable
    return _bounded(awaitable, deadline)


async def _bounded(awaitable: Awaitable[T], deadline: float) -> T:
    async with asyncio.timeout(deadline - _clock.monotonic()):
        return await awaitable


async def shielded(call: Callable[[], Awaitable[T]], bound: float) -> T | None:
    """Run `call()` to completion even if the caller is cancelled meanwhile, for at most
    `bound` seconds; errors (the timeout included) give None. A cancellation of the
    caller is re-raised once the call is done."""

    async def run() -> T | None:
        try:
            return await asyncio.wait_for(call(), bound)
        except Exception:
            return None

    return await completed(run())


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
