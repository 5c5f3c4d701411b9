"""Shared helpers of the semaphore / read-write lock workers of
``tests/test_primitives_processes.py`` and ``tests/test_rwlock.py``.

Same conventions as ``_lockworker.py``: one event per stdout line, ``time.monotonic()``
times (comparable across the processes of one host), every run bounded.
"""

from __future__ import annotations

import json

import redis.asyncio

from aiolocks import RedisReadWriteLock, RedisSemaphore

__all__ = ["Interval", "barrier", "interval", "make_primitive"]

# (kind, worker, task, start, end, fence): one holding, as seen by its holder.
Interval = tuple[str, int, int, float, float, int]


async def barrier(client: redis.asyncio.Redis, key: str, parties: int, timeout: float) -> None:
    """Return once ``parties`` processes have arrived: the last one opens the gate."""
    if await client.incr(f"{key}:arrived") == parties:
        await client.rpush(f"{key}:gate", *["go"] * parties)
    if await client.blpop([f"{key}:gate"], timeout=timeout) is None:
        raise TimeoutError(f"barrier {key!r}: not all {parties} workers arrived")


def make_primitive(
    client: redis.asyncio.Redis, kind: str, name: str, ttl: float, limit: int
) -> RedisSemaphore | RedisReadWriteLock:
    """``kind`` is ``semaphore`` (with ``limit``), or ``read``/``write`` (a read-write lock)."""
    if kind == "semaphore":
        return RedisSemaphore(client, name, limit=limit, ttl=ttl)
    if kind in ("read", "write"):
        return RedisReadWriteLock(client, name, ttl=ttl)
    raise ValueError(f"unknown kind {kind!r}")


def interval(kind: str, worker: int, task: int, start: float, end: float, fence: int) -> str:
    """One holding as a JSON line for the shared history list."""
    return json.dumps([kind, worker, task, start, end, fence])
