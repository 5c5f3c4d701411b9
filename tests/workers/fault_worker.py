"""Worker: takes turns on a mutex, a semaphore (2 permits) and a read-write lock, logging
every holding in the history of its primitive (see ``_history.py``), until killed or done.

    python fault_worker.py URL NAME WORKER ITERATIONS TTL TIMEOUT

The primitives are named NAME-mutex, NAME-semaphore and NAME-rwlock. Iteration i uses
primitive (WORKER + i) % 3 (a random side of the RW lock). Prints ``tag <client tag>``
first (the tag in this process's queue entries), then per iteration ``held <kind> <i>``
inside the critical section and ``done <kind> <i>`` after leaving it, and ``finished``
at the end. Failures a fault elsewhere may cause (a lost lease, an unreachable server) are
printed (``lost``, ``unavailable``) and the iteration is tried again.
"""

from __future__ import annotations

import asyncio
import random
import sys

import redis.asyncio
from _history import HistoryLog
from _lockworker import emit, run

from aiolocks import (
    LockLost,
    LockTimeout,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import LeasedLock

KINDS = ("mutex", "semaphore", "rwlock")


async def main(argv: list[str]) -> int:
    url, name, worker = argv[0], argv[1], int(argv[2])
    iterations, ttl, timeout = int(argv[3]), float(argv[4]), float(argv[5])
    rng = random.Random(f"{name}:{worker}")
    client = redis.asyncio.Redis.from_url(url)
    try:
        rw = RedisReadWriteLock(client, f"{name}-rwlock", ttl=ttl, timeout=timeout)
        sem = RedisSemaphore(client, f"{name}-semaphore", limit=2, ttl=ttl, timeout=timeout)
        sides: dict[str, list[tuple[LeasedLock, str]]] = {
            "mutex": [(RedisMutex(client, f"{name}-mutex", ttl=ttl, timeout=timeout), "x")],
            "semaphore": [(sem, "s")],
            "rwlock": [(rw.read(), "r"), (rw.write(), "x")],
        }
        logs = {kind: HistoryLog(client, f"{name}-{kind}") for kind in KINDS}
        emit("tag", context_for(client).waitqueue.tag)
        done = 0
        while done < iterations:
            kind = KINDS[(worker + done) % 3]
            lock, history_kind = rng.choice(sides[kind])
            try:
                async with lock:
                    emit("held", kind, done)
                    fence = lock.fencing_token
                    assert fence is not None
                    started = await logs[kind].start()
                    await asyncio.sleep(rng.uniform(0.005, 0.03))
                    await logs[kind].end(history_kind, fence, started, worker)
                emit("done", kind, done)
                done += 1
            except LockLost:
                emit("lost", kind, done)
            except (ServerUnavailable, LockTimeout) as error:
                emit("unavailable", kind, done, type(error).__name__)
        emit("finished")
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[6]) * 4))
