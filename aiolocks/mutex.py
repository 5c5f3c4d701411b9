"""`RedisMutex`: a FIFO, lease-renewed, fenced mutual-exclusion lock on Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from . import _acquire
from ._errors import map_redis_errors
from ._holding import LeasedLock
from ._keys import KeySpace
from ._scripts import load

__all__ = ["MutexInfo", "RedisMutex"]

_ACQUIRE = load("mutex_acquire")
_RELEASE = load("mutex_release")
_RENEW = load("renew_owner")


@dataclass(frozen=True, slots=True)
class MutexInfo:
    """What the server says about a mutex (from `RedisMutex.inspect()`)."""

    name: str
    owner: str | None  # token of the current holder
    lease_remaining_ms: int | None  # of the current holder
    queue_length: int  # waiters queued (live or not yet purged)
    fence: int  # the last fencing token handed out (0: never acquired)


@final
class RedisMutex(LeasedLock):
    """A distributed mutex: one holder at a time across every process using the name.

    - Not reentrant: a task acquiring an instance it holds gets `LockReentry` at once.
    - One instance may be shared by many tasks, like `asyncio.Lock`; only the task that
      acquired may release (a holding of a task that has finished is adopted).
    - Fair: waiters are served in the order they queued, across processes; `release()`
      hands the lock straight to the next live waiter, so the releaser cannot barge back.
    - Leased: held for `ttl` seconds at a time and renewed in the background every ttl/3;
      if the lease is lost, the `async with` body is cancelled and `LockLost` raised.
    - Fenced: every acquisition gets a strictly larger `fencing_token`.
    """

    _kind = "mutex"

    def _make_spec(self) -> _acquire.Spec:
        keys = KeySpace(self._prefix, self._kind, self._name)
        owner = keys.key("owner")
        waiters = keys.key("waiters")
        return _acquire.Spec(
            name=self._name,
            kind="x",
            keys=(owner, keys.key("queue"), waiters, keys.key("fence")),
            waiters_key=waiters,
            channel=keys.key("wake"),
            watch_key=owner,
            acquire=_ACQUIRE,
            release=_RELEASE,
            renew=_RENEW,
            renew_keys=(owner,),
        )

    async def locked(self) -> bool:
        """True if anyone holds the mutex right now (asks Redis)."""
        with map_redis_errors(self._name):
            return bool(await self._client.exists(self._spec.keys[0]))

    async def inspect(self) -> MutexInfo:
        """The server's view: holder, lease left, queue length, last fence (one round trip)."""
        owner, queue, _, fence = self._spec.keys
        with map_redis_errors(self._name):
            pipe = self._client.pipeline(transaction=False)
            pipe.get(owner)
            pipe.pttl(owner)
            pipe.llen(queue)
            pipe.get(fence)
            token, pttl, length, last = await pipe.execute()
        if isinstance(token, bytes):
            token = token.decode()
        return MutexInfo(
            name=self._name,
            owner=token,
            lease_remaining_ms=int(pttl) if token is not None and int(pttl) >= 0 else None,
            queue_length=int(length),
            fence=int(last or 0),
        )
