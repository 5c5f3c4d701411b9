"""Worker: acquire a `RedisMutex`, then die holding it when told to.

    python mutex_crasher.py URL NAME TTL TIMEOUT

Acquires (waiting at most TIMEOUT seconds), prints ``held <fence> <monotonic>`` and keeps
the lease renewed until a line ``crash`` arrives on stdin; then prints ``crashing`` and
ends the process with ``os._exit(1)``: no release, no clean-up, the lease just stops being
renewed. Without such a line within TIMEOUT seconds (or on end of input) it exits with 2
without releasing either.
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
    url, name, ttl, timeout = argv[0], argv[1], float(argv[2]), float(argv[3])
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    client = redis.asyncio.Redis.from_url(url)
    mutex = RedisMutex(client, name, ttl=ttl)
    if not await mutex.acquire(timeout=timeout):
        emit("not-acquired")
        os._exit(2)
    emit("held", mutex.fencing_token, time.monotonic())
    try:
        line = await asyncio.wait_for(stdin.readline(), timeout)
    except asyncio.TimeoutError:
        line = b""
    if line.strip() == b"crash":
        emit("crashing")
        os._exit(1)  # dies holding the mutex
    emit("no-crash-order")
    os._exit(2)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
