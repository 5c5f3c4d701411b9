"""Confirming a grant with the server before it is reported.

A grant learnt late (a stalled loop, a slow link) may leave its lease little validity:
it is confirmed by re-running the acquire script (`late_grant`, `LateGrants`). A grant
that must survive a failover is confirmed replicated (`confirm`).
"""

from __future__ import annotations

import time

from .._base._spec import Spec
from .._leases._lease import validity
from .._waiting._lot import Waiter
from ._context import ClientContext

__all__ = ["LateGrants", "confirm", "late_grant"]

# A grant whose lease, counted from a moment known to precede it, has less than this part
# of its ttl left is confirmed with the server before it is reported (see LateGrants).
_CONFIRM_BELOW, _MAX_CONFIRMS = 0.5, 3


def late_grant(granted_at: float, ttl_ms: int) -> bool:
    """A grant whose lease, counted from `granted_at`, has less than half its validity left:
    to be confirmed with the server before it is reported (see `LateGrants`)."""
    ttl = ttl_ms / 1000.0
    return validity(granted_at, ttl) - time.monotonic() < ttl * _CONFIRM_BELOW


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
