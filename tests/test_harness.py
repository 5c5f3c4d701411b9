"""Tests of the test harness itself: servers, clients, command counting, worker processes."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
from _servers import (
    HOST,
    KINDS,
    ServerKind,
    ServerProcess,
    ServerStartError,
    arun_workers,
    available_kinds,
    binary_path,
    command_count,
    free_port,
    run_workers,
)
from conftest import Backend

NOTIFY_VARIANTS = [f"{kind}-notify" for kind in KINDS]
PLAIN_VARIANTS = [f"{kind}-plain" for kind in KINDS]

WORKER = """
import sys
import redis

url, worker_id = sys.argv[1], sys.argv[2]
client = redis.Redis.from_url(url)
print(f"worker {worker_id} incr={client.incr('harness:counter')} pid-ok")
client.close()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _config(client: redis.asyncio.Redis, name: str) -> str:
    reply: dict[Any, Any] = await client.config_get(name)
    value = reply[name.encode()] if name.encode() in reply else reply[name]
    return value.decode() if isinstance(value, bytes) else str(value)


def test_valkey_always_available() -> None:
    assert "valkey" in available_kinds()
    assert binary_path("valkey") is not None


async def test_ping(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    assert server.running
    assert _alive(server.pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert await r.ping() is True
    assert await r.dbsize() == 0


async def test_server_is_the_expected_kind(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    info = await r.info("server")
    assert (info.get("server_name") == "valkey") == (server.kind == "valkey"), info
    assert info["tcp_port"] == server.port
    assert info["process_id"] == server.pid


async def test_server_config(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    assert await _config(r, "bind") == HOST
    assert await _config(r, "save") == ""
    assert await _config(r, "appendonly") == "no"


@pytest.mark.parametrize("server", NOTIFY_VARIANTS, indirect=True)
async def test_notify_variant_flags(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    assert server.notify
    flags = await _config(r, "notify-keyspace-events")
    assert "K" in flags
    assert "E" in flags
    assert "A" in flags or "x" in flags  # expired events are included


@pytest.mark.parametrize("server", PLAIN_VARIANTS, indirect=True)
async def test_plain_variant_flags(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    assert not server.notify
    assert await _config(r, "notify-keyspace-events") == ""


@pytest.mark.parametrize("server", NOTIFY_VARIANTS, indirect=True)
async def test_expired_keyspace_notification_arrives(r: redis.asyncio.Redis) -> None:
    pubsub = r.pubsub()

    async def next_message() -> dict[str, Any]:
        while True:
            message: dict[str, Any] | None = await pubsub.get_message(timeout=1.0)
            if message is not None:
                return message

    async def events_until_expired() -> list[bytes]:
        events: list[bytes] = []
        while b"expired" not in events:
            message = await next_message()
            assert message["type"] == "message", message
            assert message["channel"] == b"__keyspace@0__:k"
            events.append(message["data"])
        return events

    try:
        await pubsub.subscribe("__keyspace@0__:k")
        confirmation = await asyncio.wait_for(next_message(), timeout=5)
        assert confirmation["type"] == "subscribe"

        await r.set("k", "v", px=50)
        events = await asyncio.wait_for(events_until_expired(), timeout=5)
        # SET ... PX emits "set" and "expire"; then the server's expiry emits "expired".
        assert events == [b"set", b"expire", b"expired"]
        assert await r.exists("k") == 0
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py


@pytest.mark.parametrize("kind", KINDS)
async def test_restart_same_port_empty_data(
    kind: ServerKind, server_factory: Callable[..., ServerProcess]
) -> None:
    server = server_factory(kind=kind, notify=False)
    port, old_pid = server.port, server.pid
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        await client.set("survives", "no")
        assert await client.get("survives") == b"no"
    finally:
        await client.aclose()

    server.restart()
    assert server.port == port
    assert server.pid != old_pid
    assert not _alive(old_pid)

    client = redis.asyncio.Redis.from_url(server.url)
    try:
        assert await client.ping() is True
        assert await client.dbsize() == 0
    finally:
        await client.aclose()

    server.stop()
    assert not server.running
    server.restart()  # also works from the stopped state
    assert server.port == port
    assert server.running


def test_start_fails_fast_with_log_when_port_taken() -> None:
    binary = binary_path("valkey")
    assert binary is not None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind((HOST, 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = ServerProcess(binary, kind="valkey", notify=False, port=port)
        started = time.monotonic()
        with pytest.raises(ServerStartError, match=r"(?s)exited with status.*in use"):
            server.start()
        assert time.monotonic() - started < 10
    assert not server.running


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, port))


async def test_command_count_counts_exactly(r: redis.asyncio.Redis) -> None:
    evalsha_before = await command_count(r, {"evalsha"})
    gets_before = await command_count(r, {"get"})
    both_before = await command_count(r, {"GET", "set"})
    total_before = await command_count(r)
    for i in range(7):
        await r.get(f"key{i}")
    for i in range(3):
        await r.set(f"key{i}", i)
    assert await command_count(r, {"get"}) - gets_before == 7
    assert await command_count(r, {"get", "set"}) - both_before == 10
    assert await command_count(r) - total_before >= 10
    assert await command_count(r, {"evalsha"}) == evalsha_before


@pytest.mark.slow
def test_run_workers_returns_each_stdout(url: str) -> None:
    results = run_workers(WORKER, [[url, str(i)] for i in range(4)], timeout=60)
    assert [res.returncode for res in results] == [0, 0, 0, 0], [res.stderr for res in results]
    for i, res in enumerate(results):
        assert res.stdout.startswith(f"worker {i} incr=")
        assert res.stdout.endswith("pid-ok\n")
    counts = sorted(int(res.stdout.split("incr=")[1].split()[0]) for res in results)
    assert counts == [1, 2, 3, 4]


@pytest.mark.slow
async def test_arun_workers_keeps_loop_running(r: redis.asyncio.Redis, url: str) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    try:
        results = await arun_workers(WORKER, [[url, "0"], [url, "1"]], timeout=60)
    finally:
        ticker.cancel()
    assert all(res.returncode == 0 for res in results), [res.stderr for res in results]
    assert await r.get("harness:counter") == b"2"
    assert ticks > 1


def test_run_workers_kills_leftovers(tmp_path: Any) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        "import sys, time\nprint('started', sys.argv[1], flush=True)\n"
        "if sys.argv[1] == 'slow':\n    time.sleep(60)\nprint('done')\n"
    )
    started = time.monotonic()
    fast, slow = run_workers(str(script), [["fast"], ["slow"]], timeout=3)
    assert time.monotonic() - started < 20
    assert fast.returncode == 0
    assert fast.stdout == "started fast\ndone\n"
    assert slow.returncode == -signal.SIGKILL
    assert slow.stdout == "started slow\n"
    assert "killed after" in slow.stderr


async def test_fake_r_is_a_redis_asyncio_client(fake_r: redis.asyncio.Redis) -> None:
    assert isinstance(fake_r, redis.asyncio.Redis)
    assert await fake_r.dbsize() == 0
    await fake_r.set("a", "1", px=10_000)
    assert await fake_r.get("a") == b"1"
    assert 0 < await fake_r.pttl("a") <= 10_000


async def test_any_r_shares_data_with_backend_clients(
    any_r: redis.asyncio.Redis, any_backend: Backend
) -> None:
    assert await any_r.dbsize() == 0
    await any_r.set("shared", "yes")
    other = any_backend.client()
    assert other is not any_r
    assert await other.get("shared") == b"yes"


async def test_any_r_can_run_lua(any_r: redis.asyncio.Redis, any_backend: Backend) -> None:
    if any_backend.is_fake and importlib.util.find_spec("lupa") is None:
        pytest.skip("fakeredis needs the 'lupa' package (fakeredis[lua]) for EVAL/EVALSHA")
    assert await any_r.eval("return redis.call('INCR', KEYS[1])", 1, "lua:n") == 1
