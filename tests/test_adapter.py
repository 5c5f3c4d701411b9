"""The adapter (aiolocks/_base/_adapter.py), the one module that touches a client library's
internals: each of its functions against the installed redis-py (and valkey-py) on a real
server. `nox -s compat` runs this file with every supported redis-py release."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis.asyncio
import redis.client
import redis.exceptions
from _cluster import Cluster
from _servers import ServerProcess

from aiolocks._base import _adapter

PACKAGE = Path(__file__).resolve().parent.parent / "aiolocks"


@pytest.fixture(params=["redis", "valkey"])
async def client(
    request: pytest.FixtureRequest, valkey_notify: ServerProcess
) -> AsyncIterator[Any]:
    """A client of each library (valkey-py skipped when it is not installed)."""
    if request.param == "valkey":
        lib = pytest.importorskip("valkey.asyncio", reason="valkey-py is not installed")
        made: Any = lib.Valkey.from_url(valkey_notify.url)
    else:
        made = redis.asyncio.Redis.from_url(valkey_notify.url)
    try:
        yield made
    finally:
        await made.aclose()


async def test_a_pooled_connection_is_taken_without_a_warning_and_given_back(client: Any) -> None:
    pool = client.connection_pool
    connection = await _adapter.pooled_connection(pool)  # filterwarnings=error: no warning
    try:
        await connection.send_command("PING")
        assert await connection.read_response() in (b"PONG", "PONG")
    finally:
        await pool.release(connection)
    assert await _adapter.pooled_connection(pool) is connection  # it went back to the pool


async def _socket_facts(url: str) -> tuple[bool, bool | None, bool, bool | None]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        connection = await _adapter.pooled_connection(client.connection_pool)
        transport = _adapter.socket_transport(connection)
        idle = _adapter.unread(connection)
        await connection.send_command("PING")
        await asyncio.sleep(0.1)  # the reply has arrived, unread
        pending = _adapter.unread(connection)
        await connection.read_response()
        await connection.disconnect()
        closed = _adapter.socket_transport(connection)
        await client.connection_pool.release(connection)
    finally:
        await client.aclose()
    return transport is not None, idle, closed is None, pending


async def test_the_socket_transport_and_unread_bytes_are_seen(valkey_notify: ServerProcess) -> None:
    assert await _socket_facts(valkey_notify.url) == (True, False, True, True)


def test_uvloop_transports_are_socket_transports(valkey_notify: ServerProcess) -> None:
    """uvloop's TCPTransport is no asyncio.Transport subclass: asked by what it can do."""
    uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")
    facts = uvloop.run(_socket_facts(valkey_notify.url))
    assert facts == (True, False, True, True)


async def test_fakeredis_connections_have_no_socket_transport() -> None:
    fake = fakeredis.FakeAsyncRedis()
    try:
        connection = await _adapter.pooled_connection(fake.connection_pool)
        assert _adapter.socket_transport(connection) is None
        assert _adapter.unread(connection) is None
        await fake.connection_pool.release(connection)
    finally:
        await fake.aclose()


async def test_the_reply_error_function_makes_the_library_s_classes(client: Any) -> None:
    connection = await _adapter.pooled_connection(client.connection_pool)
    try:
        parse_error = _adapter.reply_error(connection)
        error = parse_error("NOSCRIPT No matching script.")
    finally:
        await client.connection_pool.release(connection)
    assert type(error).__name__ == "NoScriptError"
    assert type(error).__module__.partition(".")[0] == type(client).__module__.partition(".")[0]


async def test_holds_connections_follows_the_pool(client: Any) -> None:
    assert not _adapter.holds_connections(client)
    await client.ping()
    assert _adapter.holds_connections(client)
    await client.aclose()
    assert not _adapter.holds_connections(client)


async def test_connection_options_are_the_clients_settings(valkey_notify: ServerProcess) -> None:
    made = redis.asyncio.Redis(host="127.0.0.1", port=valkey_notify.port, db=3, socket_timeout=2.5)
    try:
        options = _adapter.connection_options(made)
        assert (options["port"], options["db"], options["socket_timeout"]) == (
            valkey_notify.port,
            3,
            2.5,
        )
        assert ", db 3) at " in _adapter.describe(made)
    finally:
        await made.aclose()
    assert _adapter.connection_options(object()) == {}  # neither a pool nor options


def test_never_decode_is_the_libraries_option() -> None:
    assert _adapter.NEVER_DECODE == redis.client.NEVER_DECODE
    valkey_client = pytest.importorskip("valkey.client", reason="valkey-py is not installed")
    assert _adapter.NEVER_DECODE == valkey_client.NEVER_DECODE


