"""A smoke of every primitive on one cell of the compatibility matrix, run as a process of
its own by tests/test_compat.py and `nox -s compat`: whatever redis-py (or valkey-py),
event loop and hiredis that process imports, against the server(s) given.

Each primitive waits across two clients (woken by pub/sub: the lease is 30 s, so a wake
left to the timer would fail the bound), times out, is cancelled while queued, and loses
its lease; the command line inspects and lists. Prints one JSON line: what was imported,
and the checks passed. Exits non-zero on the first failure.

    python tests/_compat_smoke.py URL [--cluster URL] [--client valkey] [--loop uvloop]
        [--direct yes|no]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from typing import Any

from aiolocks import (
    LockLost,
    LockTimeout,
    RedisElection,
    RedisMultiLock,
    RedisMutex,
    RedisRateLimiter,
    RedisReadWriteLock,
    RedisRegistry,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._engine._context import context_for
from aiolocks.testing import expire_lease

WAKE_BOUND = 3.0  # a grant message arrives in milliseconds; the timer fallback is 30 s
TTL = 30.0

Side = Callable[[Any], AbstractAsyncContextManager[Any]]


def _sides(kind: str, name: str, ttl: float = TTL) -> tuple[Side, Side]:
    """Two ways to enter `name` that exclude each other (holder, waiter), with leases of
    `ttl` (also tests/_client_configs_smoke.py's)."""
    if kind == "mutex":
        return (lambda c: RedisMutex(c, name, ttl=ttl)), (lambda c: RedisMutex(c, name, ttl=ttl))
    if kind == "mutex-local":
        return (
            (lambda c: RedisMutex(c, name, ttl=ttl, local_handoff=16)),
            (lambda c: RedisMutex(c, name, ttl=ttl, local_handoff=16)),
        )
    if kind == "semaphore":
        return (
            (lambda c: RedisSemaphore(c, name, limit=1, ttl=ttl)),
            (lambda c: RedisSemaphore(c, name, limit=1, ttl=ttl)),
        )
    if kind == "rwlock":
        return (
            (lambda c: RedisReadWriteLock(c, name, ttl=ttl).write()),
            (lambda c: RedisReadWriteLock(c, name, ttl=ttl).read()),
        )
    if kind == "multilock":
        names = [f"{name}-a", f"{name}-b"]
        return (
            (lambda c: RedisMultiLock(c, names, ttl=ttl)),
            (lambda c: RedisMultiLock(c, names[::-1], ttl=ttl)),
        )
    if kind == "election":
        return (
            (lambda c: RedisElection(c, name, ttl=ttl).campaign("a")),
            (lambda c: RedisElection(c, name, ttl=ttl).campaign("b")),
        )
    raise ValueError(kind)


KINDS = ("mutex", "mutex-local", "semaphore", "rwlock", "multilock", "election")


async def _with_timeout(enter: AbstractAsyncContextManager[Any], timeout: float) -> None:
    """Enter and leave `enter` within `timeout` (LockTimeout or TimeoutError otherwise)."""
    async with asyncio.timeout(timeout):
        async with enter:
            pass


async def _primitive(kind: str, a: Any, b: Any, tag: str) -> int:
    """The checks of one primitive across clients `a` (holder) and `b` (waiter)."""
    hold, wait = _sides(kind, f"smoke-{tag}-{kind}")
    checks = 0
    # Waiting, woken by the release (not by the 30 s timer).
    holder = hold(a)
    await holder.__aenter__()
    entered = asyncio.Event()

    async def waiter() -> float:
        async with wait(b):
            entered.set()
            return time.monotonic()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.2)  # queued by now (a test of the wake, not of the queueing)
    assert not entered.is_set(), f"{kind}: entered while held"
    released = time.monotonic()
    await holder.__aexit__(None, None, None)
    woke = await asyncio.wait_for(task, WAKE_BOUND)
    assert woke - released < WAKE_BOUND, f"{kind}: woken after {woke - released:.2f} s"
    checks += 1
    # A timeout while held.
    holder = hold(a)
    await holder.__aenter__()
    try:
        started = time.monotonic()
        try:
            await _with_timeout(wait(b), 0.3)
        except (LockTimeout, TimeoutError):
            pass
        else:
            raise AssertionError(f"{kind}: entered while held")
        assert time.monotonic() - started < 2.0, f"{kind}: the timeout overran"
        checks += 1
        # Cancelled while queued: the queue entry goes, the next waiter is not stuck.
        cancelled = asyncio.create_task(_with_timeout(wait(b), 10))
        await asyncio.sleep(0.2)
        cancelled.cancel()
        with suppress(asyncio.CancelledError):
            await cancelled
        checks += 1
    finally:
        await holder.__aexit__(None, None, None)
    await _with_timeout(wait(b), WAKE_BOUND)  # free again, nothing left queued ahead
    checks += 1
    # Lease loss: the body is cancelled and LockLost raised from `async with`.
    if kind in ("mutex", "semaphore"):
        lock = RedisMutex(a, f"smoke-{tag}-lost", ttl=TTL)
        if kind == "semaphore":
            lock = RedisSemaphore(a, f"smoke-{tag}-lost-s", limit=1, ttl=TTL)  # type: ignore[assignment]
        try:
            async with lock:
                await expire_lease(lock)
                await asyncio.sleep(5)
        except LockLost:
            checks += 1
        else:
            raise AssertionError(f"{kind}: no LockLost")
    return checks


