"""Smoke test of an installed aiolocks, run from outside the checkout by
tests/test_package.py and `nox -s package`: the package (and its Lua scripts) came from
the install, and every primitive's scripts run on an embedded Valkey server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import redis.asyncio as redis

import aiolocks
from aiolocks import RedisMutex, RedisReadWriteLock, RedisRegistry, RedisSemaphore
from aiolocks._base._embedded import start_embedded_server


async def _use_every_primitive(url: str) -> int:
    async with redis.Redis.from_url(url) as client:
        async with RedisMutex(client, "smoke", ttl=5) as mutex:
            fence = mutex.fencing_token
        async with RedisSemaphore(client, "smoke-slots", limit=2):
            pass
        catalog = RedisReadWriteLock(client, "smoke-catalog")
        async with catalog.read():
            pass
        async with catalog.write():
            pass
        assert await RedisRegistry(client, "smoke-ids").register("alice") == 1
    assert fence is not None and fence > 10**15, fence  # the server clock in microseconds
    return fence


def main() -> None:
    installed = Path(aiolocks.__file__).resolve()
    assert installed.is_relative_to(Path(sys.prefix).resolve()), f"not installed: {installed}"
    server = start_embedded_server()
    try:
        fence = asyncio.run(_use_every_primitive(server.connection_url))
    finally:
        server.stop()
    print(f"smoke ok: {installed.parent}, fence {fence}")


if __name__ == "__main__":
    main()