@pytest.mark.parametrize("native", [True, False], ids=["native", "by-hand"])
async def test_sharded_subscriptions_survive_a_reconnect(
    client: Any, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SSUBSCRIBE through the client's own ssubscribe (redis-py 8+) or by hand (before):
    messages arrive, and again after the connection is killed and re-connects."""
    if native and not _adapter._native(client.pubsub()):
        pytest.skip("this client has no asyncio ssubscribe (redis-py < 8.0, valkey-py)")
    if not native:
        monkeypatch.setattr(_adapter, "_native", lambda pubsub: False)
    pubsub = client.pubsub()
    try:
        await _adapter.ssubscribe(pubsub, b"chan")
        assert await _next(pubsub) == ("ssubscribe", b"chan")
        await client.execute_command("SPUBLISH", "chan", "one")
        assert await _next(pubsub) == ("smessage", b"one")
        await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        with pytest.raises((redis.exceptions.ConnectionError, Exception)):
            await _next(pubsub)  # the read finds the connection gone
        await pubsub.connection.connect()  # as the notifier's next read does
        assert await _next(pubsub) == ("ssubscribe", b"chan")  # subscribed again
        await client.execute_command("SPUBLISH", "chan", "two")
        assert await _next(pubsub) == ("smessage", b"two")
        await _adapter.sunsubscribe(pubsub, b"chan")
        assert await _next(pubsub) == ("sunsubscribe", b"chan")
    finally:
        await pubsub.aclose()


async def test_a_sharded_subscription_by_hand_reads_nothing_beside_the_reader(
    valkey_notify: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `health_check_interval` (past its interval), SSUBSCRIBE by hand while another
    task reads the connection: redis-py's `execute_command` would send a health-check PING
    and read its reply, a second reader (issue 34); written on the connection, it reads
    nothing, and the reader gets the confirmation."""
    monkeypatch.setattr(_adapter, "_native", lambda pubsub: False)
    client = redis.asyncio.Redis.from_url(valkey_notify.url, health_check_interval=1)
    pubsub: Any = client.pubsub()
    try:
        await _adapter.ssubscribe(pubsub, b"first")
        assert await _next(pubsub) == ("ssubscribe", b"first")
        reader = asyncio.create_task(_next_message(pubsub))
        await asyncio.sleep(1.2)  # the reader waits in its read, past the interval
        await _adapter.ssubscribe(pubsub, b"second")  # no second read: no RuntimeError
        assert await asyncio.wait_for(reader, 5) == ("ssubscribe", b"second")
    finally:
        await pubsub.aclose()
        await client.aclose()


async def _next_message(pubsub: Any) -> tuple[str, bytes]:
    """`_next`, past the replies of the reader's own health checks (None)."""
    while True:
        try:
            return await _next(pubsub)
        except TypeError:  # get_message gave None: a health check's PONG
            continue


async def test_the_engine_client_is_the_users_settings_in_a_pool_of_its_own(
    client: Any,
) -> None:
    """Same library, connection class and settings; its own pool (not counted against the
    user's max_connections); disconnected when the user's pool is."""
    engine = _adapter.engine_client(client)
    assert type(engine) is type(client) and engine is not client
    own, theirs = engine.connection_pool, client.connection_pool
    assert own is not theirs and own.connection_class is theirs.connection_class
    per_pool = {"maint_notifications_pool_handler"}  # redis-py 8.1 makes one per pool
    settings = {k: v for k, v in own.connection_kwargs.items() if k not in per_pool}
    assert settings == {k: v for k, v in theirs.connection_kwargs.items() if k not in per_pool}
    assert await engine.ping()
    assert _adapter.holds_connections(engine) and not _adapter.holds_connections(client)
    await client.aclose()  # its pool disconnects: the engine's goes with it
    assert not _adapter.holds_connections(engine)
    await _adapter.close_engine_client(engine, client)


async def _next(pubsub: Any) -> tuple[str, bytes]:
    message = await asyncio.wait_for(pubsub.get_message(timeout=None), 5)
    kind = message["type"]
    kind = kind.decode() if isinstance(kind, bytes) else kind
    field = "data" if kind.endswith("message") else "channel"
    value = message[field]
    return kind, value.encode() if isinstance(value, str) else value


@pytest.mark.parametrize("library", ["redis", "valkey"])
async def test_cluster_clients_initialise_once_and_node_clients_are_of_their_library(
    cluster: Cluster, library: str
) -> None:
    if library == "valkey":
        lib = pytest.importorskip("valkey.asyncio", reason="valkey-py is not installed")
        made: Any = lib.ValkeyCluster.from_url(cluster.startup_url)
    else:
        made = redis.asyncio.RedisCluster.from_url(cluster.startup_url)
    try:
        assert _adapter.needs_initialise(made)
        await made.initialize()
        assert not _adapter.needs_initialise(made)
        single = _adapter.node_client(made.get_node_from_key("x"))
        try:
            assert await single.ping()
            assert type(single).__module__.partition(".")[0] == library
        finally:
            await single.aclose()
            await single.connection_pool.disconnect()  # given to it: not closed with it
    finally:
        await made.aclose()


# Names of client-library objects in the package's code, whose private attributes only the
# adapter may touch.
_CLIENT_OBJECTS = (
    r"(connection|conn|pool|connection_pool|pubsub|client|_client|stream|writer|node|parser)"
)


def test_nothing_but_the_adapter_names_a_private_attribute_of_a_client_object() -> None:
    pattern = re.compile(rf"\b{_CLIENT_OBJECTS}\._[a-z]\w*")
    getattr_pattern = re.compile(rf"getattr\({_CLIENT_OBJECTS}, \"_[a-z]\w*\"")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_adapter.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    found += [
        f"{path.relative_to(PACKAGE)}: {match}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_adapter.py"
        for match in getattr_pattern.findall(path.read_text())
    ]
    assert not found, "\n".join(found)
