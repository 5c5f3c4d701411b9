"""The release path: run a release script, and hand what it granted to this client's waiters.

A release (or any script that may grant, such as `set_limit`) makes the next waiters owners
in the same script; grants to waiters of this client are not published, so they are woken
here from the reply, and a lost reply makes every local waiter of the name re-check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._base import _telemetry
from .._base._spec import LOST_REPLY, Spec
from .._scripts import Script
from ._context import ClientContext

__all__ = ["granting", "release", "release_reply", "wake_granted"]


async def release(context: ClientContext, spec: Spec, token: str, ttl_ms: int) -> bool | None:
    """Run the release script for `token`; True if it held the primitive, False if not.

    A call cut off by a connection error is run once more; if that one finds the token not
    holding, the answer is None: the first call may have released it (its reply was lost)
    or the lease may have been lost, and only the caller's lease can tell which.
    When the script hands the primitive to a waiter of this same client, that waiter is
    woken here rather than by the pub/sub round trip.
    """
    sent_at = time.monotonic()
    written: list[float] = []  # when the call went out (behind a burst: later)
    reply, unsure = await release_reply(context, spec, token, ttl_ms, sent=written.append)
    wake_granted(context, spec, reply, 1, written[0] if written else sent_at)
    _telemetry.on_handoff(spec, (len(reply) - 1) // 3)
    held = int(reply[0]) == 1
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
    """
    member = context.waitqueue.member(token, ttl_ms, spec.kind)
    args = (member, spec.channel, *spec.args, *extra)
    try:
        return await granting(context, spec, spec.release, args, sent=sent), False
    except LOST_REPLY:
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
        if not retry or not isinstance(exc, LOST_REPLY):
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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
