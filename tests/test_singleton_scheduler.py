"""`examples/singleton_scheduler.py` with 3 replica processes (`workers/election_replica.py`):
SIGKILL of the leader elects another within ttl + 0.5 s, no two leaders' job runs overlap
(the history check, and server TIME stamps), and fences rise with every term. On a
server with and without keyspace notifications, and on the 3-primary cluster."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

import pytest
from _history import HistoryLog, check
from _workers import ROOT, Spawn, Worker

pytestmark = pytest.mark.slow

REPLICA = ROOT / "tests" / "workers" / "election_replica.py"
TTL = 1.0
PERIOD = 0.05


async def _first_elected(workers: list[Worker], timeout: float) -> tuple[Worker, int, float]:
    """The worker that prints `elected` first: it, its fence, and when it was read."""
    reads = {asyncio.ensure_future(worker.expect("elected", timeout)): worker for worker in workers}
    try:
        done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for read in reads:
            read.cancel()
        for read in reads:
            with contextlib.suppress(asyncio.CancelledError, AssertionError):
                await read
    read = done.pop()
    fields = read.result()
    return reads[read], int(fields[3]), time.monotonic()


async def hand_over(url: str, client: Any, spawn: Spawn) -> None:
    log = HistoryLog(client, "scheduler")
    workers = [await spawn(REPLICA, url, f"replica-{n}", TTL, PERIOD, 60) for n in range(3)]
    leader, fence, _ = await _first_elected(workers, 20)
    fences = [fence]
    handovers = []
    for _ in range(2):
        await leader.expect("ran")
        await leader.expect("ran")
        killed_at = time.monotonic()
        leader.kill()
        await leader.finish()
        workers.remove(leader)
        leader, fence, elected_at = await _first_elected(workers, TTL + 10)
        handovers.append(elected_at - killed_at)
        fences.append(fence)
    await leader.expect("ran")
    await leader.expect("ran")
    for worker in workers:
        worker.kill()
        await worker.finish()

    assert all(delay <= TTL + 0.5 for delay in handovers), handovers
    assert fences == sorted(fences) and len(set(fences)) == 3, fences
    entries = await log.entries()
    assert len(entries) >= 6
    assert check(entries, counter=await log.counter()) == []
    runs = sorted(entries, key=lambda entry: entry.start_us)
    for before, after in itertools.pairwise(runs):  # server TIME, in µs
        assert before.end_us <= after.start_us, (before, after)
    terms = [entry.fence // 1000 for entry in runs]
    assert terms == sorted(terms) and set(terms) == set(fences)


@pytest.mark.parametrize("server", ["valkey-notify", "valkey-plain"], indirect=True)
async def test_killing_the_leader_elects_another_without_overlap(
    url: str, r: Any, spawn: Spawn
) -> None:
    await hand_over(url, r, spawn)


async def test_killing_the_leader_on_the_cluster(
    cluster: Any, cluster_r: Any, spawn: Spawn
) -> None:
    await hand_over("cluster+" + cluster.startup_url, cluster_r, spawn)
