"""The asyncio client the engine uses for a synchronous caller's client (or URL).

Made once per process and per distinct connection settings of the sync clients (address
or unix socket, database, credentials, TLS, protocol, timeouts, client name), of the same
library (redis-py or valkey-py). Only settings that mean the same on both sides are carried over:
a sync client's retry policy and its pool's internals belong to it. The engine then opens
its own connections from this client as it does from any user's (`_base/_adapter.py`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Hashable
from typing import Any, TypeAlias

import redis

from .._base._clients import AnyRedis
from ._runner import process

__all__ = ["SyncClient", "async_client", "validate_client"]

SyncClient: TypeAlias = Any  # redis.Redis, redis.RedisCluster, valkey's, or a URL (str)

# The connection settings carried over when the async connection class takes them.
_SETTINGS = (
    "host", "port", "path", "db", "username", "password", "credential_provider",
    "socket_timeout", "socket_connect_timeout", "socket_keepalive", "client_name",
    "protocol", "health_check_interval", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs",
    "ssl_ca_certs", "ssl_ca_data", "ssl_check_hostname", "ssl_password", "ssl_min_version",
    "ssl_ciphers", "ssl_include_verify_flags", "ssl_exclude_verify_flags",
)  # fmt: skip


_CLASSES = (("redis", "Redis", "RedisCluster"), ("valkey", "Valkey", "ValkeyCluster"))


def _library(client: object) -> str | None:
    """ "redis" or "valkey" for a sync client of either (single server or Cluster)."""
    for name, single, cluster in _CLASSES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(client, (getattr(module, single), getattr(module, cluster))):
            return name
    return None


def validate_client(client: object) -> None:
    """TypeError unless `client` is a sync client of redis-py or valkey-py, or a URL."""
    if isinstance(client, str):
        if "://" not in client:
            raise ValueError(f"client URL must look like redis://host:port/db, got {client!r}")
        return
    library = _library(client)
    if library is None:
        raise TypeError(
            "client must be a synchronous redis.Redis or redis.RedisCluster (e.g. "
            "redis.Redis.from_url(...)), valkey-py's valkey.Valkey or ValkeyCluster, or a "
            f"URL; not {type(client).__module__}.{type(client).__qualname__} (asyncio "
            "clients take the asyncio API: aiolocks.RedisMutex)"
        )
    if not _is_cluster(client):
        pool = client.connection_pool  # type: ignore[attr-defined]
        module = importlib.import_module(library)
        if type(pool) not in (module.ConnectionPool, module.BlockingConnectionPool):
            raise TypeError(
                f"aiolocks.sync takes a client on a plain connection pool, not a "
                f"{type(pool).__qualname__} (a Sentinel's master_for client: pass the "
                "master's URL, or use the asyncio API with an asyncio Sentinel client)"
            )


def _is_cluster(client: object) -> bool:
    return type(client).__name__ in ("RedisCluster", "ValkeyCluster")


def async_client(client: SyncClient) -> AnyRedis:
    """The asyncio client of this process for `client`'s connection settings: one for all
    the sync clients that share them (a client made per task costs no new engine), made on
    first use and closed when the background loop ends."""
    runner = process()
    made: dict[Hashable, AnyRedis] = runner.state.setdefault("clients", {})
    key, make = _recipe(client)
    found = made.get(key)
    if found is None:
        found = made[key] = make()
        runner.at_end.append(found.aclose)
    return found


def _recipe(client: SyncClient) -> tuple[Hashable, Callable[[], AnyRedis]]:
    """What identifies the asyncio client for `client` (its settings), and how to make it."""
    if isinstance(client, str):
        return ("url", client), lambda: redis.asyncio.Redis.from_url(client)
    library = _library(client)
    assert library is not None
    module = importlib.import_module(f"{library}.asyncio")
    if _is_cluster(client):
        cluster_module = importlib.import_module(f"{library}.asyncio.cluster")
        nodes = tuple((node.host, node.port) for node in client.get_nodes())
        first = client.get_nodes()[0].redis_connection.connection_pool
        options = _portable(first.connection_kwargs, module.Connection)
        for setting in ("host", "port", "db", "path"):
            options.pop(setting, None)
        cluster_class = getattr(module, type(client).__name__)

        def cluster() -> AnyRedis:
            startup = [cluster_module.ClusterNode(host, port) for host, port in nodes]
            made: AnyRedis = cluster_class(startup_nodes=startup, **options)
            return made

        return _key(client, library, "cluster", nodes, options), cluster
    pool = client.connection_pool
    connection_class = getattr(module.connection, pool.connection_class.__name__)
    options = _portable(pool.connection_kwargs, connection_class)
    single_class = getattr(module, "Valkey" if library == "valkey" else "Redis")

    def single() -> AnyRedis:
        own = module.ConnectionPool(connection_class=connection_class, **options)
        made: AnyRedis = single_class(connection_pool=own)
        return made

    return _key(client, library, connection_class.__name__, (), options), single


def _key(
    client: object, library: str, connection: str, nodes: tuple[Any, ...], options: dict[str, Any]
) -> Hashable:
    key = (library, connection, nodes, tuple(sorted(options.items())))
    try:
        hash(key)
    except TypeError:  # a setting that cannot be compared: this client's own
        return ("client", id(client))
    return key


def _portable(settings: dict[str, Any], connection_class: type) -> dict[str, Any]:
    """The settings of `_SETTINGS` that `connection_class` takes."""
    accepted: set[str] = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            accepted |= set(inspect.signature(init).parameters)
    return {key: settings[key] for key in _SETTINGS if key in settings and key in accepted}
