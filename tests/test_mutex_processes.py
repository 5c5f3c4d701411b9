"""`RedisMutex` across real processes, on every server variant.

Worker scripts live in ``tests/workers/`` and print one event per stdout line. Nothing
here sleep-polls Redis: the test waits on worker output lines, process exits and its own
tasks, each with a bound.

Knowing that a waiter is on the server's queue (FIFO test, dead-waiter test) is
event-driven too: the worker's client (and the test's, `WatchingClient`) wraps the
engine's script runner (`_lockworker.on_queued`) and reports the reply of the acquire
script in ``wait`` mode that says "queued" (``{0, pttl}``). That reply is sent only after
the script has queued the caller, so from then on the entry is on the server; each such
report is then confirmed once with ``inspect().queue_length``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio
from _servers import arun_workers
from _workers import LINE_TIMEOUT, Spawn, Worker

from aiolocks import RedisMutex
from aiolocks._engine._leasedlock import DEFAULT_LOCAL_HANDOFF

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from _lockworker import on_queued

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).resolve().parent / "workers"
COUNTER = WORKERS / "mutex_counter.py"
WAITER = WORKERS / "mutex_waiter.py"
CRASHER = WORKERS / "mutex_crasher.py"

SLACK = 0.25  # a waiter must get a dead holder's mutex within its ttl plus this


@dataclass
class WatchingClient:
    """A client whose waiters' tokens go on `queued` as soon as the reply of the acquire
    script (``EVALSHA sha numkeys *keys token ttl_ms 'wait' channel``) says they are
    queued (``{0, pttl}``). Same hook as the workers' (``tests/workers/_lockworker.py``)."""

    client: redis.asyncio.Redis
    queued: asyncio.Queue[str]


@pytest.fixture
async def watching_client(url: str) -> AsyncIterator[WatchingClient]:
    client = redis.asyncio.Redis.from_url(url)
    watching = WatchingClient(client, asyncio.Queue())
    on_queued(client, watching.queued.put_nowait)
    try:
        yield watching
    finally:
        await client.aclose()


# -- 1. mutual exclusion --------------------------------------------------------------------


async def test_mutual_exclusion_across_processes(r: redis.asyncio.Redis, url: str) -> None:
    """8 processes x 100 non-atomic increments: none lost, every fence used exactly once."""
    name, workers, iterations = "mx", 8, 100
    started = time.monotonic()
    results = await arun_workers(
        str(COUNTER),
        [[url, name, str(i), str(workers), str(iterations), "5", "30"] for i in range(workers)],
        timeout=60,
    )
    elapsed = time.monotonic() - started
    fences: dict[int, list[int]] = {}
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        lines = [line.split(" ", 3) for line in result.stdout.splitlines()]
        reported = [fields for fields in lines if fields[0] == "fences"]
        assert len(reported) == 1 and reported[0][2] == name, result.stdout
        fences[int(reported[0][1])] = json.loads(reported[0][3])

    assert await r.get(f"test:{{{name}}}:counter") == str(workers * iterations).encode()
    assert sorted(fences) == list(range(workers))
    for worker, mine in fences.items():
        assert len(mine) == iterations, worker
        assert all(a < b for a, b in itertools.pairwise(mine)), f"worker {worker}: {mine}"
    every = [fence for mine in fences.values() for fence in mine]
    assert len(set(every)) == len(every) == workers * iterations
    # Every grant took one block of fences above every fence before it (one task per process:
    # each block's first only): the counter ends at the top of the last grant's block.
    top = max(every) + DEFAULT_LOCAL_HANDOFF
    assert (await RedisMutex(r, name).inspect()).fence == top
    # They did contend (the barrier started them together): with FIFO hand-off the holder
    # changes at almost every grant (799 of 799 in practice); half of that is required.
    holder_of = {fence: worker for worker, mine in fences.items() for fence in mine}
    in_order = [holder_of[fence] for fence in sorted(holder_of)]
    switches = sum(a != b for a, b in itertools.pairwise(in_order))
    assert switches >= workers * iterations // 2, switches

    info = await RedisMutex(r, name).inspect()
    assert (info.owner, info.queue_length) == (None, 0)
    assert elapsed < 30, f"took {elapsed:.1f}s"


# -- 2. FIFO --------------------------------------------------------------------------------


async def test_fifo_across_processes_and_no_barging(
    r: redis.asyncio.Redis, url: str, spawn: Spawn
) -> None:
    """Waiters queued one after another (each in its own process) are served in that order,
    and the releasing holder, re-acquiring at once, gets it only after all of them."""
    name, count, hold = "fifo", 5, 0.05
    mutex = RedisMutex(r, name, ttl=5)
    assert await mutex.acquire(timeout=5)
    holder_fence = mutex.fencing_token
    assert holder_fence is not None

    workers: list[Worker] = []
    tokens: list[str] = []
    for index in range(count):
        worker = await spawn(WAITER, url, name, index, 5, hold, 30)
        workers.append(worker)
        tokens.append((await worker.expect("queued"))[1])
        info = await mutex.inspect()
        assert info.queue_length == index + 1, info
    assert len(set(tokens)) == count

    await mutex.release()
    assert await mutex.acquire(timeout=30)  # at once: must queue behind all five
    reacquired_at = time.monotonic()
    again = mutex.fencing_token
    await mutex.release()

    acquired: list[tuple[int, int, float]] = []  # (fence, index, when)
    releasing: dict[int, float] = {}
    for index, worker in enumerate(workers):
        status = await worker.finish()
        assert status == 0, f"{worker.name}: {worker.lines}\n{worker.stderr}"
        [(_, who, fence, got_at)] = worker.events("acquired")
        [(_, who_too, left_at)] = worker.events("releasing")
        assert int(who) == int(who_too) == index
        acquired.append((int(fence), index, float(got_at)))
        releasing[index] = float(left_at)

    # Fences (and times) follow the order the waiters queued in: each release
    # handed the mutex straight to the next queued worker.
    handed = [fence for fence, _, _ in acquired]
    assert handed == sorted(set(handed)) and handed[0] > holder_fence, (holder_fence, handed)
    assert [index for _, index, _ in sorted(acquired)] == list(range(count))
    for (_, index, when), (_, _, next_when) in itertools.pairwise(acquired):
        assert releasing[index] <= next_when, (index, acquired, releasing)
        assert when < next_when
    # No barging: the releaser's immediate re-acquire came after every queued worker.
    assert (again or 0) > handed[-1]
    assert reacquired_at >= releasing[count - 1]
    info = await mutex.inspect()
    # (`again` is the first fence of its cohort's block; the counter is at the block's top)
    top = (again or 0) + DEFAULT_LOCAL_HANDOFF
    assert (info.owner, info.queue_length, info.fence) == (None, 0, top)


