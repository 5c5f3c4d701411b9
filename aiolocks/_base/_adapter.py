"""Everything aiolocks needs from a client library beyond its documented API, in one place.

The engine reads replies where they arrive (`_runner`'s direct reads), takes a
connection of a pool for its own use, subscribes to sharded channels, and looks whether a
client still holds connections. redis-py documents none of that, and it has changed across
the release lines aiolocks supports (redis-py 5.0 to 8.x, and valkey-py, its fork): the
names below are the only ones in the package that touch a client library's private
attributes, and tests/test_adapter.py checks each on every supported release (`nox -s compat`).

What differs by release, and how it is met here:
- `ConnectionPool.get_connection()` takes a command name before redis-py 5.3 (required)
  and warns when given one from 5.3 on: `pooled_connection` passes it only where needed.
- the asyncio `PubSub.ssubscribe()` exists from redis-py 8.0 (valkey-py 6.1.0-6.2.0 have
  none): before, `ssubscribe` writes SSUBSCRIBE itself and re-sends it when the connection
  re-connects, as the newer clients do for their own sharded channels. It writes it on the
  connection, not through `PubSub.execute_command`, whose health check (with
  `health_check_interval` set) sends a PING and reads its reply: a second reader beside
  the notifier's, which redis-py refuses ("read() called while another coroutine is
  already waiting") and valkey-py 6.2 takes a subscription's confirmation for.
- uvloop's transports are no `asyncio.Transport` subclasses: `socket_writer` asks for
  what the engine uses of a transport (once per transport class), not for a class.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio

__all__ = [
    "NEVER_DECODE",
    "close_engine_client",
    "describe",
    "close_idle_connections",
    "connection_options",
    "engine_client",
    "holds_connections",
    "needs_initialise",
    "node_client",
    "on_aclose",
    "pooled_connection",
    "pubsub_unsubscribed",
    "reply_error",
    "socket_transport",
    "socket_writer",
    "ssubscribe",
    "sunsubscribe",
    "take_unread",
    "text",
    "unread",
    "writer_of",
]

# The execute_command option that keeps bulk replies as bytes on a client made with
# decode_responses=True (redis.client.NEVER_DECODE; the same word in valkey-py).
NEVER_DECODE = "NEVER_DECODE"


def text(value: bytes | str) -> str:
    """A bulk string of a reply as str: bytes from the engine's calls (which never decode),
    str from a user's client made with decode_responses=True. The one such reading."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


# What the engine uses of a socket's transport: writing, its write buffer, and swapping its
# protocol (direct reads). asyncio's and uvloop's transports both have them.
_TRANSPORT_METHODS = (
    "write",
    "writelines",
    "get_write_buffer_size",
    "is_closing",
    "get_protocol",
    "set_protocol",
)

# The single-server clients' pool classes, of redis-py and (if installed) valkey-py.
_POOLS: tuple[type[Any], ...] = (redis.asyncio.ConnectionPool,)
# valkey-py's single-server client class, if installed.
_VALKEY: tuple[type[Any], ...] = ()
try:
    import valkey.asyncio

    _POOLS += (valkey.asyncio.ConnectionPool,)
    _VALKEY = (valkey.asyncio.Valkey,)
except ImportError:  # valkey-py is optional
    pass

# Pool classes whose get_connection() requires a command name (redis-py < 5.3).
_NAMED: dict[type, bool] = {}


def closed_under_us(exc: BaseException) -> bool:
    """redis-py 8.1 writing on a connection that a concurrent read (or a Cluster topology
    refresh) closed under it: `'NoneType' object has no attribute 'writelines'`. That is a
    lost connection, with nothing written, not a bug of the caller's."""
    return isinstance(exc, AttributeError) and "writelines" in str(exc)


