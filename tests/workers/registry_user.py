"""Worker: many concurrent `register()` calls on one `RedisRegistry`, from one client.

    python registry_user.py URL REGISTRY WORKER WORKERS MODE COUNT TIMEOUT

Waits until all WORKERS have connected (a barrier on the server, so they register at the
same time), then starts COUNT tasks at once, each making one `register()` call:

- MODE ``same``: every task registers ``user-0000``.
- MODE ``all``: task i registers ``user-<i>`` (zero-padded to 5 digits), the tasks started
  in an order shuffled by WORKER, so processes collide on names in different orders.

The ids it got back, in task order (i = 0..COUNT-1), are RPUSHed to
``test:{REGISTRY}:seen:WORKER``. Prints ``done WORKER <script calls sent>`` at the end.
"""

from __future__ import annotations

import asyncio
import random
import sys

import redis.asyncio
from _lockworker import emit, run
from _primitiveworker import barrier

from aiolocks import RedisRegistry
from aiolocks._engine._context import context_for


def name_for(mode: str, index: int) -> str:
    return "user-0000" if mode == "same" else f"user-{index:05d}"


async def main(argv: list[str]) -> int:
    url, registry, worker, workers = argv[0], argv[1], int(argv[2]), int(argv[3])
    mode, count, timeout = argv[4], int(argv[5]), float(argv[6])
    client = redis.asyncio.Redis.from_url(url)
    try:
        reg = RedisRegistry(client, registry)
        order = list(range(count))
        random.Random(worker).shuffle(order)
        await barrier(client, f"test:{{{registry}}}:barrier", workers, timeout)
        tasks = {i: asyncio.create_task(reg.register(name_for(mode, i))) for i in order}
        await asyncio.gather(*tasks.values())
        ids = [tasks[i].result() for i in range(count)]
        await client.rpush(f"test:{{{registry}}}:seen:{worker}", *ids)
        emit("done", worker, context_for(client).commands_sent)
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), 60))
