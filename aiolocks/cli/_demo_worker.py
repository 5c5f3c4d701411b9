"""One worker process of `aiolocks demo` (run as `python -m aiolocks.cli._demo_worker`).

    python -m aiolocks.cli._demo_worker URL PREFIX ITERATIONS HOLD locked|unlocked

Prints `ready <client tag>`, waits for `go` on stdin (so that every worker starts at the
same moment), then does ITERATIONS non-atomic increments of the counter (GET, a
millisecond's pause, SET): under the demo's `RedisMutex` when `locked`, printing
`acquired <fence> <token> <before> <after>` for each and holding the lock HOLD seconds;
without it otherwise. Exits 0, or 1 after a `failed <reason>` line.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import redis.asyncio
from redis.exceptions import RedisError

from .._base._errors import LockError
from .._engine._context import context_for
from ..mutex import RedisMutex

__all__ = ["ACQUIRE_TIMEOUT", "LOCK_NAME", "LOCK_TTL", "counter_key", "main"]

LOCK_NAME = "counter"
LOCK_TTL = 5.0  # seconds; renewed in the background while held
ACQUIRE_TIMEOUT = 60.0  # a worker that waits longer fails


def counter_key(prefix: str, locked: bool) -> str:
    return f"{prefix}:counter:{'locked' if locked else 'unlocked'}"


async def _increment(client: redis.asyncio.Redis, key: str) -> tuple[int, int]:
    """The read-modify-write the lock has to protect."""
    before = int(await client.get(key) or 0)
    await asyncio.sleep(0.001)  # widen the window between the read and the write
    await client.set(key, before + 1)
    return before, before + 1


async def work(url: str, prefix: str, iterations: int, hold: float, locked: bool) -> int:
    client = redis.asyncio.Redis.from_url(url)
    counter = counter_key(prefix, locked)
    try:
        await client.ping()
        print("ready", context_for(client).waitqueue.tag, flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
            return 2  # the parent went away before the start
        if not locked:
            for _ in range(iterations):
                await _increment(client, counter)
            return 0
        mutex = RedisMutex(client, LOCK_NAME, ttl=LOCK_TTL, timeout=ACQUIRE_TIMEOUT, prefix=prefix)
        for _ in range(iterations):
            async with mutex:
                before, after = await _increment(client, counter)
                holding = mutex._current()
                token = "-" if holding is None else holding.token
                print("acquired", mutex.fencing_token, token, before, after, flush=True)
                await asyncio.sleep(hold)
        return 0
    except (LockError, RedisError) as error:  # a timeout, a lost lease, the server gone
        print("failed", f"{type(error).__name__}: {error}", flush=True)
        return 1
    finally:
        await client.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    url, prefix, iterations, hold, mode = sys.argv[1:] if argv is None else argv
    try:
        return asyncio.run(work(url, prefix, int(iterations), float(hold), mode == "locked"))
    except KeyboardInterrupt:  # a SIGINT sent to it alone
        return 130


if __name__ == "__main__":
    sys.exit(main())
