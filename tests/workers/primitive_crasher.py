"""Worker: take a semaphore permit or one side of a read-write lock, then die holding it.

    python primitive_crasher.py URL KIND NAME TTL HOLD TIMEOUT LIMIT

KIND is ``semaphore`` (a `RedisSemaphore` with LIMIT permits), ``read`` or ``write`` (that
side of a `RedisReadWriteLock`). Acquires (waiting at most TIMEOUT seconds), prints
``held <fence> <monotonic>`` and keeps the lease renewed until a line ``crash`` arrives on
stdin. Then it holds on for HOLD more seconds (so that its lease has been renewed at least
once when HOLD > TTL/3), checks that it has not lost it, prints ``crashing <monotonic>``
and ends the process with ``os._exit(1)``: no release, no clean-up, the lease just stops
being renewed. Without such a line within TIMEOUT seconds (or on end of input), or if it
lost the holding meanwhile, it prints why and exits with 2, without releasing either.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import redis.asyncio
from _lockworker import emit

from aiolocks import RedisReadWriteLock, RedisSemaphore


async def main(argv: list[str]) -> int:
    url, kind, name = argv[0], argv[1], argv[2]
    ttl, hold, timeout, limit = float(argv[3]), float(argv[4]), float(argv[5]), int(argv[6])
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    client = redis.asyncio.Redis.from_url(url)
    if kind == "semaphore":
        sem = RedisSemaphore(client, name, limit=limit, ttl=ttl)
        ok = await sem.acquire(timeout=timeout)
        fence, lost = sem.fencing_token, (sem.lost if ok else None)
    else:
        rw = RedisReadWriteLock(client, name, ttl=ttl)
        side = rw.read() if kind == "read" else rw.write()
        ok = await side.acquire(timeout=timeout)
        fence, lost = side.fencing_token, (side.lost if ok else None)
    if lost is None:
        emit("not-acquired")
        os._exit(2)
    emit("held", fence, time.monotonic())
    try:
        line = await asyncio.wait_for(stdin.readline(), timeout)
    except TimeoutError:
        line = b""
    if line.strip() != b"crash":
        emit("no-crash-order")
        os._exit(2)
    await asyncio.sleep(hold)  # keep holding (and renewing) a while longer
    if lost.is_set():
        emit("lost-before-crash")
        os._exit(2)
    emit("crashing", time.monotonic())
    os._exit(1)  # dies holding it


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
