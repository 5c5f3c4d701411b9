"""Cancellation at any await of a semaphore or read-write lock acquisition leaves nothing
behind: no holder, no queue entry, no stuck waiter (real servers and fakeredis)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
import redis.asyncio
from conftest import Backend, cancelled_attempt

from aiolocks import RedisReadWriteLock, RedisSemaphore
from aiolocks._engine._context import context_for

SEM, RW, LIMIT = "x:sem-storm", "x:rw-storm", 2


async def _keys(client: redis.asyncio.Redis, kind: str, name: str) -> dict[str, tuple[str, Any]]:
    """Every aiolocks key of primitive `name`: part -> (type, value if a string)."""
    prefix = f"aiolocks:{kind}:{{{name}}}:"
    found: dict[str, tuple[str, Any]] = {}
    async for key in client.scan_iter(match=f"{prefix}*"):
        text = key.decode() if isinstance(key, bytes) else key
        key_type = await client.type(key)
        key_type = key_type.decode() if isinstance(key_type, bytes) else key_type
        value = await client.get(key) if key_type == "string" else None
        found[text.removeprefix(prefix)] = (key_type, value)
    return found


@pytest.mark.slow
async def test_500_acquisitions_cancelled_at_random_points(any_backend: Backend) -> None:
    rng = random.Random(20261123)
    clients = [any_backend.client() for _ in range(2)]
    await clients[0].flushall()
    sems = [RedisSemaphore(client, SEM, limit=LIMIT, ttl=5) for client in clients]
    rws = [RedisReadWriteLock(client, RW, ttl=5) for client in clients]
    outcomes = {"acquired": 0, "cancelled": 0}
    kinds_seen: dict[str, int] = {"semaphore": 0, "read": 0, "write": 0}

    async def attempt(index: int) -> None:
        which = index % 2
        kind = rng.choice(["semaphore", "read", "write"])
        kinds_seen[kind] += 1
        side: RedisSemaphore | Any
        if kind == "semaphore":
            side = sems[which]
        else:
            side = rws[which].read() if kind == "read" else rws[which].write()
        await cancelled_attempt(side, rng, outcomes)

    async def storm() -> None:
        for _ in range(10):
            await asyncio.gather(*(attempt(i) for i in range(50)))

    started = time.monotonic()
    await asyncio.wait_for(storm(), 60)
    # Well under a second when every cancelled waiter withdraws at once; an entry left
    # queued would hold the others up for its 5 s ttl.
    assert time.monotonic() - started < 10
    assert outcomes["acquired"] + outcomes["cancelled"] == 500
    assert outcomes["cancelled"] > 0  # the storm really cancelled mid-way
    assert outcomes["acquired"] > 0
    assert all(count > 0 for count in kinds_seen.values()), kinds_seen

    rw_keys = await _keys(clients[0], "rwlock", RW)
    assert set(rw_keys) <= {"fence"}, rw_keys  # no writer, readers, queue or waiters left
    sem_keys = await _keys(clients[0], "semaphore", SEM)
    assert "fence" in sem_keys, sem_keys
    others = {part: value for part, value in sem_keys.items() if part != "fence"}
    # At most the stored limit remains, a plain string holding the limit.
    assert len(others) <= 1, sem_keys
    for key_type, value in others.values():
        assert (key_type, value) == ("string", str(LIMIT).encode()), sem_keys

    for client in clients:
        assert len(context_for(client).waitqueue) == 0
    for sem in sems:
        assert sem.statistics().held_here == 0 and sem.statistics().tasks_waiting == 0
    for rw in rws:
        for side in (rw.read(), rw.write()):
            assert side.statistics().held_here == 0 and side.statistics().tasks_waiting == 0
    sem_info = await sems[0].inspect()
    assert (sem_info.holders, sem_info.queue_length) == (0, 0), sem_info
    rw_info = await rws[0].inspect()
    assert (rw_info.writer, rw_info.readers, rw_info.queue_length) == (None, 0, 0), rw_info

    # At once: nothing stuck ahead of fresh acquisitions.
    fresh = [RedisSemaphore(clients[1], SEM, limit=LIMIT) for _ in range(LIMIT)]
    for sem in fresh:
        assert await sem.acquire(blocking=False)
    for sem in fresh:
        await sem.release()
    writer = RedisReadWriteLock(clients[1], RW).write()
    assert await writer.acquire(blocking=False)
    await writer.release()
