"""Shared pieces of the fault-injection suite (``tests/test_faults_*.py``): the three
primitives behind one face, contended runs that log their holdings, and key checks."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis.asyncio
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from _history import HistoryLog, check

from aiolocks import (
    LockLost,
    LockTimeout,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._engine._leasedlock import LeasedLock
from aiolocks._engine._release import _BACKGROUND

__all__ = [
    "KINDS",
    "Audit",
    "Contention",
    "Kind",
    "Side",
    "aiolocks_keys",
    "audit",
    "close_client",
    "leftovers",
    "make_sides",
    "snapshot",
]

Kind = Literal["mutex", "semaphore", "rwlock"]
KINDS: tuple[Kind, ...] = ("mutex", "semaphore", "rwlock")
# What may stay behind for the idle window (ttl + 1 s) once nothing is held or queued, with
# an expiry (docs/architecture.md, "What counts as orphaned"): the fence counter of every
# primitive, and the stored limit of a semaphore. Anything else, or any key without an
# expiry, is an orphan.
# How long a test's teardown lets aiolocks' background clean-ups finish.
CLEANUP_WAIT = 5.0
_KEPT = {"mutex": {"fence"}, "semaphore": {"fence", "limit"}, "rwlock": {"fence"}}


@dataclass(frozen=True)
class Side:
    """One way to hold a primitive, and the history kind its holdings log as."""

    lock: LeasedLock
    kind: str  # "x", "r" or "s" (see _history)


def make_sides(
    client: redis.asyncio.Redis, kind: Kind, name: str, *, limit: int = 2, **options: Any
) -> list[Side]:
    """The ways to hold `kind` named `name` through `client`: one for the mutex, one for
    the semaphore (``s``, or ``x`` with one permit), read and write for the RW lock."""
    if kind == "mutex":
        return [Side(RedisMutex(client, name, **options), "x")]
    if kind == "semaphore":
        sem = RedisSemaphore(client, name, limit=limit, **options)
        return [Side(sem, "x" if limit == 1 else "s")]
    rw = RedisReadWriteLock(client, name, **options)
    return [Side(rw.read(), "r"), Side(rw.write(), "x")]


async def aiolocks_keys(client: redis.asyncio.Redis, kind: str, name: str) -> dict[str, str]:
    """Every aiolocks key of primitive `name`: its part ("owner", "queue", ...) -> type."""
    prefix = f"aiolocks:{kind}:{{{name}}}:"
    found: dict[str, str] = {}
    async for key in client.scan_iter(match=f"{prefix}*"):
        text = key.decode() if isinstance(key, bytes) else key
        key_type = await client.type(key)
        found[text.removeprefix(prefix)] = (
            key_type.decode() if isinstance(key_type, bytes) else key_type
        )
    return found


async def leftovers(client: redis.asyncio.Redis, kind: str, name: str) -> dict[str, str]:
    """The keys of `name` that should be gone when nobody holds or waits (orphans): any
    but the fence counter and a semaphore's limit, and any without an expiry."""
    keys = await aiolocks_keys(client, kind, name)
    prefix = f"aiolocks:{kind}:{{{name}}}:"
    return {
        part: key_type
        for part, key_type in keys.items()
        if part not in _KEPT[kind] or await client.pttl(prefix + part) < 0
    }