def read_beside_the_reader(exc: BaseException) -> bool:
    """redis-py re-connecting a pub/sub connection for a SUBSCRIBE (its handshake reads a
    reply) while the reader task's read on it is pending, after the connection was killed:
    asyncio's `read() called while another coroutine is already waiting`. The link is
    down; the reader re-connects and re-subscribes."""
    return isinstance(exc, RuntimeError) and "another coroutine is already waiting" in str(exc)


async def pooled_connection(pool: Any) -> Any:
    """A connection of `pool`, for the caller's own use until it is released to the pool."""
    pool_type = type(pool)
    named = _NAMED.get(pool_type)
    if named is None:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
        named = _NAMED[pool_type] = parameter is not None and parameter.default is parameter.empty
    if named:
        return await pool.get_connection("EVALSHA")
    return await pool.get_connection()


def writer_of(connection: Any) -> Any:
    """The stream writer of an open connection (None if closed, or no stream: fakeredis)."""
    return connection._writer if connection.is_connected else None


# Per transport class: whether it has what the engine uses of a socket's transport
# (`_TRANSPORT_METHODS`), asked once per class rather than at every write.
_ON_SOCKET: dict[type, bool] = {}


def socket_writer(connection: Any) -> Any:
    """The stream writer of `connection` when it is open on a socket whose transport is not
    closing, else None (also for connections that are not on a socket, such as fakeredis')."""
    writer = writer_of(connection)
    transport = getattr(writer, "transport", None)
    if transport is None:
        return None
    kind = type(transport)
    on_socket = _ON_SOCKET.get(kind)
    if on_socket is None:
        on_socket = _ON_SOCKET[kind] = all(hasattr(kind, name) for name in _TRANSPORT_METHODS)
    if not on_socket or transport.is_closing():
        return None
    return writer


def socket_transport(connection: Any) -> Any:
    """The transport of `connection`'s socket when it is open and not closing, else None
    (also for connections that are not on a socket, such as fakeredis')."""
    writer = socket_writer(connection)
    return None if writer is None else writer.transport


def unread(connection: Any) -> bool | None:
    """Whether bytes received on `connection` wait in its stream unread (or it has seen the
    end): True or False, or None when its reader is not an asyncio stream."""
    stream = connection._reader
    if not isinstance(stream, asyncio.StreamReader):
        return None
    return bool(stream._buffer) or stream.at_eof()  # type: ignore[attr-defined]


def take_unread(connection: Any) -> bytes | None:
    """The bytes received on `connection` that wait unread in its asyncio stream, taken out
    of it (to be parsed elsewhere); None if its stream saw its end, or is no asyncio one."""
    stream = connection._reader
    if not isinstance(stream, asyncio.StreamReader) or stream.at_eof():
        return None
    buffer = stream._buffer  # type: ignore[attr-defined]
    received = bytes(buffer)
    buffer.clear()
    return received


def pubsub_unsubscribed(pubsub: Any, message_type: bytes, channel: bytes) -> None:
    """Tell `pubsub` the server confirmed the unsubscription of `channel` (`message_type`:
    b"unsubscribe" or b"sunsubscribe"), as its own read would (`PubSub.handle_message`):
    it forgets the channel, and so no longer subscribes it again on re-connecting. For a
    reader that parses the connection's replies itself."""
    sharded = message_type == b"sunsubscribe"
    # redis-py < 8 (and valkey-py < 6.1) keep no sharded channels: `ssubscribe` above does.
    pending = getattr(
        pubsub,
        "pending_unsubscribe_shard_channels" if sharded else "pending_unsubscribe_channels",
        None,
    )
    if pending is not None and channel in pending:
        pending.remove(channel)
        subscribed = getattr(pubsub, "shard_channels" if sharded else "channels", None)
        if subscribed is not None:
            subscribed.pop(channel, None)


def reply_error(connection: Any) -> Any:
    """The function the connection's parser makes an error reply's exception with (NOSCRIPT
    as NoScriptError, and so on), or None if its parser has none."""
    return getattr(connection._parser, "parse_error", None)


