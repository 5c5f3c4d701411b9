"""A program using aiolocks ends quietly, however it ends, and gives back what it held.

Each test runs a real program as a process (`workers/exit_service.py`, the examples, the
command line) under `workers/_exitwatch.py`, which reports on stderr any task still pending
or timer still armed when its event loop closes, and any TCP connection still open at exit.
The test stops it at a point the program signals (a line on stdout), then asserts that
stderr is empty and that the server holds nothing beyond what docs/shutdown.md says: after
an end through `asyncio.run()`, no holder and no waiter (only fence counters and limits,
which expire); after a SIGTERM nobody handled, holdings that end by their ttl.
"""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio
from _servers import ServerProcess
from _workers import Spawn, Worker
from conftest import ServerPool

from aiolocks import RedisMutex

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).resolve().parent / "workers"
WATCH = WORKERS / "_exitwatch.py"
SERVICE = WORKERS / "exit_service.py"
# Keys that may stay after every holder and waiter left: counters and a semaphore's limit,
# for the idle window past the last lease (ttl + IDLE_MS, see docs/architecture.md).
_COUNTERS = ("fence", "limit")
_IDLE_MS = 1000


async def _service(spawn: Spawn, url: str, prefix: str, ttl: float, how: str, *loop: str) -> Worker:
    worker = await spawn(WATCH, *loop, SERVICE, url, prefix, ttl, how)
    await worker.expect("ready")
    return worker


async def _keys(url: str, prefix: str) -> dict[str, int]:
    """Every key under `prefix`, with its PTTL (-1: none)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        return {
            key.decode(): await client.pttl(key)
            async for key in client.scan_iter(match=f"{prefix}:*")
        }


@pytest.fixture(params=["valkey-notify", "redis-plain"])
def server_of(request: pytest.FixtureRequest, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(request.param)


@pytest.mark.parametrize(
    ("how", "stop", "status"),
    [
        ("return", None, 0),
        ("close-return", None, 0),
        ("wait", signal.SIGINT, 130),
        ("wait-term", signal.SIGTERM, 143),
    ],
    ids=["return", "close-then-return", "ctrl-c", "sigterm-handled"],
)
async def test_a_service_ends_quietly_and_gives_back_what_it_held(
    spawn: Spawn, server_of: ServerProcess, how: str, stop: signal.Signals | None, status: int
) -> None:
    prefix = f"exit-{secrets.token_hex(4)}"
    worker = await _service(spawn, server_of.url, prefix, 30, how)
    if stop is not None:
        worker.proc.send_signal(stop)
    assert await worker.finish() == status, worker.stderr
    assert worker.stderr == ""
    left = await _keys(server_of.url, prefix)
    assert {key.rsplit(":", 1)[1] for key in left} <= set(_COUNTERS), left
    assert all(0 < pttl <= 30_000 + _IDLE_MS for pttl in left.values()), left


@pytest.mark.parametrize("how", ["return", "wait"])
async def test_it_ends_quietly_on_uvloop_too(
    spawn: Spawn, valkey_notify: ServerProcess, how: str
) -> None:
    prefix = f"exit-{secrets.token_hex(4)}"
    worker = await _service(spawn, valkey_notify.url, prefix, 30, how, "--uvloop")
    if how == "wait":
        worker.proc.send_signal(signal.SIGINT)
    assert await worker.finish() == (130 if how == "wait" else 0), worker.stderr
    assert worker.stderr == ""
    left = await _keys(valkey_notify.url, prefix)
    assert {key.rsplit(":", 1)[1] for key in left} <= set(_COUNTERS), left


async def test_an_unhandled_sigterm_leaves_holdings_to_end_by_their_ttl(
    spawn: Spawn, valkey_notify: ServerProcess
) -> None:
    """Python's default SIGTERM ends the process at once, nothing run: the holdings and
    the queued waiter stay on the server until their ttl. The lock may be handed to the
    dead waiter as the holder's lease ends, and that grant ends by its ttl: the name is
    free again within 2 x ttl."""
    prefix, ttl = f"exit-{secrets.token_hex(4)}", 1.0
    worker = await _service(spawn, valkey_notify.url, prefix, ttl, "wait")
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.finish() == -signal.SIGTERM
    assert worker.stderr == ""
    left = await _keys(valkey_notify.url, prefix)
    kinds = {key.rsplit(":", 1)[1] for key in left}
    assert {"owner", "holders", "waiters"} <= kinds, left
    assert all(0 < pttl <= ttl * 1000 + _IDLE_MS for pttl in left.values()), left
    async with redis.asyncio.Redis.from_url(valkey_notify.url) as client:
        started = time.monotonic()
        mutex = RedisMutex(client, "exit:mutex", ttl=5, prefix=prefix)
        assert await mutex.acquire(timeout=5)
        assert time.monotonic() - started <= 2 * ttl + 0.5
        await mutex.release()