async def snapshot(client: redis.asyncio.Redis) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key of the database: its DUMP (type and value, byte for byte) and whether it
    has an expiry."""
    found: dict[bytes, tuple[bytes | None, bool]] = {}
    async for key in client.scan_iter(match="*"):
        dump = await client.dump(key)
        found[key] = (dump, int(await client.pttl(key)) >= 0)
    return found


@dataclass
class Contention:
    """Tasks taking turns on a set of `Side`s, each logging its holdings in a `HistoryLog`.

    Failures a fault may cause (`LockLost`, `ServerUnavailable`, a connection error of the
    log itself, `LockTimeout`) are counted and the iteration is tried again, so every task
    finishes its `iterations` once the fault is over.
    """

    iterations: int
    hold: float = 0.003  # longest sleep inside the critical section
    seed: int = 7
    completed: int = 0
    lost: int = 0
    unavailable: int = 0
    timeouts: int = 0
    grants: list[tuple[str, float]] = field(default_factory=list)  # (who, monotonic)

    async def run_task(self, sides: list[Side], log: HistoryLog, who: str) -> None:
        rng = random.Random(f"{self.seed}:{who}")
        done = 0
        while done < self.iterations:
            side = rng.choice(sides)
            try:
                async with side.lock:
                    self.grants.append((who, time.monotonic()))
                    fence = side.lock.fencing_token
                    assert fence is not None
                    started = await log.start()
                    await asyncio.sleep(rng.random() * self.hold)
                    await log.end(side.kind, fence, started, who)
                done += 1
                self.completed += 1
            except LockLost:
                self.lost += 1
            except LockTimeout:
                self.timeouts += 1
            except (ServerUnavailable, redis.exceptions.ConnectionError):
                self.unavailable += 1

    async def run(
        self,
        workers: list[tuple[list[Side], HistoryLog, str]],
        chaos: Callable[[], Awaitable[None]] | None = None,
        timeout: float = 60.0,
    ) -> None:
        """Run every worker to completion while `chaos()` (if given) runs beside them; the
        chaos task is cancelled once the workers are done."""
        runs = [asyncio.create_task(self.run_task(*worker)) for worker in workers]
        chaos_task = asyncio.ensure_future(chaos()) if chaos is not None else None
        try:
            await asyncio.wait_for(asyncio.gather(*runs), timeout)
        finally:
            await stop_tasks([*runs, *([chaos_task] if chaos_task is not None else [])])


async def stop_tasks(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` until every one has ended. Once is not always enough: on Python 3.11
    redis-py 8.x sends each command under `asyncio.wait_for` (its default socket_timeout is
    5 s), which returns the send's result when a cancellation lands as the send completes,
    and a chaos loop then goes on sending for ever."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=1.0)
    await asyncio.gather(*tasks, return_exceptions=True)


async def settle(
    client: redis.asyncio.Redis, kind: Kind, name: str, *, limit: int = 2, timeout: float = 10.0
) -> float:
    """Take every permit of `name` (waiting for stray leases to end), then give them back:
    the scripts purge whatever dead holders and waiters are left. Returns the seconds it
    took, the time the primitive needed to recover."""
    started = time.monotonic()
    if kind == "semaphore":
        sem = RedisSemaphore(client, name, limit=limit, ttl=5)
        locks: list[LeasedLock] = [sem] * limit
    elif kind == "rwlock":
        locks = [RedisReadWriteLock(client, name, ttl=5).write()]
    else:
        locks = [RedisMutex(client, name, ttl=5)]
    entered = asyncio.Event()
    count = 0

    async def take(lock: LeasedLock) -> None:
        nonlocal count
        assert await lock.acquire(timeout=timeout), f"{kind} {name!r} stuck for {timeout} s"
        count += 1
        if count == len(locks):
            entered.set()
        await entered.wait()
        await lock.release()

    await asyncio.gather(*(take(lock) for lock in locks))
    return time.monotonic() - started


async def close_client(client: redis.asyncio.Redis | RedisCluster) -> None:
    """Let aiolocks' background clean-ups end (bounded), stop the client's aiolocks engine
    (lease keeper, notifier, auto-pipeline link), then close the client.

    A keeper renewing (or a notifier re-connecting) through a link the test broke may be
    mid-connect when the test ends, and a clean-up still running would open a link while
    the event loop shuts down; closing only the client would leave those sockets to the
    garbage collector, after the loop is gone."""
    cleanups = [task for task in _BACKGROUND if not task.done()]
    if cleanups:
        await asyncio.wait(cleanups, timeout=CLEANUP_WAIT)
    for context in list(getattr(client, "_aiolocks_contexts", {}).values()):
        await context.aclose()
    await client.aclose()


@dataclass
class Audit:
    """What `audit` found after a run."""

    problems: list[str]
    orphaned: int  # keys left that should be gone
    holdings: int  # logged holdings, all primitives
    settle_times: list[float]  # seconds each primitive took to settle


async def audit(
    client: redis.asyncio.Redis, names: dict[Kind, str], *, settle_timeout: float = 10.0
) -> Audit:
    """After a run over `names` (kind -> name, each logged in a `HistoryLog` of that name):
    check every history (2 permits for the semaphore), settle every primitive, then look
    for orphaned keys."""
    found = Audit([], 0, 0, [])
    for kind, name in names.items():
        log = HistoryLog(client, name)
        entries = await log.entries()
        found.holdings += len(entries)
        found.problems += [
            f"{kind}: {problem}" for problem in check(entries, limit=2, counter=await log.counter())
        ]
        found.settle_times.append(await settle(client, kind, name, timeout=settle_timeout))
        orphans = await leftovers(client, kind, name)
        found.orphaned += len(orphans)
        found.problems += [f"{kind}: orphaned {orphans}"] if orphans else []
    return found
