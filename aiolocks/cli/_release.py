"""`aiolocks release NAME --force`: take a lock away from its holder(s) and hand it on.

Done by the library's own release script, run with the holder's token, so the server does
exactly what the holder's own `release()` would: the next queued waiters become holders,
the fence rises, and each grant is published, so waiters in any process wake at once. The
old holder learns it at its next renewal (within a third of its ttl) or its release, as
`LockLost`. A holder that changed since it was shown is left alone (compare-and-release).
"""

from __future__ import annotations

import argparse

import redis.asyncio

from .._base._spec import Spec
from .._engine._context import context_for
from .._engine._release import Released, ReleaseReply
from ..election import RedisElection
from ..mutex import RedisMutex
from ..rwlock import RedisReadWriteLock
from ..semaphore import RedisSemaphore, SemaphoreInfo
from ._connect import connected, server_url
from ._errors import NotFound, Refused, UsageError
from ._io import Streams
from ._prompt import confirm
from ._scan import LOCK_KINDS, resolve_kind
from ._view import Holder, View, view_of

__all__ = ["run"]

_ROLES = {"x": "holder", "r": "reader", "w": "writer"}


async def run(args: argparse.Namespace, io: Streams) -> int:
    if not args.force:
        raise UsageError(
            "release takes the lock away from a holder that may still be working under it; "
            "pass --force to do it"
        )
    async with connected(server_url(args.url), args.connect_timeout) as client:
        kind = await resolve_kind(client, args.prefix, args.name, args.kind)
        if kind not in LOCK_KINDS:
            raise Refused(f"{kind} {args.name!r} is not a lock: nothing to release")
        view = await view_of(client, kind, args.name, args.prefix)
        targets = _targets(view, args.token)
        confirm(io, _question(view, targets), assume_yes=args.yes, declined="nothing released")
        missed = 0
        for holder in targets:
            missed += not await _release(client, view, holder, io)
    if missed < len(targets):
        io.say(
            "a holder released this way gets LockLost at its next renewal "
            "(within a third of its ttl) or release()"
        )
    return 1 if missed else 0


def _targets(view: View, token: str | None) -> list[Holder]:
    what = f"{view.kind} {view.name!r}"
    if not view.holders:
        waiting = f" ({len(view.queue)} queued)" if view.queue else ""
        raise NotFound(f"{what} is not held{waiting}: nothing to release")
    if token is None:
        return list(view.holders)
    matches = [holder for holder in view.holders if holder.token.startswith(token)]
    if not matches:
        tokens = ", ".join(holder.token for holder in view.holders)
        raise NotFound(f"no holder of {what} has a token starting with {token!r} ({tokens})")
    if len(matches) > 1:
        raise UsageError(f"{token!r} begins {len(matches)} tokens of {what}'s holders: give more")
    return matches


def _question(view: View, targets: list[Holder]) -> str:
    what = f"{view.kind} {view.name!r}"
    if len(targets) == 1:
        holder = targets[0]
        if view.kind == "mutex":
            return f"Release {what} held by {holder.token}?"
        return f"Release {what} {_ROLES[holder.side]} {holder.token}?"
    tokens = ", ".join(holder.token for holder in targets)
    return f"Release all {len(targets)} holders of {what} ({tokens})?"


def _spec(client: redis.asyncio.Redis, view: View, side: str) -> Spec:
    """The keys and release script of the primitive (of the holder's side)."""
    if view.kind == "mutex":
        return RedisMutex(client, view.name, prefix=view.prefix)._spec
    if view.kind == "election":
        return RedisElection(client, view.name, prefix=view.prefix)._probe._spec
    if view.kind == "semaphore":
        assert isinstance(view.info, SemaphoreInfo)
        # The release script hands permits on under the stored limit; this one is unused.
        limit = view.info.limit or 1
        return RedisSemaphore(client, view.name, limit=limit, prefix=view.prefix)._spec
    rwlock = RedisReadWriteLock(client, view.name, prefix=view.prefix)
    return (rwlock.write() if side == "w" else rwlock.read())._spec


async def _release(client: redis.asyncio.Redis, view: View, holder: Holder, io: Streams) -> bool:
    """Release `holder` through the release script; report it and every grant it made."""
    spec = _spec(client, view, holder.side)
    context = context_for(client)
    member = context.waitqueue.member(holder.token, 1, spec.side)
    # No retry: run twice, the script would find the next holder and say "not held".
    reply = ReleaseReply.decode(
        await context.run(spec.release, spec.keys, (member, spec.channel, *spec.args), retry=False)
    )
    role = "held by" if view.kind == "mutex" else _ROLES[holder.side]
    released = reply.status is Released.HELD
    if released:
        its = "" if holder.fence is None else f" (fence {holder.fence})"
        io.say(f"released {view.kind} {view.name!r} {role} {holder.token}{its}")
    else:
        io.say(
            f"not released: {holder.token} no longer holds {view.kind} {view.name!r} "
            "(released, expired or replaced since it was shown)"
        )
    for token, fence, _ in reply.grants:
        io.say(f"  handed to {token} (fence {fence}), announced to its waiter")
    if released and not reply.grants:
        io.say("  nobody was waiting to take it")
    return released
