"""The locks under comparison, each behind the same small async interface.

A `Peer` is one library opened on one server for one run: it makes lock objects for
names, runs the critical section's GET/SET through its own client, and records every
command its clients send in a `CommandLog`. Peers that are blocking libraries
(python-redis-lock) set `threaded`: the workloads then run each worker in a thread of its
own, where a blocking call is the natural way to use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Protocol, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
from _harness import CommandLog, counted_client, counted_sync_client

from aiolocks import RedisMutex

T = TypeVar("T")


class Contender(Protocol):
    """One lock object, used by one task (or thread) at a time."""

    async def acquire(self, timeout: float) -> bool: ...

    async def release(self) -> None: ...


class Peer:
    """A library under test; subclasses fill in `lock()` and, if needed, open/close."""

    key: ClassVar[str]
    label: ClassVar[str]
    threaded: ClassVar[bool] = False  # a blocking library: one thread per worker
    polls: ClassVar[bool] = False  # waiters poll the server while they wait
    loop: ClassVar[str] = "asyncio"  # the event loop of its runs and workers ("uvloop")

    def __init__(self, url: str, log: CommandLog, ttl: float, renew: bool) -> None:
        self.url = url
        self.log = log
        self.ttl = ttl
        self.renew = renew  # W6: use the library's own lease renewal where it has one
        self.client = counted_client(url, log)

    async def open(self) -> None:
        """Anything that needs the loop (connections, scripts)."""

    def lock(self, name: str) -> Contender:
        raise NotImplementedError

    def lease_key(self, name: str) -> str | None:
        """The key whose TTL is the holder's lease (crash recovery reads its PTTL)."""
        return None

    async def get(self, key: str) -> bytes | str | None:
        value: bytes | str | None = await self.client.get(key)
        return value

    async def set(self, key: str, value: int) -> None:
        await self.client.set(key, value)

    async def warm(self, connections: int) -> None:
        """Open `connections` connections before a measured phase."""
        await asyncio.gather(*(self.client.ping() for _ in range(connections)))

    async def close(self) -> None:
        await self.client.aclose()
        await self.client.connection_pool.disconnect()


# ----------------------------------------------------------------------------- aiolocks


class _AiolocksLock:
    def __init__(self, mutex: RedisMutex) -> None:
        self._mutex = mutex

    async def acquire(self, timeout: float) -> bool:
        return await self._mutex.acquire(timeout=timeout)

    async def release(self) -> None:
        await self._mutex.release()


class AiolocksPeer(Peer):
    key = "aiolocks"
    label = "aiolocks RedisMutex"

    def lock(self, name: str) -> Contender:
        return _AiolocksLock(RedisMutex(self.client, name, ttl=self.ttl))

    def lease_key(self, name: str) -> str:
        return f"aiolocks:mutex:{{{name}}}:owner"

    def engine_commands(self) -> int:
        from aiolocks._engine._context import context_for

        return context_for(self.client).commands_sent

    async def close(self) -> None:
        # Imported here: a worker may run an older aiolocks (bench_cost.py --tree), where the
        # context lives elsewhere; its tasks then end with the worker's loop.
        with contextlib.suppress(Exception):
            from aiolocks._engine._context import context_for

            await context_for(self.client).aclose()  # the pub/sub reader and the renewer
        await super().close()


class AiolocksLocalHandoffPeer(AiolocksPeer):
    """The same mutex with `local_handoff=16`: a process's tasks pass it among themselves."""

    key = "aiolocks_local16"
    label = "aiolocks RedisMutex local_handoff=16"

    def lock(self, name: str) -> Contender:
        return _AiolocksLock(RedisMutex(self.client, name, ttl=self.ttl, local_handoff=16))


class AiolocksStrictFifoPeer(AiolocksPeer):
    """`local_handoff=0`: strict FIFO across processes and tasks (the default until issue 45)."""

    key = "aiolocks_fifo"
    label = "aiolocks RedisMutex local_handoff=0"

    def lock(self, name: str) -> Contender:
        return _AiolocksLock(RedisMutex(self.client, name, ttl=self.ttl, local_handoff=0))


class AiolocksLocalHandoff4Peer(AiolocksPeer):
    """`local_handoff=4`: a remote waiter waits behind at most 4 local holdings."""

    key = "aiolocks_local4"
    label = "aiolocks RedisMutex local_handoff=4"

    def lock(self, name: str) -> Contender:
        return _AiolocksLock(RedisMutex(self.client, name, ttl=self.ttl, local_handoff=4))


