"""`RedisSemaphore` and `RedisReadWriteLock` across real processes, on every server variant.

Worker scripts live in ``tests/workers/``. Holders record what they saw in Redis (an
INCR/DECR counter of who is inside, and a history list of ``[kind, worker, task, start,
end, fence]`` holdings with ``time.monotonic()`` times, which every process of the host
shares); the test checks the history afterwards. Nothing here sleep-polls Redis: the test
waits on worker output lines, process exits and its own tasks, each with a bound. That a
waiter of the test is queued on the server is seen with `QueueProbe`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis.asyncio
from _probes import QueueProbe
from _servers import arun_workers
from _workers import LINE_TIMEOUT, Spawn

from aiolocks import RedisReadWriteLock, RedisSemaphore

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).resolve().parent / "workers"
SEMAPHORE_HOLDER = WORKERS / "semaphore_holder.py"
RWLOCK_USER = WORKERS / "rwlock_user.py"
CRASHER = WORKERS / "primitive_crasher.py"

SLACK = 0.25  # a waiter must get a dead holder's permit/side within its ttl plus this

Record = tuple[str, int, int, float, float, int]  # kind, worker, task, start, end, fence


async def _history(client: redis.asyncio.Redis, name: str) -> list[Record]:
    raw = await client.lrange(f"test:{{{name}}}:history", 0, -1)
    records: list[Record] = []
    for item in raw:
        kind, worker, task, start, end, fence = json.loads(item)
        records.append((str(kind), int(worker), int(task), float(start), float(end), int(fence)))
    return records


def _max_overlap(records: Sequence[Record]) -> int:
    """Most holdings whose [start, end] intervals overlap at one instant."""
    events = sorted(
        [(start, 1) for _, _, _, start, _, _ in records]
        + [(end, -1) for _, _, _, _, end, _ in records],
        key=lambda event: (event[0], event[1]),  # an end before a start at the same instant
    )
    inside = most = 0
    for _, step in events:
        inside += step
        most = max(most, inside)
    return most


def _overlaps(a: Record, b: Record) -> bool:
    return a[3] < b[4] and b[3] < a[4]


# -- 1. a semaphore's limit across processes --------------------------------------------------


async def test_semaphore_limit_across_processes(r: redis.asyncio.Redis, url: str) -> None:
    """limit=3; 4 processes x 5 tasks x 3 holdings of 20-40 ms: at most 3 inside at any
    time, and 3 really were inside together; every worker finishes; fences all distinct."""
    name, limit, workers, tasks, rounds = "sem-mp", 3, 4, 5, 3
    started = time.monotonic()
    results = await arun_workers(
        str(SEMAPHORE_HOLDER),
        [
            [url, name, str(limit), str(i), str(workers), str(tasks), str(rounds), "20", "30"]
            for i in range(workers)
        ],
        timeout=60,
    )
    elapsed = time.monotonic() - started
    most_seen: list[int] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        done = [line.split() for line in result.stdout.splitlines() if line.startswith("done ")]
        assert len(done) == 1, result.stdout
        _, worker, most, holdings = done[0]
        assert int(worker) == index
        assert int(holdings) == tasks * rounds, result.stdout
        most_seen.append(int(most))

    # The server-side counter: INCR replies never passed the limit, and reached it.
    assert max(most_seen) == limit, most_seen
    assert await r.get(f"test:{{{name}}}:inside") == b"0"

    history = await _history(r, name)
    assert len(history) == workers * tasks * rounds
    assert _max_overlap(history) == limit, sorted(history, key=lambda rec: rec[3])
    fences = [rec[5] for rec in history]
    assert len(set(fences)) == len(fences), sorted(fences)
    for (worker, task), group in itertools.groupby(
        sorted(history, key=lambda rec: (rec[1], rec[2], rec[3])), key=lambda rec: rec[1:3]
    ):
        mine = [rec[5] for rec in group]
        assert len(mine) == rounds and mine == sorted(mine), (worker, task, mine)
        assert len(set(mine)) == rounds

    sem = RedisSemaphore(r, name, limit=limit)
    info = await sem.inspect()
    assert (info.limit, info.holders, info.queue_length) == (limit, 0, 0), info
    assert info.fence == max(fences)
    assert await sem.available() == limit
    assert elapsed < 30, f"took {elapsed:.1f}s"


# -- 2. a holder process dies ----------------------------------------------------------------


async def _acquire_timed(acquiring: asyncio.Task[bool]) -> float:
    assert await acquiring, "not acquired after the holder died"
    return time.monotonic()


@pytest.mark.parametrize("kind", ["semaphore", "read", "write"])
async def test_holder_crash_frees_within_ttl(
    r: redis.asyncio.Redis, url: str, spawn: Spawn, kind: str
) -> None:
    """A process holding a semaphore permit (limit=1) / the read side / the write side
    (ttl=1, renewed at least once) dies with os._exit: a waiter already queued for it (a
    semaphore acquire / a writer / a reader) gets in within ttl + 0.25 s of the death, and
    not while the holder was alive."""
    name, ttl = f"crash-{kind}", 1.0
    crasher = await spawn(CRASHER, url, kind, name, ttl, ttl / 2, 20, 1, stdin=True)
    crasher_fence = int((await crasher.expect("held"))[1])

    waiter_client = redis.asyncio.Redis.from_url(url)
    task: asyncio.Task[bool] | None = None
    try:
        probe = QueueProbe(waiter_client)
        sem = RedisSemaphore(waiter_client, name, limit=1, ttl=5)
        rw = RedisReadWriteLock(waiter_client, name, ttl=5)
        if kind == "semaphore":
            task = asyncio.create_task(sem.acquire(timeout=10))
        elif kind == "read":
            task = asyncio.create_task(rw.write().acquire(timeout=10))
        else:
            task = asyncio.create_task(rw.read().acquire(timeout=10))
        await probe.wait_queued(1, LINE_TIMEOUT)

        async def still_held() -> bool:
            if kind == "semaphore":
                info = await sem.inspect()
                return info.holders == 1 and info.queue_length == 1
            rw_info = await rw.inspect()
            holder_there = rw_info.readers == 1 if kind == "read" else rw_info.writer is not None
            return holder_there and rw_info.queue_length == 1

        assert await still_held()
        await crasher.send("crash")
        await crasher.expect("crashing")
        status = await crasher.finish()
        died_at = time.monotonic()
        assert status == 1, f"{crasher.lines}\n{crasher.stderr}"
        assert await still_held()  # its lease is still running
        assert not task.done(), "got in while the holder was alive"

        got_at = await asyncio.wait_for(_acquire_timed(task), 10)
        waited = got_at - died_at
        assert waited <= ttl + SLACK, f"took {waited:.3f}s"
        if kind == "semaphore":
            info = await sem.inspect()
            assert (info.holders, info.queue_length) == (1, 0) and info.fence > crasher_fence
        else:
            rw_info = await rw.inspect()
            assert rw_info.queue_length == 0 and rw_info.fence > crasher_fence, rw_info
            if kind == "read":
                assert rw_info.writer is not None and rw_info.readers == 0, rw_info
            else:
                assert rw_info.writer is None and rw_info.readers == 1, rw_info
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await waiter_client.aclose()


# -- 3. a read-write lock across processes ------------------------------------------------


async def test_rwlock_across_processes(r: redis.asyncio.Redis, url: str) -> None:
    """3 reader processes and 1 writer process: a writer's holding overlaps no other
    holding, readers do overlap, the writer is not starved, and fences order the
    holdings: everything before a writer has a smaller fence, everything after a larger."""
    name, readers, reader_rounds, writer_rounds = "rw-mp", 3, 12, 8
    argv = [
        [url, name, "read", str(i), str(readers + 1), str(reader_rounds), "30", "5", "30"]
        for i in range(readers)
    ]
    argv.append(
        [url, name, "write", str(readers), str(readers + 1), str(writer_rounds), "20", "30", "30"]
    )
    started = time.monotonic()
    results = await arun_workers(str(RWLOCK_USER), argv, timeout=60)
    elapsed = time.monotonic() - started
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        assert result.stdout.split()[:2] == ["done", str(index)], result.stdout

    history = await _history(r, name)
    writes = [rec for rec in history if rec[0] == "write"]
    reads = [rec for rec in history if rec[0] == "read"]
    assert len(writes) == writer_rounds and len(reads) == readers * reader_rounds
    for write in writes:
        overlapping = [rec for rec in history if rec is not write and _overlaps(write, rec)]
        assert not overlapping, (write, overlapping)
        for rec in history:
            if rec is write:
                continue
            if rec[4] <= write[3]:
                assert rec[5] < write[5], ("before the writer, larger fence", rec, write)
            else:
                assert rec[3] >= write[4]
                assert rec[5] > write[5], ("after the writer, smaller fence", rec, write)
    assert _max_overlap(reads) >= 2, sorted(reads, key=lambda rec: rec[3])
    fences = [rec[5] for rec in history]
    assert len(set(fences)) == len(fences), sorted(fences)

    info = await RedisReadWriteLock(r, name).inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 0, 0), info
    assert info.fence == max(fences)
    assert elapsed < 30, f"took {elapsed:.1f}s"
