"""How many package files one lock operation walks through (issue 41).

    python benchmarks/files_entered.py [--url redis://127.0.0.1:PORT] [--list]

Counts the distinct files under `aiolocks/` in which any frame is entered (`sys.setprofile`'s
'call' events: a function called or a coroutine resumed, in any task of the loop: the
runner's flusher, the notifier's reader, the keeper, ...) during:

- `uncontended`: one warm `async with RedisMutex(client, name)` (acquire and release, no one
  else waiting);
- `handoff`: one warm contended hand-off between two clients (two processes' worth): from
  the holder's `release()` to the waiter's `acquire()` returning.

Warm: each operation is done once unmeasured first, on the same clients and instances.
Without `--url`, a `redis-server` from PATH is started on a free 127.0.0.1 port.
`tests/test_files_entered.py` keeps both counts within the issue's limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import redis
import redis.asyncio

import aiolocks
from aiolocks import RedisMutex

PACKAGE = Path(aiolocks.__file__).resolve().parent


def _relative(filename: str) -> str | None:
    try:
        return str(Path(filename).resolve().relative_to(PACKAGE))
    except ValueError:
        return None


async def _entered(operation: Callable[[], Awaitable[Any]]) -> set[str]:
    """The package files entered by any frame while `operation` runs (on this thread)."""
    seen: set[str] = set()
    cache: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name not in cache:
            cache[name] = _relative(name)
        relative = cache[name]
        if relative is not None:
            seen.add(relative)

    sys.setprofile(profile)
    try:
        await operation()
    finally:
        sys.setprofile(None)
    return seen


async def _cycle(mutex: RedisMutex) -> None:
    async with mutex:
        pass


async def _handoff(holder: RedisMutex, waiter: RedisMutex, measure: bool) -> set[str]:
    """`holder` acquires, `waiter` queues behind it (a task), `holder` releases: the files
    entered from the release to the waiter's acquisition (if `measure`)."""
    await holder.acquire()
    queued = asyncio.Event()
    got = asyncio.Event()
    done = asyncio.Event()

    async def wait() -> None:
        queued.set()
        async with waiter:
            got.set()
            await done.wait()

    task = asyncio.create_task(wait())
    await queued.wait()
    await _settle(waiter)
    assert waiter.statistics().tasks_waiting == 1, "the waiter is not waiting"

    async def release_and_hand_over() -> None:
        await holder.release()
        await got.wait()

    seen = await _entered(release_and_hand_over) if measure else set()
    if not measure:
        await release_and_hand_over()
    done.set()
    await task
    return seen


async def _settle(waiter: RedisMutex) -> None:
    """Let the waiter's first try reach Redis and the waiter park (a few loop turns and a
    round trip: its TRY is answered BUSY before the release is sent)."""
    admin_ping = waiter._client.ping  # one round trip on the waiter's own client
    for _ in range(3):
        await admin_ping()
        for _ in range(20):
            await asyncio.sleep(0)


async def count(url: str) -> dict[str, list[str]]:
    """{'uncontended': files, 'handoff': files} for one warm operation each on `url`."""
    one = redis.asyncio.Redis.from_url(url)
    two = redis.asyncio.Redis.from_url(url)
    try:
        mutex = RedisMutex(one, "files-entered:free")
        await _cycle(mutex)
        await _cycle(mutex)
        uncontended = await _entered(lambda: _cycle(mutex))
        holder = RedisMutex(one, "files-entered:handoff")
        waiter = RedisMutex(two, "files-entered:handoff")
        await _handoff(holder, waiter, measure=False)
        handoff = await _handoff(holder, waiter, measure=True)
    finally:
        await one.aclose()
        await two.aclose()
    return {"uncontended": sorted(uncontended), "handoff": sorted(handoff)}


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A `redis-server` from PATH on a free 127.0.0.1 port, stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no redis-server on PATH (or give --url)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    process = subprocess.Popen([*args, "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                if redis.Redis.from_url(url).ping():
                    break
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a server to use (default: start redis-server)")
    parser.add_argument("--list", action="store_true", help="list the files, too")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(redis_server())
        result = asyncio.run(count(url))
    for phase, files in result.items():
        print(f"{phase}: {len(files)} package files")
        if args.list:
            for name in files:
                print(f"    {name}")


if __name__ == "__main__":
    main()