class AiolocksUvloopPeer(AiolocksPeer):
    """The default mutex on uvloop's event loop (what `uvicorn[standard]` runs)."""

    key = "aiolocks_uvloop"
    label = "aiolocks RedisMutex, uvloop"
    loop = "uvloop"


class AiolocksLocalHandoffUvloopPeer(AiolocksLocalHandoffPeer):
    """`local_handoff=16` on uvloop's event loop."""

    key = "aiolocks_local16_uvloop"
    label = "aiolocks RedisMutex local_handoff=16, uvloop"
    loop = "uvloop"


# ----------------------------------------------------------------------------- redis-py


class _RedisPyLock:
    def __init__(self, client: redis.asyncio.Redis, name: str, ttl: float, sleep: float) -> None:
        # One Lock object per task: redis-py keeps the token in a threading.local that all
        # tasks of a loop share.
        self._lock = client.lock(name, timeout=ttl, sleep=sleep)

    async def acquire(self, timeout: float) -> bool:
        return bool(await self._lock.acquire(blocking_timeout=timeout))

    async def release(self) -> None:
        await self._lock.release()


class RedisPyPeer(Peer):
    key = "redispy_sleep_0.1"
    label = "redis-py Lock sleep=0.1"
    polls = True
    sleep: ClassVar[float] = 0.1

    def lock(self, name: str) -> Contender:
        return _RedisPyLock(self.client, name, self.ttl, self.sleep)

    def lease_key(self, name: str) -> str:
        return name


class RedisPyFastPeer(RedisPyPeer):
    key = "redispy_sleep_0.001"
    label = "redis-py Lock sleep=0.001"
    sleep = 0.001


# -------------------------------------------------------------------- python-redis-lock


class _PythonRedisLock:
    """Blocking calls on purpose: each worker of this peer is a thread of its own."""

    def __init__(self, client: redis.Redis, name: str, expire: int, renew: bool) -> None:
        import redis_lock

        self._expire = expire
        self._lock = redis_lock.Lock(client, name, expire=expire, auto_renewal=renew)

    async def acquire(self, timeout: float) -> bool:
        # Its timeout is whole seconds, and at most `expire` without renewal; wait in
        # chunks of at most `expire` (its own default BLPOP timeout) until the deadline.
        deadline = time.monotonic() + timeout
        while True:
            chunk = max(1, min(math.ceil(deadline - time.monotonic()), self._expire))
            if self._lock.acquire(timeout=chunk):
                return True
            if time.monotonic() >= deadline:
                return False

    async def release(self) -> None:
        self._lock.release()


class PythonRedisLockPeer(Peer):
    key = "python_redis_lock"
    label = "python-redis-lock (threads)"
    threaded = True

    def __init__(self, url: str, log: CommandLog, ttl: float, renew: bool) -> None:
        super().__init__(url, log, ttl, renew)
        # redis-py 8's blocking client times reads out after 5 s by default, which breaks
        # any BLPOP wait longer than that (TimeoutError, after a minute of retries).
        self.sync_client = counted_sync_client(url, log, socket_timeout=None)

    def lock(self, name: str) -> Contender:
        return _PythonRedisLock(self.sync_client, name, max(1, round(self.ttl)), self.renew)

    def lease_key(self, name: str) -> str:
        return f"lock:{name}"

    async def get(self, key: str) -> bytes | str | None:
        value: bytes | str | None = self.sync_client.get(key)  # in the worker's own thread
        return value

    async def set(self, key: str, value: int) -> None:
        self.sync_client.set(key, value)

    async def warm(self, connections: int) -> None:
        pool = self.sync_client.connection_pool
        taken = [pool.get_connection() for _ in range(connections)]
        for connection in taken:
            connection.connect()  # type: ignore[no-untyped-call]
            pool.release(connection)

    async def close(self) -> None:
        self.sync_client.close()
        self.sync_client.connection_pool.disconnect()
        await super().close()


# ------------------------------------------------------------------------------ pottery


class _PotteryLock:
    def __init__(self, client: redis.asyncio.Redis, name: str, ttl: float) -> None:
        from pottery import AIORedlock

        self._lock = AIORedlock(key=name, masters={client}, auto_release_time=ttl)

    async def acquire(self, timeout: float) -> bool:
        return bool(await self._lock.acquire(timeout=timeout))

    async def release(self) -> None:
        await self._lock.release()


