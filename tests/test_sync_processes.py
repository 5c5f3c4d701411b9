"""`aiolocks.sync` across real processes: threads of some processes and asyncio tasks of
others on one name (tests/workers/sync_user.py), Ctrl-C while waiting, an exit while
holding, and a fork (tests/workers/sync_lifecycle.py).

Knowing that a waiter is on the server's queue is event-driven: the test subscribes to the
queue key's keyspace events (the `valkey_notify` server sends them) and waits for each
`rpush`, the enqueueing of one waiter. Every wait is on a line, an event or an exit, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
from _faults import leftovers
from _servers import ServerProcess
from _workers import Spawn, Worker

from aiolocks import RedisMutex

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).resolve().parent / "workers"
USER = WORKERS / "sync_user.py"
LIFECYCLE = WORKERS / "sync_lifecycle.py"
NAME = "interop"
BOUND = 20.0  # longest wait for one step of a worker


@pytest.fixture
async def r(valkey_notify: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(valkey_notify.url)
    await client.flushall()
    try:
        yield client
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def enqueued(r: redis.asyncio.Redis, name: str) -> AsyncIterator[asyncio.Queue[str]]:
    """A queue that gets one item per waiter the server enqueues on the mutex `name`."""
    pubsub = r.pubsub()
    await pubsub.subscribe(f"__keyspace@0__:aiolocks:mutex:{{{name}}}:queue")
    events: asyncio.Queue[str] = asyncio.Queue()

    async def listen() -> None:
        async for message in pubsub.listen():
            if message["type"] == "message" and message["data"] == b"rpush":
                events.put_nowait("rpush")

    listener = asyncio.ensure_future(listen())
    try:
        yield events
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        await pubsub.aclose()  # type: ignore[no-untyped-call]


async def users(spawn: Spawn, url: str, modes: list[str]) -> list[Worker]:
    workers = [await spawn(USER, mode, url, stdin=True) for mode in modes]
    for worker in workers:
        await worker.expect("ready")
    return workers


async def finish(workers: list[Worker]) -> None:
    for worker in workers:
        await worker.send("quit")
    for worker in workers:
        assert await worker.finish() == 0, worker.stderr
        assert worker.stderr == "", worker.stderr  # no warning, no traceback


async def test_threads_and_tasks_counter_exact_fences_rising_nothing_left(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    """Two processes of 4 threads and two of 4 asyncio tasks, 15 rounds each, on one name
    (the mutex's default): every increment kept, every fence above the one before."""
    workers = await users(spawn, valkey_notify.url, ["sync", "async", "sync", "async"])
    for worker in workers:
        await worker.send("count 4 15")
    for worker in workers:
        await worker.expect("counted", BOUND * 3)
    await finish(workers)
    assert int(await r.get("counter") or 0) == 4 * 4 * 15
    fences = [int(fence) for fence in await r.lrange("log", 0, -1)]
    assert len(fences) == 240 and all(a < b for a, b in itertools.pairwise(fences))
    assert await leftovers(r, "mutex", NAME) == {}


async def test_fifo_across_threads_and_tasks(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    """Waiters queued one after another, threads and tasks of four processes, are served
    in that order (strict FIFO: local_handoff=0), with rising fences."""
    sync_a, async_b, sync_c, async_d = await users(
        spawn, valkey_notify.url, ["sync", "async", "sync", "async"]
    )
    plan = [(sync_a, "a1"), (async_b, "b1"), (sync_c, "c1"), (sync_a, "a2"),
            (async_d, "d1"), (sync_c, "c2"), (async_b, "b2")]  # fmt: skip
    holder = RedisMutex(r, NAME, local_handoff=0)
    async with enqueued(r, NAME) as events:
        assert await holder.acquire(timeout=BOUND)
        for worker, ident in plan:
            await worker.send(f"acquire {ident}")
            await asyncio.wait_for(events.get(), BOUND)  # that waiter is on the queue now
        await holder.release()
    for worker, _ in plan:
        await worker.expect("done", BOUND)
    await finish([sync_a, async_b, sync_c, async_d])
    entries: list[bytes] = await r.lrange("order", 0, -1)  # type: ignore[assignment]
    order = [entry.decode().split() for entry in entries]
    assert [ident for ident, _ in order] == [ident for _, ident in plan]
    fences = [int(fence) for _, fence in order]
    assert all(a < b for a, b in itertools.pairwise(fences))
    assert await leftovers(r, "mutex", NAME) == {}


async def test_semaphore_never_above_its_limit_across_threads_and_tasks(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    workers = await users(spawn, valkey_notify.url, ["sync", "async", "sync"])
    for worker in workers:
        await worker.send("semaphore 4 10 3")
    for worker in workers:
        await worker.expect("held", BOUND * 3)
    await finish(workers)
    assert await r.llen("over") == 0
    assert int(await r.get("inside") or 0) == 0
    assert await leftovers(r, "semaphore", NAME) == {}


async def test_rate_limiter_never_above_its_bound_across_threads_and_tasks(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    """rate 50/s, burst 5: 40 permits taken by threads and tasks together take at least
    (40 - 5) / 50 s."""
    workers = await users(spawn, valkey_notify.url, ["sync", "async"])
    loop = asyncio.get_running_loop()
    started = loop.time()
    for worker in workers:
        await worker.send("rate 4 5")
    for worker in workers:
        await worker.expect("rated", BOUND)
    elapsed = loop.time() - started
    await finish(workers)
    assert await r.llen("permits") == 40
    assert elapsed >= (40 - 5) / 50 - 0.01, elapsed


async def test_ctrl_c_while_waiting_leaves_nothing_behind(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    name = "sigint"
    holder = RedisMutex(r, name)
    async with enqueued(r, name) as events:
        assert await holder.acquire(timeout=BOUND)
        waiter = await spawn(LIFECYCLE, "wait", valkey_notify.url, name, stdin=True)
        await waiter.expect("waiting")
        await asyncio.wait_for(events.get(), BOUND)  # queued
        assert (await holder.inspect()).queue_length == 1
        waiter.proc.send_signal(signal.SIGINT)
        await waiter.expect("interrupted", BOUND)
        # The entry was withdrawn before the interrupt was raised: the queue is empty while
        # the process still lives, long before the entry's liveness deadline (its ttl).
        assert (await holder.inspect()).queue_length == 0
        assert await waiter.finish() == 0
    assert waiter.stderr == "", waiter.stderr
    await holder.release()
    assert await leftovers(r, "mutex", name) == {}


async def test_an_exit_while_holding_releases_quietly(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    name = "exits"
    worker = await spawn(LIFECYCLE, "exit", valkey_notify.url, name)
    await worker.expect("held", BOUND)
    assert await worker.finish() == 0
    assert worker.stderr == "", worker.stderr
    # Released at the exit (not left to lapse: the default ttl is far longer than this).
    assert not await RedisMutex(r, name).locked()
    assert not await RedisMutex(r, name + "-b").locked()
    assert await leftovers(r, "mutex", name) == {}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
async def test_a_forked_child_takes_renews_and_releases(
    r: redis.asyncio.Redis, valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    name = "forks"
    worker = await spawn(LIFECYCLE, "fork", valkey_notify.url, name)
    child = await worker.expect("child", BOUND)
    parent = await worker.expect("parent", BOUND)
    assert await worker.finish() == 0
    assert worker.stderr == "", worker.stderr
    assert child[1] == "ok" and int(child[2]) > 0
    assert parent[1:] == ["ok", "0"]
    assert await leftovers(r, "mutex", name) == {}
    assert await leftovers(r, "mutex", name + "-child") == {}
