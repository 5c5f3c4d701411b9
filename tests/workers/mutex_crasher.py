"""Worker: acquire a `RedisMutex`, then die holding it when told to.

    python mutex_crasher.py URL NAME TTL HOLD TIMEOUT

Acquires (waiting at most TIMEOUT seconds), prints ``held <fence> <monotonic>`` and keeps
the lease renewed until a line ``crash`` arrives on stdin. Then it holds on for HOLD more
seconds (so that its lease has been renewed at least once when HOLD > TTL/3), checks that
it still holds the mutex, prints ``crashing`` and ends the process with ``os._exit(1)``:
no release, no clean-up, the lease just stops being renewed. Without such a line within
TIMEOUT seconds (or on end of input), or if it lost the mutex meanwhile, it prints why and
exits with 2, without releasing either.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import redis.asyncio
from _lockworker import emit

from aiolocks import RedisMutex


async def main(argv: list[str]) -> int:
    url, name = argv[0], argv[1]
    ttl, hold, timeout = float(argv[2]), float(argv[3]), float(argv[4])
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    client = redis.asyncio.Redis.from_url(url)
    mutex = RedisMutex(client, name, ttl=ttl)
    if not await mutex.acquire(timeout=timeout):
        emit("not-acquired")
        os._exit(2)
    fence = mutex.fencing_token
    granted = (await asyncio.wait_for(mutex.inspect(), timeout)).fence  # (a cohort's: its block)
    emit("held", fence, time.monotonic())
    try:
        line = await asyncio.wait_for(stdin.readline(), timeout)
    except TimeoutError:
        line = b""
    if line.strip() != b"crash":
        emit("no-crash-order")
        os._exit(2)
    await asyncio.sleep(hold)  # keep holding (and renewing) a while longer
    info = await asyncio.wait_for(mutex.inspect(), timeout)
    # Nobody else was granted it since (the fence would have moved on) and it is still held.
    if mutex.lost.is_set() or info.owner is None or info.fence != granted:
        emit("lost-before-crash", info)
        os._exit(2)
    emit("crashing", time.monotonic())
    os._exit(1)  # dies holding the mutex


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
