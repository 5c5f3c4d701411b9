"""Clean-up that outlives its caller: withdrawing a token from the server, and releases that
a cancellation or a dead link must not cut short.

A cancelled or failed acquisition, or a release interrupted by a cancellation, leaves state
on the server that only a release script removes. It runs in a task of its own: the caller
waits for it up to a bound (its deadline, a lease's validity, CLEANUP_BOUND), and past that
it goes on in the background, retried while Redis cannot be reached, until the server
forgets the token by itself (its ttl).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._base._cancel import cancelling
from .._base._errors import AUTHENTICATION_ERRORS
from .._base._spec import PASSING_OUTAGE, RETRY_MAX, RETRY_MIN, Spec, first_grant
from .._leases._lease import Lease
from ._awaiting import UNANSWERED, Unanswered, completed, settled
from ._context import ClientContext
from ._release import release, wake_granted

__all__ = [
    "CLEANUP_BOUND",
    "GRACE",
    "answered",
    "background_release",
    "release_surely",
    "release_until",
    "withdraw",
]

# Clean-up after a failed or cancelled acquisition (and a release interrupted by a
# cancellation) is awaited at most this long; it goes on in the background after that,
# for at most max(CLEANUP_BOUND, ttl): past the ttl the server forgets the token by itself.
CLEANUP_BOUND = 5.0
# How far past the caller's deadline its clean-up is awaited before it goes on in the
# background (`acquire(timeout=t)` returns within t + this + scheduling).
GRACE = 0.05

log = logging.getLogger("aiolocks")

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
    flight, see `answered`; past it, that call is abandoned and the release sent)."""
    task = background_release(context, spec, token, ttl_ms, call, after)
    wait = CLEANUP_BOUND if until is None else max(0.0, until - time.monotonic())
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
    give_up = time.monotonic() + bound
    delay = RETRY_MIN
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
            outage = isinstance(exc, PASSING_OUTAGE) and not isinstance(exc, AUTHENTICATION_ERRORS)
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
        delay = min(delay * 2, RETRY_MAX)


async def answered(
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
    grants = first_grant(int(reply[0]))
    if len(reply) > grants:
        wake_granted(context, spec, reply, grants, written[0] if written else sent_at)


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
) -> bool | Unanswered | None:
    """`release_surely`, waited for until the monotonic time `until` at most (a lease's
    validity): past it the answer is UNANSWERED and the release goes on in the background.
    `call` replaces the release of `spec` (a multi-lock releases several).

    With `lease` (still held by the keeper), the keeper goes on renewing it until the
    release is answered, and the wait follows its validity as renewals move it: a release
    queued behind a burst (more calls than the link carries at once) keeps its lease and
    is answered however long it waits; only a Redis that answers nothing, renewals
    included, runs the validity out. A loss the keeper finds meanwhile is reported by the
    release's answer (or by its validity ending), not by the keeper. At most
    `RELEASES_IN_FLIGHT` releases of a client are in flight; the others wait for a place
    (`_gate.py`), their validity followed from when they have one."""
    if lease is not None:
        lease.releasing = True  # the keeper renews it on, but reports no loss of it
    bound: _ValidityBound | None = None
    try:
        # Behind a burst of releases, in arrival order, the lease renewed meanwhile.
        await context.releases.enter()
        first = release(context, spec, token, ttl_ms) if call is None else call()
        async with asyncio.timeout(None) as scope:
            try:
                bound = _ValidityBound(scope, until, lease)
                return await first
            finally:
                context.releases.leave()
                if bound is not None:
                    bound.cancel()
                if lease is not None:
                    context.keeper.drop(lease)
    except TimeoutError:
        await withdraw(context, spec, token, ttl_ms, time.monotonic(), call)
        return UNANSWERED
    except asyncio.CancelledError:
        if lease is not None:  # (cancelled while waiting for its place)
            context.keeper.drop(lease)
            until = max(until, lease.valid_until)
        end = until if bound is None else bound.end()
        await withdraw(context, spec, token, ttl_ms, max(end, time.monotonic() + GRACE), call)
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
        when = loop.time() + (self.end() - time.monotonic())
        return loop.call_at(when, self, context=_NO_CONTEXT)

    def __call__(self) -> None:
        if self.end() > time.monotonic():
            self.handle = self._arm()  # renewed meanwhile
        else:
            self.scope.reschedule(asyncio.get_running_loop().time())

    def cancel(self) -> None:
        self.handle.cancel()