# -- 3. a holder process dies ---------------------------------------------------------------


@dataclass
class Acquired:
    ok: bool
    at: float
    fence: int | None


async def _acquire_timed(mutex: RedisMutex, timeout: float) -> Acquired:
    ok = await mutex.acquire(timeout=timeout)
    return Acquired(ok, time.monotonic(), mutex.fencing_token)


@contextlib.asynccontextmanager
async def _reaped(tasks: list[asyncio.Task[Acquired]]) -> AsyncIterator[None]:
    """Cancel and await whatever of ``tasks`` is still running when the block ends."""
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("waiting", [True, False], ids=["already-waiting", "after-crash"])
async def test_holder_crash_frees_within_ttl(
    r: redis.asyncio.Redis,
    url: str,
    spawn: Spawn,
    watching_client: WatchingClient,
    waiting: bool,
) -> None:
    """A process holding the mutex (ttl=1, renewed at least once) dies without releasing: a
    waiter gets it within ttl + 0.25 s of the death, and not while the holder was alive."""
    name, ttl = "crash", 1.0
    crasher = await spawn(CRASHER, url, name, ttl, ttl / 2, 20, stdin=True)
    crasher_fence = int((await crasher.expect("held"))[1])
    mutex = RedisMutex(watching_client.client, name, ttl=5)

    tasks: list[asyncio.Task[Acquired]] = []
    async with _reaped(tasks):
        if waiting:
            tasks.append(asyncio.create_task(_acquire_timed(mutex, 10)))
            await asyncio.wait_for(watching_client.queued.get(), LINE_TIMEOUT)
            info = await mutex.inspect()
            assert info.owner is not None and info.queue_length == 1, info

        await crasher.send("crash")
        await crasher.expect("crashing")
        status = await crasher.finish()
        died_at = time.monotonic()
        assert status == 1, f"{crasher.lines}\n{crasher.stderr}"
        assert (await mutex.inspect()).owner is not None  # its lease is still running

        if tasks:
            assert not tasks[0].done(), "acquired while the holder was alive"
            result = await asyncio.wait_for(tasks[0], 10)
        else:
            result = await _acquire_timed(mutex, 10)
    assert result.ok, "not acquired after the holder died"
    try:
        assert result.at - died_at <= ttl + SLACK, f"took {result.at - died_at:.3f}s"
        assert (result.fence or 0) > crasher_fence
    finally:
        await mutex.release()


# -- 4. a queued waiter process dies --------------------------------------------------------


async def test_dead_waiter_does_not_block_the_queue(
    r: redis.asyncio.Redis, url: str, spawn: Spawn, watching_client: WatchingClient
) -> None:
    """A waiter process queued behind the test's holding is SIGKILLed; on release the mutex
    goes to its (still live-looking) entry, whose lease then runs out: the next waiter,
    queued after the dead one, gets the mutex within ttl + 0.25 s of the release."""
    name, ttl = "deadwaiter", 1.0
    holder = RedisMutex(r, name, ttl=ttl)
    assert await holder.acquire(timeout=5)
    holder_fence = holder.fencing_token
    assert holder_fence is not None

    doomed = await spawn(WAITER, url, name, 0, ttl, 0, 30)
    dead_token = (await doomed.expect("queued"))[1]
    assert (await holder.inspect()).queue_length == 1

    second = RedisMutex(watching_client.client, name, ttl=ttl)
    tasks = [asyncio.create_task(_acquire_timed(second, 10))]
    async with _reaped(tasks):
        await asyncio.wait_for(watching_client.queued.get(), LINE_TIMEOUT)
        assert (await holder.inspect()).queue_length == 2

        doomed.kill()
        assert await doomed.finish() < 0  # killed by the signal
        released_at = time.monotonic()
        await holder.release()
        # Its heartbeat deadline had not passed yet, so the dead entry was handed the mutex.
        info = await holder.inspect()
        assert (info.owner, info.queue_length) == (dead_token, 1), info
        assert info.fence > holder_fence, info
        assert info.lease_remaining_ms is not None and info.lease_remaining_ms <= ttl * 1000

        result = await asyncio.wait_for(tasks[0], 10)
    assert result.ok, "the waiter behind a dead one never got the mutex"
    try:
        waited = result.at - released_at
        # Not before the dead entry's lease ran out, but soon after.
        assert ttl * 0.9 <= waited <= ttl + SLACK, f"took {waited:.3f}s"
        assert (result.fence or 0) > info.fence  # above the dead entry's grant
    finally:
        await second.release()
