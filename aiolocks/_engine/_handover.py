"""Hand-over between processes: `detach()` a holding here, `adopt()` it in another process.

Detaching lets go of a holding without releasing it (renewal here stops); adopting moves it
to a new token of the adopting process in one script, so a handle is adopted once only,
across every process, and keeps its fencing token. Used by `LeasedLock.detach` / `adopt`.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time

from .._base import _spec, _telemetry
from .._base._errors import LockError, LockLost, LockReentry, map_redis_errors
from .._base._handle import LockHandle
from . import _release
from ._context import context_for
from ._holding import current_task
from ._lockcore import LockCore

__all__ = ["adopt", "detach"]


def detach(lock: LockCore) -> LockHandle:
    """Let go of the current task's holding of `lock` without releasing it (see
    `LeasedLock.detach`)."""
    _check_handover(lock)
    holding = lock._find_holding()
    if holding.is_lost:
        raise lock._lost_error(holding)
    del lock._holdings[holding.task]
    lock._uncap(holding)
    context = context_for(lock._client)
    lock._stop_renewal(context, holding)
    _telemetry.on_release(lock._spec, holding.token)  # it ends here, as far as we know
    return LockHandle(lock._handle_kind, lock._name, holding.token, holding.fence, lock._prefix)


async def adopt(lock: LockCore, handle: LockHandle) -> None:
    """Make the current task hold what `handle` describes (see `LeasedLock.adopt`)."""
    if not isinstance(handle, LockHandle):
        raise TypeError(f"adopt() takes a LockHandle, not {type(handle).__name__}")
    _check_handover(lock)
    mine = (lock._handle_kind, lock._name, lock._prefix)
    if (handle.kind, handle.name, handle.prefix) != mine:
        raise LockError(
            lock._name,
            f"the handle is of {handle.kind} {handle.name!r} (prefix {handle.prefix!r}), "
            f"not of this {lock._handle_kind} (prefix {lock._prefix!r})",
        )
    task = current_task()
    if task in lock._holdings or lock._held_elsewhere(task) is not None:
        raise LockReentry(lock._name, "the current task already holds it")
    context = context_for(lock._client)
    token = secrets.token_hex(16)
    script, keys = lock._adopt_call()
    sent_at = time.monotonic()
    pending = context.run(script, keys, (handle.token, token, lock._ttl_ms))
    in_flight = _release.unstopped(context, pending)  # no auto-pipeline: see there
    try:
        with map_redis_errors(lock._name):
            taken = await (pending if in_flight is None else asyncio.shield(in_flight))
    except BaseException:
        # The script may have run: give back what the new token may hold (after its
        # reply, if it is still on its way), awaited up to CLEANUP_BOUND, then in the
        # background.
        release = functools.partial(lock._release_call, context, token)
        after = None if in_flight is None else _release.settled(in_flight)
        await _release.withdraw(
            context, lock._spec, token, lock._ttl_ms, None, release, after=after
        )
        raise
    if not int(taken):
        raise LockLost(
            lock._name,
            "the handed-over holding has ended, or its handle was adopted already "
            "(a handle is adopted once)",
            token=handle.token,
        )
    lock._hold(context, task, _spec.Grant(token, handle.fencing_token, sent_at))


def _check_handover(lock: LockCore) -> None:
    if not lock._handle_kind:
        raise LockError(lock._name, f"a {type(lock).__name__} cannot be handed over")
    if lock._local_handoff:
        raise LockError(
            lock._name, "a local_handoff instance cannot hand a holding over: its lease "
            "is shared by this process's tasks",
        )  # fmt: skip
