"""`replicas=`: a grant is reported only once that many replicas have acknowledged it.

Redis replicates asynchronously, so a failover may promote a replica that never saw a
grant; with `replicas=n` the acquire script runs again followed by `WAIT n` on the same
connection, and a grant fewer replicas acknowledge in time is given back (`NotReplicated`).
"""

from __future__ import annotations

import asyncio

from .._base import _spec
from .._base._errors import LockLost, NotReplicated, map_redis_errors
from . import _confirm, _release
from ._context import ClientContext
from ._lockcore import LockCore

__all__ = ["confirm_replicated"]


async def confirm_replicated(lock: LockCore, context: ClientContext, grant: _spec.Grant) -> None:
    """Have `lock`'s `replicas` replicas acknowledge `grant` before it is reported; give it
    back and raise `NotReplicated` if they do not within `replica_timeout`."""
    given_back = False
    spec, ttl_ms, replicas = lock._spec, lock._ttl_ms, lock._replicas
    # The acquire script again (it may grant the token anew), on a pooled connection of its
    # own even with auto-pipelining: in a task that leaving does not stop, and the give-back
    # is sent after its reply (`_release.unstopped`).
    confirming = _confirm.confirm(
        context, spec, grant.token, ttl_ms, replicas, lock._replica_timeout_ms
    )
    in_flight = asyncio.ensure_future(confirming)
    try:
        with map_redis_errors(lock._name):
            status, acked = await asyncio.shield(in_flight)
        if status != _spec.GRANTED:
            raise LockLost(
                lock._name, "lost before its replication was confirmed", token=grant.token
            )
        if acked < replicas:
            given_back = True
            await _release.shielded(
                lambda: _release.release(context, spec, grant.token, ttl_ms),
                _release.CLEANUP_BOUND,
            )
            raise NotReplicated(
                lock._name,
                f"{acked} of {replicas} replica(s) acknowledged the grant within "
                f"{lock._replica_timeout_ms} ms; it was given back",
                token=grant.token,
            )
    except BaseException:
        if not given_back:
            await _release.withdraw(
                context, spec, grant.token, ttl_ms, None, after=_release.settled(in_flight)
            )
        raise