class PotteryPeer(Peer):
    key = "pottery"
    label = "pottery AIORedlock (1 master)"
    polls = True

    def lock(self, name: str) -> Contender:
        return _PotteryLock(self.client, name, self.ttl)

    def lease_key(self, name: str) -> str:
        return f"redlock:{name}"


# --------------------------------------------------------------------------- aioredlock


class _AioredlockLock:
    def __init__(self, manager: Any, name: str, lease: float | None) -> None:
        self._manager = manager
        self._name = name
        self._lease = lease  # None: aioredlock's own auto-extension of its internal lease
        self._held: Any = None

    async def acquire(self, timeout: float) -> bool:
        from aioredlock import LockError

        # lock() tries retry_count (3) times, 0.1-0.3 s apart, then raises: a user who wants
        # to wait longer calls it again, as here, until the deadline.
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._held = await self._manager.lock(self._name, lock_timeout=self._lease)
                return True
            except LockError:
                if time.monotonic() >= deadline:
                    return False

    async def release(self) -> None:
        await self._manager.unlock(self._held)
        self._held = None


class AioredlockPeer(Peer):
    """aioredlock talks to Redis through aioredis 1.x, not redis-py: its commands are
    counted by wrapping aioredis' `RedisConnection.execute` while this peer is open."""

    key = "aioredlock"
    label = "aioredlock"
    polls = True

    async def open(self) -> None:
        import aioredis.connection
        from aioredlock import Aioredlock

        connection_class: Any = aioredis.connection.RedisConnection
        execute: Callable[..., Any] = connection_class.execute
        log = self.log

        def counted_execute(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            name = command.decode() if isinstance(command, bytes) else str(command)
            log.record_name(name.lower())
            return execute(connection, command, *args, **kwargs)

        connection_class.execute = counted_execute
        self._restore: Callable[[], None] = lambda: setattr(connection_class, "execute", execute)
        parts = urlsplit(self.url)
        db = int(parts.path.lstrip("/") or 0)
        self.manager = Aioredlock(
            [{"host": parts.hostname, "port": parts.port, "db": db}],
            internal_lock_timeout=self.ttl,
        )

    def lock(self, name: str) -> Contender:
        return _AioredlockLock(self.manager, name, None if self.renew else self.ttl)

    def lease_key(self, name: str) -> str:
        return name

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.manager.destroy()
        self._restore()
        await super().close()


# ---------------------------------------------------------------------------- the floor


class _LocalLock:
    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock = lock

    async def acquire(self, timeout: float) -> bool:
        # No timeout here: wait_for would add a task per acquisition to the floor; every run
        # is bounded by its hard stop anyway.
        await self._lock.acquire()
        return True

    async def release(self) -> None:
        self._lock.release()


class FloorPeer(Peer):
    """The same critical section under a plain in-process `asyncio.Lock`."""

    key = "asyncio_lock"
    label = "asyncio.Lock (in-process floor)"

    def __init__(self, url: str, log: CommandLog, ttl: float, renew: bool) -> None:
        super().__init__(url, log, ttl, renew)
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, name: str) -> Contender:
        return _LocalLock(self._locks.setdefault(name, asyncio.Lock()))


PEERS: tuple[type[Peer], ...] = (
    AiolocksPeer,
    AiolocksLocalHandoffPeer,
    AiolocksUvloopPeer,
    AiolocksLocalHandoffUvloopPeer,
    RedisPyPeer,
    RedisPyFastPeer,
    PythonRedisLockPeer,
    PotteryPeer,
    AioredlockPeer,
    FloorPeer,
)
_EXTRA: tuple[type[Peer], ...] = (AiolocksLocalHandoff4Peer, AiolocksStrictFifoPeer)  # bench_cost
BY_KEY = {peer.key: peer for peer in PEERS + _EXTRA}
FLOOR = FloorPeer.key

# The importable module each optional peer needs.
_NEEDS = {
    PythonRedisLockPeer.key: "redis_lock",
    PotteryPeer.key: "pottery",
    AioredlockPeer.key: "aioredlock",
    AiolocksUvloopPeer.key: "uvloop",
    AiolocksLocalHandoffUvloopPeer.key: "uvloop",
}


def run_on_loop(peer: type[Peer], coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on the peer's event loop (a fresh one: nothing outlives it)."""
    if peer.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def unavailable(peer: type[Peer]) -> str | None:
    """Why `peer` cannot run here (its library does not import), or None."""
    module = _NEEDS.get(peer.key)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a library broken on this Python
        return f"not installed or not importable: {type(exc).__name__}: {exc}"
    return None