async def _registry(a: Any, b: Any, tag: str) -> int:
    ids = await RedisRegistry(a, f"smoke-{tag}-ids").register_many(["x", "y"])
    assert ids == [1, 2], ids
    assert await RedisRegistry(b, f"smoke-{tag}-ids").id_of("y") == 2
    return 1


async def _ratelimit(a: Any, b: Any, tag: str) -> int:
    """The rate limiter's scripts on this server and client: a burst, a refusal that
    reserves nothing, a wait for the next slot, and a wrong-type key's error text."""
    name = f"smoke-{tag}-rate"
    first, second = (RedisRateLimiter(c, name, rate=10, burst=2) for c in (a, b))
    # Timed from before the burst: the third slot is 100 ms after the first grant, however
    # long a loaded machine takes between the burst and the wait.
    started = time.monotonic()
    assert await first.acquire(blocking=False) and await first.acquire(blocking=False)
    assert not await second.acquire(blocking=False)
    assert await second.acquire(timeout=1.0)
    assert time.monotonic() - started >= 0.09  # waited for the slot 100 ms after the first
    wrong = f"smoke-{tag}-rate-wrong"
    key = f"aiolocks:ratelimit:{{{wrong}}}:state"
    await a.hset(key, "x", "1")
    try:
        await RedisRateLimiter(a, wrong, rate=1).acquire()
    except ServerUnavailable as exc:
        assert f"{key} holds a hash, not a string" in str(exc), str(exc)
    else:
        raise AssertionError("a wrong-type key was taken for a rate limiter's state")
    await a.delete(key)
    return 1


async def _error_text(client: Any, cell: str) -> int:
    """A key of another type under the lock's name: the error names the key and the type
    (on every server version; before Redis 7.0 the server cannot format a Lua error table)."""
    prefix = f"smokewrong-{cell}"  # not the CLI's prefix: its listing must not meet it
    key = f"{prefix}:mutex:{{x}}:owner"
    try:
        await client.rpush(key, "not a lock")
        try:
            await RedisMutex(client, "x", prefix=prefix).acquire(blocking=False)
        except ServerUnavailable as exc:
            assert f"{key} holds a list, not a string" in str(exc), str(exc)
        else:
            raise AssertionError("a wrong-type key was taken for a lock")
        await client.delete(key)
    finally:
        await client.aclose()
    return 1


def _cli(url: str, cell: str) -> int:
    for command in (["inspect", f"smoke-{cell}-one-mutex", "--kind", "mutex"], ["list"]):
        done = subprocess.run(
            [sys.executable, "-m", "aiolocks", *command, "--url", url, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    return 2


@asynccontextmanager
async def _clients(make: Callable[[], Any]) -> AsyncIterator[tuple[Any, Any]]:
    a, b = make(), make()
    try:
        yield a, b
    finally:
        for client in (a, b):
            await client.aclose()


async def _cell(args: argparse.Namespace) -> dict[str, Any]:
    # The client library's asyncio clients: (module, single-server class, Cluster class).
    module, single_name, cluster_name = {
        "redis": ("redis.asyncio", "Redis", "RedisCluster"),
        "valkey": ("valkey.asyncio", "Valkey", "ValkeyCluster"),
    }[args.client]
    lib = importlib.import_module(module)
    single: Callable[[str], Any] = getattr(lib, single_name).from_url
    cluster: Callable[[str], Any] = getattr(lib, cluster_name).from_url
    checks = 0
    direct: list[bool] = []
    targets: list[tuple[str, Callable[[], Any]]] = [("one", lambda: single(args.url))]
    if args.cluster:
        targets.append(("cluster", lambda: cluster(args.cluster)))
    checks += await _error_text(single(args.url), args.cell)
    for where, make in targets:
        tag = f"{args.cell}-{where}"
        async with _clients(make) as (a, b):
            for kind in KINDS:
                checks += await _primitive(kind, a, b, tag)
            checks += await _registry(a, b, tag)
            checks += await _ratelimit(a, b, tag)
            pipe = context_for(a).autopipe
            if pipe is not None and pipe._link is not None:
                direct.append(pipe._link.parser is not None)
    if args.direct != "any":
        assert direct and all(direct) == (args.direct == "yes"), f"direct reads: {direct}"
    checks += await asyncio.to_thread(_cli, args.url, args.cell)
    return {"checks": checks, "direct": direct}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--cluster")
    parser.add_argument("--client", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--direct", choices=("yes", "no", "any"), default="any")
    # Names this cell's keys: cells may share servers.
    parser.add_argument("--cell", default="cell")
    args = parser.parse_args()
    run: Callable[[Awaitable[dict[str, Any]]], dict[str, Any]] = asyncio.run  # type: ignore[assignment]
    if args.loop == "uvloop":
        import uvloop

        run = uvloop.run  # type: ignore[assignment]
    result = run(_cell(args))
    import redis

    try:
        import hiredis

        hiredis_version: str | None = hiredis.__version__
    except ImportError:
        hiredis_version = None
    library = importlib.import_module(args.client)
    imported = {
        "client": f"{args.client} {library.__version__}",
        "redis": redis.__version__,
        "hiredis": hiredis_version,
        "valkey": _importable("valkey"),
        "loop": args.loop,
    }
    print(json.dumps({**imported, **result}))


if __name__ == "__main__":
    main()
