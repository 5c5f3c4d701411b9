"""`RedisMutex`: a FIFO, lease-renewed, fenced mutual-exclusion lock on Redis."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import final

from ._base import _spec
from ._base._adapter import text
from ._base._clients import AnyRedis
from ._base._errors import map_redis_errors
from ._base._keys import DEFAULT_PREFIX, name_tag
from ._base._query import query
from ._base._telemetry import Counters
from ._engine._leasedlock import DEFAULT_LOCAL_HANDOFF, MAX_LOCAL_HANDOFF, LeasedLock
from ._engine._settings import DEFAULT_REPLICA_TIMEOUT, DEFAULT_TTL, LostCallback, validate_int
from ._scripts import Script, load

__all__ = ["MutexInfo", "RedisMutex", "mutex_spec"]

_ACQUIRE = load("mutex_acquire")
_RELEASE = load("mutex_release")
_RENEW = load("renew_owner")
_ADOPT = load("adopt_owner")


@dataclass(frozen=True, slots=True)
class MutexInfo:
    """What the server says about a mutex (from `RedisMutex.inspect()`)."""

    name: str
    owner: str | None  # token of the current holder
    lease_remaining_ms: int | None  # of the current holder
    queue_length: int  # waiters queued (live or not yet purged)
    fence: int  # the last fencing token handed out (0: never acquired, or idle: expired)


def mutex_spec(prefix: str, name: str, counters: Counters | None = None) -> _spec.Spec:
    """The engine's view of the mutex `name`: its keys, channel and scripts (`counters`: an
    instance's cumulative counts, when several specs share them)."""
    keys, heartbeat_keys, channel, renew_keys = _mutex_keys(prefix, name)
    return _spec.Spec(
        name=name,
        side="x",
        keys=keys,
        heartbeat_keys=heartbeat_keys,
        channel=channel,
        watch_key=keys[0],
        acquire=_ACQUIRE,
        release=_RELEASE,
        renew=_RENEW,
        renew_keys=renew_keys,
        counters=Counters() if counters is None else counters,
    )


_Keys = tuple[tuple[bytes, ...], tuple[bytes, ...], bytes, tuple[bytes, ...]]


@functools.lru_cache(maxsize=4096)
def _mutex_keys(prefix: str, name: str) -> _Keys:
    """The mutex's keys, heartbeat keys, channel and renewal keys (the same for every
    instance of a name: a handler makes one per request, of a few names again and again)."""
    tag = name_tag(prefix, "mutex", name)
    owner, queue, waiters, fence = tag + b"owner", tag + b"queue", tag + b"waiters", tag + b"fence"
    return (owner, queue, waiters, fence), (waiters, queue), tag + b"wake", (owner, fence)


@final
class RedisMutex(LeasedLock):
    """A distributed mutex: one holder at a time across every process using the name.

    - Not reentrant: a task acquiring an instance it holds gets `LockReentry` at once.
    - One instance may be shared by many tasks, like `asyncio.Lock`; only the task that
      acquired may release (a holding of a task that has finished is adopted).
    - Fair: waiters are served in the order they queued, across processes; `release()`
      hands the lock straight to the next live waiter, so the releaser cannot barge back.
      Within one process its tasks pass it among themselves first, within a bound
      (`local_handoff`, below).
    - Leased: held for `ttl` seconds at a time and renewed in the background every ttl/3;
      if the lease is lost, the `async with` body is cancelled and `LockLost` raised.
    - Fenced: every acquisition gets a strictly larger `fencing_token`.
    """

    _kind = "mutex"
    _handle_kind = "mutex"

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        local_handoff: int | None = None,
        max_hold: float | None = None,
    ) -> None:
        """`local_handoff=N` (N > 0) lets this process's tasks pass the lock among
        themselves, without a round trip, up to N times in a row and for at most 10 ms after
        a waiter of another process queues (from then on, none after a holding that long)
        before it goes back to the global FIFO queue: much higher throughput under
        contention from one process, for bounded unfairness across processes. Fences stay
        strictly increasing across all holders. 0 is strict FIFO; None (the default) is
        16 (`DEFAULT_LOCAL_HANDOFF`), or 0 when `max_hold` is given.

        `max_hold` (seconds, None by default) caps each holding: at that age its renewal
        stops and it is reported lost (`LockLost` naming `max_hold`), so a stuck holder
        cannot keep the lock for ever. A cohort's lease outlives each holding, so with
        `max_hold` the instance is strict FIFO (an explicit `local_handoff=N` with it is
        a `ValueError`)."""
        if local_handoff is None:  # the default: a cohort, unless max_hold needs strict FIFO
            self._local_handoff = 0 if max_hold is not None else DEFAULT_LOCAL_HANDOFF
        else:
            self._local_handoff = validate_int(local_handoff, "local_handoff", 0, MAX_LOCAL_HANDOFF)
        super().__init__(
            client, name, ttl=ttl, timeout=timeout, prefix=prefix, on_lost=on_lost,
            replicas=replicas, replica_timeout=replica_timeout, max_hold=max_hold,
        )  # fmt: skip

    def _make_spec(self) -> _spec.Spec:
        return mutex_spec(self._prefix, self._name)

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        return _ADOPT, self._spec.renew_keys

    @query
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
            pipe.llen(queue)  # type: ignore[arg-type]  # bytes: valkey-py's hints say str
            pipe.get(fence)
            token, pttl, length, last = await pipe.execute()
        return MutexInfo(
            name=self._name,
            owner=None if token is None else text(token),
            lease_remaining_ms=int(pttl) if token is not None and int(pttl) >= 0 else None,
            queue_length=int(length),
            fence=int(last or 0),
        )
