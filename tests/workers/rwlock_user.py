"""Worker: one side of a `RedisReadWriteLock`, taken ROUNDS times.

    python rwlock_user.py URL NAME KIND WORKER WORKERS ROUNDS HOLD_MS PAUSE_MS TIMEOUT

KIND is ``read`` or ``write``. Waits until all WORKERS have connected (a barrier on the
server), then ROUNDS times: take that side; note ``start``; hold HOLD_MS ms; note ``end``;
RPUSH ``[kind, worker, 0, start, end, fence]`` to ``test:{NAME}:history`` (still inside);
release; wait PAUSE_MS ms. Prints ``done WORKER <holdings>``.
"""

from __future__ import annotations

import asyncio
import sys
import time

import redis.asyncio
from _lockworker import emit, run
from _primitiveworker import barrier, interval

from aiolocks import RedisReadWriteLock


async def main(argv: list[str]) -> int:
    url, name, kind, worker, workers = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    rounds, hold, pause, timeout = int(argv[5]), float(argv[6]), float(argv[7]), float(argv[8])
    history = f"test:{{{name}}}:history"
    client = redis.asyncio.Redis.from_url(url)
    try:
        await barrier(client, f"test:{{{name}}}:barrier", workers, timeout)
        rw = RedisReadWriteLock(client, name, ttl=30, timeout=timeout)
        side = rw.read() if kind == "read" else rw.write()
        for _ in range(rounds):
            async with side:
                fence = side.fencing_token
                assert fence is not None
                start = time.monotonic()
                await asyncio.sleep(hold / 1000)
                end = time.monotonic()
                await client.rpush(history, interval(kind, worker, 0, start, end, fence))
            await asyncio.sleep(pause / 1000)
        emit("done", worker, rounds)
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[9]) + 5.0))