def holds_connections(client: Any) -> bool:
    """Has the client open connections (the pool's, and a `single_connection_client`'s own;
    a Cluster client's are per node and not looked at)? No public list exists."""
    pool = getattr(client, "connection_pool", None)
    connections = [
        *getattr(pool, "_available_connections", ()),
        *getattr(pool, "_in_use_connections", ()),
        getattr(client, "connection", None),
    ]
    return any(getattr(connection, "is_connected", False) for connection in connections)


def node_client(node: Any) -> Any:
    """A client of one Cluster node, of the library the Cluster client is of (redis-py or
    valkey-py), made like the cluster's own connections to it (for that node's pub/sub)."""
    connection_class = node.connection_class
    library = connection_class.__module__.partition(".")[0]  # "redis" or "valkey"
    module = importlib.import_module(f"{library}.asyncio")
    pool = module.ConnectionPool(
        connection_class=connection_class, max_connections=2, **node.connection_kwargs
    )
    return getattr(module, _SINGLE_CLIENT[library])(connection_pool=pool)


# The single-server client class of each library, by the library's package name.
_SINGLE_CLIENT = {"redis": "Redis", "valkey": "Valkey"}


def engine_client(client: Any) -> Any:
    """A client for the engine's own connections to `client`'s server: the same connection
    class and settings (address or unix socket, credentials, TLS, protocol, timeouts,
    retry, client name), in a pool of its own. So the connections the engine keeps (the
    auto-pipeline's link, pub/sub) and its background calls never count against the
    user's `max_connections`, never wait in a `BlockingConnectionPool`, and never share
    a `single_connection_client`'s one connection. `client` itself when it has no such
    pool (a Cluster client: its pub/sub is per node already, see `node_client`)."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, _POOLS):
        return client
    library = "valkey" if isinstance(client, _VALKEY) else "redis"
    module = importlib.import_module(f"{library}.asyncio")
    own = module.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
    _closed_with(pool, own)
    return getattr(module, _SINGLE_CLIENT[library])(connection_pool=own)


# The engine's own pools of each user's pool, closed whenever it is (see `_closed_with`).
_OWN_POOLS = "_aiolocks_engine_pools"


def _closed_with(pool: Any, own: Any) -> None:
    """Disconnect `own` whenever `pool` disconnects (`client.aclose()`, `pool.aclose()`): a
    client closed by its user closes the engine's connections too, as when they were the
    pool's own (a program that makes a client per job leaves none open). The first call
    wraps the pool instance's `disconnect`; the engine's pools are weakly referenced."""
    pools: weakref.WeakSet[Any] | None = pool.__dict__.get(_OWN_POOLS)
    if pools is None:
        pools = weakref.WeakSet()
        setattr(pool, _OWN_POOLS, pools)
        disconnect = pool.disconnect

        async def disconnect_all(*args: Any, **kwargs: Any) -> Any:
            try:
                return await disconnect(*args, **kwargs)
            finally:
                for each in list(pools):
                    with contextlib.suppress(Exception):
                        await each.disconnect(*args, **kwargs)

        pool.disconnect = disconnect_all
    pools.add(own)


# Set on a client whose `aclose` is wrapped (`on_aclose`), to the hook it calls.
_ON_ACLOSE = "_aiolocks_on_aclose"


def on_aclose(client: Any, hook: Callable[[Any], Awaitable[None]]) -> None:
    """Have `hook(client)` awaited whenever the user closes `client`, before its connections
    close: `aclose()`, and `close()` and `async with client`, which call it. The first call
    wraps the client instance's `aclose` (holding the client weakly, so a dropped client is
    still collected). Single-server clients only: a Cluster client calls its own `aclose()`
    to reset its topology after a connection error, which is no close of the user's."""
    if not isinstance(getattr(client, "connection_pool", None), _POOLS):
        return
    if _ON_ACLOSE in client.__dict__:
        return
    setattr(client, _ON_ACLOSE, hook)
    closing = type(client).aclose
    owner = weakref.ref(client)

    async def aclose(*args: Any, **kwargs: Any) -> Any:
        user = owner()
        if user is None:
            return None
        await user.__dict__[_ON_ACLOSE](user)
        return await closing(user, *args, **kwargs)

    client.aclose = aclose


