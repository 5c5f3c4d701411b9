"""`RedisSemaphore`: a FIFO, lease-renewed, fenced counting semaphore on Redis."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, final

from ._base import _clock, _spec
from ._base._clients import AnyRedis
from ._base._errors import LimitMismatch, map_redis_errors
from ._base._keys import DEFAULT_PREFIX, KeySpace
from ._base._query import query
from ._engine import _release
from ._engine._context import context_for
from ._engine._leasedlock import LeasedLock
from ._engine._settings import DEFAULT_REPLICA_TIMEOUT, DEFAULT_TTL, LostCallback, validate_int
from ._scripts import Script, load

__all__ = ["RedisSemaphore", "SemaphoreInfo"]

_ACQUIRE = load("semaphore_acquire", "semaphore")
_RELEASE = load("semaphore_release", "semaphore")
_SET_LIMIT = load("semaphore_set_limit", "semaphore")
_INSPECT = load("semaphore_inspect")
_RENEW = load("renew_member")
_ADOPT = load("adopt_member")


@dataclass(frozen=True, slots=True)
class SemaphoreInfo:
    """What the server says about a semaphore (from `RedisSemaphore.inspect()`)."""

    name: str
    limit: int | None  # the stored limit (None: never used, or idle: expired)
    holders: int  # live holders
    queue_length: int  # waiters queued (live or not yet purged)
    fence: int  # the last fencing token handed out (0: never acquired, or idle: expired)


# The largest limit: stored and compared exactly by the Lua scripts (numbers are doubles,
# written with 14 significant digits).
MAX_LIMIT = 2**31 - 1


def _mismatch(name: str, limit: int, stored: int) -> LimitMismatch:
    """The error of an acquisition refused because the name is stored with another limit."""
    return LimitMismatch(
        name,
        f"stored with limit {stored}, used here with limit {limit}; "
        "use set_limit() to change it on purpose",
    )


@final
class RedisSemaphore(LeasedLock):
    """A distributed counting semaphore: at most `limit` holders at a time, across processes.

    - Each holding is its own lease (own token, own fence, renewed in the background); a
      crashed holder's permit comes back when its lease ends.
    - Fair: waiters get permits in the order they queued; a release hands its permit
      straight to the first live waiter, and permits freed at once wake that many waiters.
    - The limit is stored with the name. Using the name with another limit raises
      `LimitMismatch` (nothing changes); `set_limit()` changes it on purpose.
    - Not reentrant per task: a task that holds a permit of this instance gets
      `LockReentry` if it asks for another through the same instance.
    """

    _kind = "semaphore"
    _handle_kind = "semaphore"

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        limit: int,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        max_hold: float | None = None,
    ) -> None:
        self._limit = validate_int(limit, "limit", 1, MAX_LIMIT)
        super().__init__(
            client,
            name,
            ttl=ttl,
            timeout=timeout,
            prefix=prefix,
            on_lost=on_lost,
            replicas=replicas,
            replica_timeout=replica_timeout,
            max_hold=max_hold,
        )

    @property
    def limit(self) -> int:
        return self._limit

    def _make_spec(self) -> _spec.Spec:
        keys = KeySpace(self._prefix, self._kind, self._name)
        parts = ("holders", "queue", "waiters", "fence", "fences", "limit")
        holders, queue, waiters, fence, fences, limit = (keys.key(part) for part in parts)
        return _spec.Spec(
            name=self._name,
            side="x",
            keys=(holders, queue, waiters, fence, fences, limit),
            heartbeat_keys=(waiters, queue, limit),
            channel=keys.key("wake"),
            watch_key=None,
            acquire=_ACQUIRE,
            release=_RELEASE,
            renew=_RENEW,
            renew_keys=(holders, fences, fence, limit),
            args=(self._limit,),
            shared=True,
            # (not a bound method: the spec would refer back to the semaphore, a cycle)
            refused=functools.partial(_mismatch, self._name, self._limit),
        )

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        return _ADOPT, self._spec.renew_keys  # holders, fences, then the keys kept with them

    async def _view(self) -> list[Any]:
        with map_redis_errors(self._name):
            reply: list[Any] = await context_for(self._client).run(_INSPECT, self._spec.keys, ())
        return reply

    async def inspect(self) -> SemaphoreInfo:
        """The server's view: stored limit, live holders, queue length, last fence."""
        limit, holders, queue, fence = await self._view()
        return SemaphoreInfo(
            name=self._name,
            limit=None if int(limit) < 0 else int(limit),
            holders=int(holders),
            queue_length=int(queue),
            fence=int(fence),
        )

    async def holders(self) -> int:
        """How many permits are held right now (asks Redis)."""
        return (await self.inspect()).holders

    async def available(self) -> int:
        """How many permits are free right now (asks Redis)."""
        info = await self.inspect()
        return max(0, (info.limit or self._limit) - info.holders)

    @query
    async def locked(self) -> bool:
        """True when no permit is free (asks Redis)."""
        return await self.available() == 0

    async def set_limit(self, limit: int) -> None:
        """Store a new limit for the name; a higher one gives the new permits to waiters.

        Lowering it takes no permit away: holders keep theirs until they release. Waiters
        already queued keep waiting under the new limit; new acquisitions through instances
        still configured with the old limit get `LimitMismatch`. Like the rest of the
        name's keys, the stored limit expires once nobody has held or waited for ttl + 1 s.
        """
        limit = validate_int(limit, "limit", 1, MAX_LIMIT)
        context = context_for(self._client)
        args = (limit, self._spec.channel, context.waitqueue.tag, self._ttl_ms)
        sent_at = _clock.monotonic()
        with map_redis_errors(self._name):
            reply = await _release.granting(context, self._spec, _SET_LIMIT, args, retry=True)
        self._limit = limit
        self._spec = replace(self._make_spec(), counters=self._spec.counters)
        _release.wake_granted(context, self._spec, _release.granted_in(reply, 1), sent_at)
