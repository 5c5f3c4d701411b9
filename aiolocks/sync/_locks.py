"""The sync door's mutex, semaphore and read-write lock: the asyncio classes of the same
names, with the same arguments and defaults (read from them), driven for threads."""

from __future__ import annotations

import inspect
from typing import Any, final

from .. import MutexInfo, RWLockInfo, SemaphoreInfo
from .. import RedisMutex as AsyncMutex
from .. import RedisReadWriteLock as AsyncReadWriteLock
from .. import RedisSemaphore as AsyncSemaphore
from ._clients import SyncClient, async_client, validate_client
from ._leased import LostCallback, SyncLock
from ._runner import PerProcess, process

__all__ = ["ReadLock", "RedisMutex", "RedisReadWriteLock", "RedisSemaphore", "WriteLock"]


def _default(cls: type, argument: str) -> Any:
    """The asyncio class's default for `argument` (so the two doors never differ)."""
    return inspect.signature(cls).parameters[argument].default


_TTL = _default(AsyncMutex, "ttl")
_PREFIX = _default(AsyncMutex, "prefix")
_REPLICA_TIMEOUT = _default(AsyncMutex, "replica_timeout")
_LOCAL_HANDOFF = _default(AsyncMutex, "local_handoff")


@final
class RedisMutex(SyncLock[AsyncMutex]):
    """`aiolocks.RedisMutex` for threads: the same keys, queue, fences and leases, so
    threads and asyncio tasks of any process queue for one name together.

    `with RedisMutex(redis.Redis(...), "orders:42"):`. Not reentrant; held by the thread
    that acquired it (another thread's `release()` gets `LockNotOwned`); a lost lease sets
    `lost` (a `threading.Event`), calls `on_lost`, and leaving the `with` raises `LockLost`.
    """

    def __init__(
        self,
        client: SyncClient,
        name: str,
        *,
        ttl: float = _TTL,
        timeout: float | None = None,
        prefix: str = _PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = _REPLICA_TIMEOUT,
        local_handoff: int | None = _LOCAL_HANDOFF,
        max_hold: float | None = None,
    ) -> None:
        """The arguments of `aiolocks.RedisMutex`; `client` is a sync redis-py or valkey-py
        client, or a URL. `on_lost` is called on the background loop's thread."""
        self._options: dict[str, Any] = {
            "name": name, "ttl": ttl, "timeout": timeout, "prefix": prefix,
            "replicas": replicas, "replica_timeout": replica_timeout,
            "local_handoff": local_handoff, "max_hold": max_hold,
        }  # fmt: skip
        super().__init__(client, name, timeout, on_lost)

    def _build(self) -> AsyncMutex:
        return AsyncMutex(async_client(self._client), on_lost=self._reported, **self._options)

    def inspect(self) -> MutexInfo:
        """The server's view: holder, lease left, queue length, last fence."""
        return process().call(self._lock().inspect)


@final
class RedisSemaphore(SyncLock[AsyncSemaphore]):
    """`aiolocks.RedisSemaphore` for threads (at most `limit` holders across every process
    and task using the name); held per thread, like `RedisMutex`."""

    def __init__(
        self,
        client: SyncClient,
        name: str,
        *,
        limit: int,
        ttl: float = _TTL,
        timeout: float | None = None,
        prefix: str = _PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = _REPLICA_TIMEOUT,
        max_hold: float | None = None,
    ) -> None:
        self._options: dict[str, Any] = {
            "name": name, "limit": limit, "ttl": ttl, "timeout": timeout, "prefix": prefix,
            "replicas": replicas, "replica_timeout": replica_timeout, "max_hold": max_hold,
        }  # fmt: skip
        super().__init__(client, name, timeout, on_lost)

    def _build(self) -> AsyncSemaphore:
        return AsyncSemaphore(async_client(self._client), on_lost=self._reported, **self._options)

    @property
    def limit(self) -> int:
        return self._lock().limit

    def inspect(self) -> SemaphoreInfo:
        """The server's view: holders, limit, queue length, last fence."""
        return process().call(self._lock().inspect)

    def holders(self) -> int:
        """How many hold it now (asks Redis)."""
        return process().call(self._lock().holders)

    def available(self) -> int:
        """How many more could hold it now (asks Redis)."""
        return process().call(self._lock().available)

    def set_limit(self, limit: int) -> None:
        """Change the stored limit for every user of the name (see the asyncio API)."""
        lock = self._lock()
        process().call(lambda: lock.set_limit(limit))
        self._options["limit"] = limit


class _Side(SyncLock[Any]):
    def __init__(self, owner: RedisReadWriteLock, write: bool) -> None:
        self._owner = owner
        self._write = write
        super().__init__(owner._client, owner._name, owner._timeout, owner._on_lost)

    def _build(self) -> Any:
        rw = self._owner._rw.get()[0]
        return rw.write() if self._write else rw.read()

    def inspect(self) -> RWLockInfo:
        return self._owner.inspect()


@final
class ReadLock(_Side):
    """The read side of `aiolocks.sync.RedisReadWriteLock` (many readers at once)."""


@final
class WriteLock(_Side):
    """The write side of `aiolocks.sync.RedisReadWriteLock` (one writer, no readers)."""


@final
class RedisReadWriteLock:
    """`aiolocks.RedisReadWriteLock` for threads: `with rw.read():` / `with rw.write():`,
    each side held per thread like `RedisMutex`."""

    def __init__(
        self,
        client: SyncClient,
        name: str,
        *,
        ttl: float = _TTL,
        timeout: float | None = None,
        prefix: str = _PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = _REPLICA_TIMEOUT,
        max_hold: float | None = None,
    ) -> None:
        self._client = client
        self._name = name
        self._timeout = timeout
        self._on_lost = on_lost
        self._options: dict[str, Any] = {
            "name": name, "ttl": ttl, "timeout": timeout, "prefix": prefix,
            "replicas": replicas, "replica_timeout": replica_timeout, "max_hold": max_hold,
        }  # fmt: skip
        self._rw: PerProcess[AsyncReadWriteLock] = PerProcess(self._build)
        self._read = ReadLock(self, write=False)
        self._write = WriteLock(self, write=True)
        self._read._other, self._write._other = self._write, self._read

    def _build(self) -> AsyncReadWriteLock:
        validate_client(self._client)
        return AsyncReadWriteLock(
            async_client(self._client), on_lost=self._reported, **self._options
        )

    def _reported(self, error: Any) -> None:
        for side in (self._read, self._write):
            if side._match(error):
                break
        side._call_on_lost(error)

    def read(self) -> ReadLock:
        """The read side (the same object each call)."""
        return self._read

    def write(self) -> WriteLock:
        """The write side (the same object each call)."""
        return self._write

    def __repr__(self) -> str:
        return f"<aiolocks.sync.RedisReadWriteLock {self._name!r}>"

    def inspect(self) -> RWLockInfo:
        """The server's view: readers, writer, queue length, last fence."""
        return process().call(self._rw.get()[0].inspect)