def connection_options(client: Any) -> Mapping[str, Any]:
    """The options `client` makes its connections with (host, port, db, socket_timeout...):
    its pool's, or, on Cluster (no pool of its own), the client's; empty if neither."""
    pool = getattr(client, "connection_pool", None)
    options = getattr(pool, "connection_kwargs", None) or getattr(client, "connection_kwargs", None)
    return options or {}


def describe(client: Any) -> str:
    """`client` named for an error: its class, the server it is for, and its identity."""
    kwargs = connection_options(client)
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
    return f"{type(client).__name__}({where}, db {kwargs.get('db', 0)}) at {id(client):#x}"


async def close_engine_client(engine: Any, client: Any) -> None:
    """Close what `engine_client(client)` made (nothing if it was `client` itself): every
    connection of its pool, ignoring errors."""
    if engine is client:
        return
    with contextlib.suppress(Exception):
        await engine.connection_pool.disconnect()


async def close_idle_connections(client: Any) -> None:
    """Close the idle connections of a single-server client's pool (not a Cluster
    client's: its pools are per node), ignoring errors."""
    pool: Any = getattr(client, "connection_pool", None)
    if isinstance(pool, _POOLS):
        with contextlib.suppress(Exception):
            await pool.disconnect(inuse_connections=False)


def needs_initialise(cluster: Any) -> bool:
    """Whether a Cluster client has not initialised itself yet (its first command would)."""
    return getattr(cluster, "_initialize", True) is not False


class _Sharded:
    """The sharded channels of one PubSub whose client has no `ssubscribe` (redis-py < 8):
    subscribed with SSUBSCRIBE sent by hand, and sent again whenever its connection
    re-connects (redis-py re-subscribes only the channels it knows of)."""

    __slots__ = ("__weakref__", "channels", "connection")

    def __init__(self) -> None:
        self.channels: set[bytes] = set()
        self.connection: Any = None

    def watch(self, connection: Any) -> None:
        if connection is not self.connection:
            if self.connection is not None:
                self.connection.deregister_connect_callback(self.on_connect)
            self.connection = connection
            connection.register_connect_callback(self.on_connect)  # kept as a weak method

    async def on_connect(self, connection: Any) -> None:
        if self.channels:
            await connection.send_command("SSUBSCRIBE", *self.channels, check_health=False)


_SHARDED: weakref.WeakKeyDictionary[Any, _Sharded] = weakref.WeakKeyDictionary()


def _native(pubsub: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(pubsub, "ssubscribe", None))


async def ssubscribe(pubsub: Any, channel: bytes) -> None:
    """SSUBSCRIBE `channel` on `pubsub`, and again after each re-connect."""
    if _native(pubsub):
        await pubsub.ssubscribe(channel)
        return
    sharded = _SHARDED.get(pubsub)
    if sharded is None:
        sharded = _SHARDED[pubsub] = _Sharded()
    await _write(pubsub, "SSUBSCRIBE", channel)
    sharded.channels.add(channel)
    sharded.watch(pubsub.connection)


async def sunsubscribe(pubsub: Any, channel: bytes) -> None:
    """SUNSUBSCRIBE `channel` on `pubsub` (no longer re-subscribed on re-connect)."""
    if _native(pubsub):
        await pubsub.sunsubscribe(channel)
        return
    sharded = _SHARDED.get(pubsub)
    if sharded is not None:
        sharded.channels.discard(channel)
    await _write(pubsub, "SUNSUBSCRIBE", channel)


async def _write(pubsub: Any, *args: Any) -> None:
    """Write a command on `pubsub`'s connection (connected first), its reply left to the
    reader: without the health check, whose PING reply would be read here."""
    await pubsub.connect()
    await pubsub.connection.send_command(*args, check_health=False)
