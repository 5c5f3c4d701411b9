"""Worker: non-atomic increments of a counter per name, each under its `RedisMutex`.

    python mutex_counter.py URL NAMES WORKER WORKERS ITERATIONS TTL TIMEOUT

NAMES is one name or several, comma-separated; URL may be ``cluster+redis://...`` (see
``_lockworker.connect``). Waits until all WORKERS have connected (a barrier on the server,
so they contend from the start), then, for every name at once, ITERATIONS times: acquire;
GET the name's counter; yield to the loop; SET it to the value read plus one; release.
Prints ``fences WORKER NAME <json list>`` per name: the fencing token of each of its
acquisitions, in order.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from _lockworker import connect, emit, run

from aiolocks import RedisMutex


async def barrier(client: Any, key: str, parties: int, timeout: float) -> None:
    """Return once ``parties`` processes have arrived: the last one opens the gate."""
    if await client.incr(f"{key}:arrived") == parties:
        await client.rpush(f"{key}:gate", *["go"] * parties)
    if await client.blpop([f"{key}:gate"], timeout=timeout) is None:
        raise TimeoutError(f"barrier {key!r}: not all {parties} workers arrived")


async def main(argv: list[str]) -> int:
    url, names, worker = argv[0], argv[1].split(","), int(argv[2])
    workers, iterations, ttl, timeout = int(argv[3]), int(argv[4]), float(argv[5]), float(argv[6])
    client = connect(url)
    try:
        await barrier(client, f"test:{{{names[0]}}}:barrier", workers, timeout)

        async def count(name: str) -> list[int]:
            counter = f"test:{{{name}}}:counter"
            mutex = RedisMutex(client, name, ttl=ttl, timeout=timeout)
            fences: list[int] = []
            for _ in range(iterations):
                async with mutex:
                    fence = mutex.fencing_token
                    assert fence is not None
                    value = int(await client.get(counter) or 0)
                    await asyncio.sleep(0)  # another holder would interleave here
                    await client.set(counter, value + 1)
                fences.append(fence)
            return fences

        for name, fences in zip(names, await asyncio.gather(*map(count, names)), strict=True):
            emit("fences", worker, name, json.dumps(fences))
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[7]) + 5.0))
