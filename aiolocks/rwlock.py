"""`RedisReadWriteLock`: many readers or one writer, fair (no writer starvation), on Redis."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, final

from ._base import _spec
from ._base._adapter import text
from ._base._clients import AnyRedis
from ._base._errors import map_redis_errors
from ._base._keys import DEFAULT_PREFIX, KeySpace
from ._base._query import query
from ._engine._context import context_for
from ._engine._leasedlock import LeasedLock
from ._engine._settings import DEFAULT_REPLICA_TIMEOUT, DEFAULT_TTL, LostCallback
from ._leases._keeper import Holding
from ._scripts import Script, load

__all__ = ["RWLockInfo", "ReadLock", "RedisReadWriteLock", "WriteLock"]

_ACQUIRE = load("rwlock_acquire", "rwlock")
_RELEASE = load("rwlock_release", "rwlock")
_INSPECT = load("rwlock_inspect")
_RENEW_READER = load("renew_member")
_RENEW_WRITER = load("renew_owner")
_ADOPT_READER = load("adopt_member")
_ADOPT_WRITER = load("adopt_owner")


@dataclass(frozen=True, slots=True)
class RWLockInfo:
    """What the server says about a read-write lock (from `inspect()`)."""

    name: str
    writer: str | None  # token of the writer holding it
    readers: int  # live readers
    queue_length: int  # waiters queued, readers and writers
    fence: int  # the last fencing token handed out (0: never acquired, or idle: expired)


class _Side(LeasedLock):
    """One side of a `RedisReadWriteLock`; its keys are the lock's."""

    _kind = "rwlock"
    _side = "x"
    _renew: Script

    def __init__(self, owner: RedisReadWriteLock, **options: Any) -> None:
        super().__init__(owner._client, owner.name, **options)
        # The other side's holdings (`_held_elsewhere`), set by the lock once both sides
        # are made. Not the lock itself: it refers to both sides, and a side referring back
        # would make every read-write lock a cycle, freed only by the garbage collector.
        self._other_side: dict[asyncio.Task[Any], Holding] = {}

    def _make_spec(self) -> _spec.Spec:
        keys = KeySpace(self._prefix, self._kind, self._name)
        parts = ("writer", "readers", "queue", "waiters", "fence", "fences")
        writer, readers, queue, waiters, fence, fences = (keys.key(part) for part in parts)
        return _spec.Spec(
            name=self._name,
            side=self._side,
            keys=(writer, readers, queue, waiters, fence, fences),
            heartbeat_keys=(waiters, queue),
            channel=keys.key("wake"),
            watch_key=writer,
            acquire=_ACQUIRE,
            release=_RELEASE,
            renew=self._renew,
            renew_keys=(writer, fence) if self._side == "w" else (readers, fences, fence),
            shared=True,
        )

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        # The lease's keys (see _make_spec): the adopt scripts keep them as renewals do.
        if self._side == "w":
            return _ADOPT_WRITER, self._spec.renew_keys
        return _ADOPT_READER, self._spec.renew_keys

    def _held_elsewhere(self, task: asyncio.Task[Any]) -> Holding | None:
        return self._other_side.get(task)

    async def inspect(self) -> RWLockInfo:
        """The server's view of the whole lock (both sides): writer, live readers, queue
        length, last fence."""
        with map_redis_errors(self._name):
            writer, readers, queue, fence = await context_for(self._client).run(
                _INSPECT, self._spec.keys, ()
            )
        return RWLockInfo(
            name=self._name,
            writer=None if writer is None else text(writer),
            readers=int(readers),
            queue_length=int(queue),
            fence=int(fence),
        )


@final
class ReadLock(_Side):
    """The read side of a `RedisReadWriteLock`: held by many tasks at once, never with a
    writer. Shareable by many tasks like `RedisMutex`; each acquisition is its own lease."""

    _side = "r"
    _renew = _RENEW_READER
    _handle_kind = "rwlock-read"

    @query
    async def locked(self) -> bool:
        """True when a reader could not enter now because a writer holds it (asks Redis)."""
        return (await self.inspect()).writer is not None


@final
class WriteLock(_Side):
    """The write side of a `RedisReadWriteLock`: one writer, no readers. Shareable by many
    tasks like `RedisMutex`."""

    _side = "w"
    _renew = _RENEW_WRITER
    _handle_kind = "rwlock-write"

    @query
    async def locked(self) -> bool:
        """True when anyone, reader or writer, holds the lock (asks Redis)."""
        info = await self.inspect()
        return info.writer is not None or info.readers > 0


@final
class RedisReadWriteLock:
    """A distributed read-write lock: many readers at once, or one writer alone.

    Fair: once a writer is queued, readers that arrive after it wait behind it, and when a
    writer releases, every reader queued before the next writer enters together. Every
    reader has its own lease, so a crashed reader blocks writers for at most its ttl.
    Leases, fencing (one counter for both sides), lease loss and cancellation behave as for
    `RedisMutex`. A task holding one side that asks for the other gets `LockReentry`.
    """

    __slots__ = ("_client", "_read", "_write", "name")

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
        max_hold: float | None = None,
    ) -> None:
        self._client = client
        self.name = name
        options: dict[str, Any] = {
            "ttl": ttl,
            "timeout": timeout,
            "prefix": prefix,
            "on_lost": on_lost,
            "replicas": replicas,
            "replica_timeout": replica_timeout,
            "max_hold": max_hold,
        }
        self._read = ReadLock(self, **options)  # validates every argument
        self._write = WriteLock(self, **options)
        self._read._other_side = self._write._holdings
        self._write._other_side = self._read._holdings

    def read(self) -> ReadLock:
        """The read side (the same object each call)."""
        return self._read

    def write(self) -> WriteLock:
        """The write side (the same object each call)."""
        return self._write

    def __repr__(self) -> str:
        return f"<RedisReadWriteLock {self.name!r}>"

    async def inspect(self) -> RWLockInfo:
        """The server's view: writer, live readers, queue length, last fence."""
        return await self._read.inspect()
