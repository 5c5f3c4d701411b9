"""Worker: several tasks take permits of one `RedisSemaphore`, each a few times.

    python semaphore_holder.py URL NAME LIMIT WORKER WORKERS TASKS ROUNDS HOLD_MS TIMEOUT

Waits until all WORKERS have connected (a barrier on the server, so they contend from the
start), then runs TASKS tasks sharing one `RedisSemaphore(limit=LIMIT)`. Each task ROUNDS
times: acquire; INCR the shared counter ``test:{NAME}:inside`` (its reply is how many
holders, of every process, are inside right now); hold for HOLD_MS..2*HOLD_MS ms; DECR
the counter; release. Each holding is also RPUSHed to ``test:{NAME}:history`` as
``[kind, worker, task, start, end, fence]`` (monotonic times taken inside the holding).

Prints ``done WORKER <most seen inside> <holdings>`` when every task has finished.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import redis.asyncio
from _lockworker import emit, run
from _primitiveworker import barrier, interval

from aiolocks import RedisSemaphore


async def main(argv: list[str]) -> int:
    url, name, limit, worker, workers = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    tasks, rounds, hold_ms, timeout = int(argv[5]), int(argv[6]), float(argv[7]), float(argv[8])
    inside, history = f"test:{{{name}}}:inside", f"test:{{{name}}}:history"
    client = redis.asyncio.Redis.from_url(url)
    rng = random.Random(worker)
    most = 0
    holdings = 0
    try:
        await barrier(client, f"test:{{{name}}}:barrier", workers, timeout)
        sem = RedisSemaphore(client, name, limit=limit, ttl=30, timeout=timeout)

        async def holder(task: int) -> None:
            nonlocal most, holdings
            for _ in range(rounds):
                async with sem:
                    fence = sem.fencing_token
                    assert fence is not None
                    start = time.monotonic()
                    most = max(most, int(await client.incr(inside)))
                    await asyncio.sleep(rng.uniform(hold_ms, 2 * hold_ms) / 1000)
                    await client.decr(inside)
                    end = time.monotonic()
                    await client.rpush(history, interval("sem", worker, task, start, end, fence))
                holdings += 1

        await asyncio.gather(*(holder(task) for task in range(tasks)))
        emit("done", worker, most, holdings)
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[9]) + 5.0))
