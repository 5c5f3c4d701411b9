"""Which clients the engine accepts: redis-py's asyncio ones, and valkey-py's (a fork with
the same API, installed with the `valkey` extra), on one server or on Cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

if TYPE_CHECKING:
    import valkey.asyncio

__all__ = ["AnyRedis", "ensure_async_client", "is_cluster"]

# What every primitive takes. A Sentinel-managed client (`Sentinel.master_for`) is a
# `redis.asyncio.Redis` (or `valkey.asyncio.Valkey`) too.
AnyRedis: TypeAlias = (
    "redis.asyncio.Redis | RedisCluster | valkey.asyncio.Valkey | valkey.asyncio.ValkeyCluster"
)

_SINGLE: tuple[type, ...] = (redis.asyncio.Redis,)
_CLUSTER: tuple[type, ...] = (RedisCluster,)
try:
    import valkey.asyncio as _valkey

    _SINGLE += (_valkey.Valkey,)
    _CLUSTER += (_valkey.ValkeyCluster,)
except ImportError:  # valkey-py is optional
    pass


def is_cluster(client: Any) -> bool:
    """Whether `client` is a Cluster client (redis-py's RedisCluster, valkey-py's
    ValkeyCluster)."""
    return isinstance(client, _CLUSTER)


def ensure_async_client(client: object) -> AnyRedis:
    """Return `client` if it is an asyncio client of redis-py or valkey-py; raise
    `TypeError` otherwise."""
    if isinstance(client, _SINGLE + _CLUSTER):
        return client  # type: ignore[return-value]
    raise TypeError(
        "client must be a redis.asyncio.Redis or redis.asyncio.cluster.RedisCluster (e.g. "
        "redis.asyncio.Redis.from_url(...)), or valkey-py's valkey.asyncio.Valkey or "
        "ValkeyCluster, "
        f"not {type(client).__module__}.{type(client).__qualname__}"
    )
