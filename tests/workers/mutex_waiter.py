"""Worker: queue for a `RedisMutex`, report when queued and when it holds, then release.

    python mutex_waiter.py URL NAME INDEX TTL HOLD TIMEOUT

Prints ``queued <token>`` as soon as the server has put it on the mutex's queue (the
reply of the acquire script said so), then, once granted,
``acquired INDEX <fence> <monotonic>``; holds the mutex for HOLD seconds, prints
``releasing INDEX <monotonic>`` and releases. Gives up after TIMEOUT seconds of waiting
(``not-acquired INDEX``, exit 2).
"""

from __future__ import annotations

import asyncio
import sys
import time

import redis.asyncio
from _lockworker import emit, report_queued, run

from aiolocks import RedisMutex


async def main(argv: list[str]) -> int:
    url, name, index = argv[0], argv[1], int(argv[2])
    ttl, hold, timeout = float(argv[3]), float(argv[4]), float(argv[5])
    client = redis.asyncio.Redis.from_url(url)
    report_queued(client)
    try:
        mutex = RedisMutex(client, name, ttl=ttl)
        if not await mutex.acquire(timeout=timeout):
            emit("not-acquired", index)
            return 2
        emit("acquired", index, mutex.fencing_token, time.monotonic())
        await asyncio.sleep(hold)
        emit("releasing", index, time.monotonic())
        await mutex.release()
        emit("released", index)
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[6]) + float(sys.argv[5]) + 5.0))
