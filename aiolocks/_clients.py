"""Which redis-py clients the engine accepts: asyncio ones, on one server or on Cluster."""

from __future__ import annotations

from typing import TypeAlias

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

__all__ = ["AnyRedis", "ensure_async_client"]

# What every primitive takes. A Sentinel-managed client (`Sentinel.master_for`) is a
# `redis.asyncio.Redis` too.
AnyRedis: TypeAlias = redis.asyncio.Redis | RedisCluster


def ensure_async_client(client: object) -> AnyRedis:
    """Return `client` if it is a `redis.asyncio` client; raise `TypeError` otherwise."""
    if isinstance(client, (redis.asyncio.Redis, RedisCluster)):
        return client
    raise TypeError(
        "client must be a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster (e.g. "
        "redis.asyncio.Redis.from_url(...)), "
        f"not {type(client).__module__}.{type(client).__qualname__}"
    )
