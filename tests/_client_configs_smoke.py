"""Every primitive on every client configuration teams use, on one client library release:
run as a process of its own by tests/test_client_configs.py (one per release of the
compatibility matrix), or imported by it for the installed release.

In each configuration two clients made with it (a holder and a waiter) run the mutex, the
semaphore, the RW lock and the election side by side: each waits (woken by the release's
message: the lease is 60 s, so a wake left to the timer fails the bound), and the server's
`INFO commandstats` is read across a window longer than the client's socket_timeout and
health-check interval, in which the waiting must send no command; a wait on a fresh name
after that idle window times out, is cancelled while queued and is woken; a lease is lost
(LockLost out of `async with`); and the user's own commands on the same clients still run.
Then a program that cancels a queued waiter and returns from `main` must leave no queue
entry behind (auto-pipelining on and off). Prints one JSON line; exits 0 even when a
configuration fails (the test reads which).

The configurations run side by side, so the matrix costs about one configuration's time: the
idle window is one for all of them (`_Window`: it opens once every configuration's waiters are
queued), and a window in which the server ran any command is measured again for each
configuration alone, so that a failure names its configuration.

    python tests/_client_configs_smoke.py URL UNIX_SOCKET_PATH [--client valkey]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import random
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any

from _compat_smoke import _sides

from aiolocks import LockLost, LockTimeout, RedisMutex
from aiolocks.testing import expire_lease

TTL = 60.0  # renewals and heartbeats every 20 s: none falls into a window
WAKE_BOUND = 3.0  # a grant message arrives in milliseconds; the timer fallback is 60 s
QUEUED_BOUND = 10.0  # every waiter queued by then, on a loaded machine
MIN_WINDOW = 2.5  # longer than socket_timeout=1 and health_check_interval=1
KINDS = ("mutex", "semaphore", "rwlock", "election")


def configurations(library: str, url: str, unix: str) -> dict[str, Callable[[], Any]]:
    """Each configuration's client factory (a fresh client per call)."""
    lib = importlib.import_module(f"{library}.asyncio")
    retry_module = importlib.import_module(f"{library}.asyncio.retry")
    backoff = importlib.import_module(f"{library}.backoff")
    cls: Any = getattr(lib, "Valkey" if library == "valkey" else "Redis")

    def blocking() -> Any:
        pool = lib.BlockingConnectionPool.from_url(url, max_connections=2, timeout=5)
        return cls(connection_pool=pool)

    return {
        "default": lambda: cls.from_url(url),
        "decode_responses": lambda: cls.from_url(url, decode_responses=True),
        "protocol=3": lambda: cls.from_url(url, protocol=3),
        "unix socket": lambda: cls.from_url(f"unix://{unix}"),
        "BlockingConnectionPool(2)": blocking,
        "single_connection_client": lambda: cls.from_url(url, single_connection_client=True),
        "health_check_interval=1": lambda: cls.from_url(url, health_check_interval=1),
        "socket_timeout=1": lambda: cls.from_url(url, socket_timeout=1),
        "Retry": lambda: cls.from_url(
            url, retry=retry_module.Retry(backoff.ExponentialBackoff(cap=0.5), 3)
        ),
        "max_connections=1": lambda: cls.from_url(url, max_connections=1),
        "max_connections=2": lambda: cls.from_url(url, max_connections=2),
        "max_connections=3": lambda: cls.from_url(url, max_connections=3),
        "client_name": lambda: cls.from_url(url, client_name="aiolocks-matrix"),
    }


def _read_timeout(client: Any) -> float | None:
    """The socket_timeout the client's connections read with (valkey-py's default is 5 s)."""
    pool = client.connection_pool
    timeout: float | None = pool.connection_class(**pool.connection_kwargs).socket_timeout
    return timeout


async def _commands(admin: Any) -> int:
    """Commands the server has run so far, but INFO (this count's own)."""
    stats = await admin.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


class _Queued:
    """Counts the waiters queued, from the keyspace events on queue keys (no polling)."""

    def __init__(self, admin: Any, prefix: str) -> None:
        self.pubsub = admin.pubsub()
        self.pattern = f"__keyspace@0__:aiolocks:*{{{prefix}*:queue"
        self.keys: set[Any] = set()

    async def __aenter__(self) -> _Queued:
        await self.pubsub.psubscribe(self.pattern)
        return self

    async def until(self, count: int) -> None:
        async with asyncio.timeout(QUEUED_BOUND):
            while len(self.keys) < count:
                message = await self.pubsub.get_message(timeout=None)
                if message is not None and message["type"] == "pmessage":
                    self.keys.add(message["channel"])

    async def __aexit__(self, *exc: object) -> None:
        await self.pubsub.aclose()


class _Window:
    """One idle window shared by the configurations running side by side: it opens when every
    one of them has arrived (or dropped out) and counts the server's commands across it."""

    def __init__(self, admin: Any, parties: int) -> None:
        self.admin = admin
        self.missing = parties
        self.length = 0.0
        self.everyone = asyncio.Event()
        self.measured: asyncio.Task[int] | None = None

    def _count_in(self) -> None:
        self.missing -= 1
        if self.missing == 0:
            self.measured = asyncio.create_task(self._measure())
            self.everyone.set()

    async def _measure(self) -> int:
        await asyncio.sleep(0.2)  # the queueing calls' replies read (nothing is sent after)
        before = await _commands(self.admin)
        await asyncio.sleep(self.length)  # the measured window, not a wait for anything
        return await _commands(self.admin) - before

    async def commands_across(self, length: float) -> int:
        """Arrive with waiters queued; the commands the server ran across the window."""
        self.length = max(self.length, length)
        self._count_in()
        await self.everyone.wait()
        assert self.measured is not None
        return await asyncio.shield(self.measured)

    def drop_out(self) -> None:
        """A configuration that failed before its window: the others do not wait for it."""
        self._count_in()


async def _enter(side: AbstractAsyncContextManager[Any], entered: asyncio.Event) -> float:
    async with side:
        entered.set()
        return time.monotonic()


async def _configuration(
    make: Callable[[], Any], admin: Any, tag: str, window_gate: _Window
) -> dict[str, Any]:
    a, b = make(), make()
    report: dict[str, Any] = {"ok": False, "commands_while_waiting": None}
    started = time.monotonic()
    arrived = False
    try:
        window = max(MIN_WINDOW, (_read_timeout(b) or 0.0) + 1.0)
        report["window"] = window
        first = {kind: _sides(kind, f"{tag}-{kind}-1", TTL) for kind in KINDS}
        fresh = {kind: _sides(kind, f"{tag}-{kind}-2", TTL) for kind in KINDS}
        holders = {kind: first[kind][0](a) for kind in KINDS}
        for holder in holders.values():
            await holder.__aenter__()
        # 1. Every primitive waits on b; once all are queued, the window: no command.
        entered = {kind: asyncio.Event() for kind in KINDS}
        async with _Queued(admin, f"{tag}-") as queued:
            waiters = {
                kind: asyncio.create_task(_enter(first[kind][1](b), entered[kind]))
                for kind in KINDS
            }
            await queued.until(len(KINDS))
        arrived = True
        report["commands_while_waiting"] = await window_gate.commands_across(window)
        assert not any(event.is_set() for event in entered.values()), "entered while held"
        # 2. A fresh name, subscribed to after the idle window: times out.
        fresh_holders = {kind: fresh[kind][0](a) for kind in KINDS}
        for holder in fresh_holders.values():
            await holder.__aenter__()

        async def times_out(kind: str) -> None:
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(0.5), fresh[kind][1](b):
                    raise AssertionError(f"{kind}: entered while held")
            except (LockTimeout, TimeoutError):
                pass
            assert time.monotonic() - t0 < 2.5, f"{kind}: the timeout overran"

        await asyncio.gather(*(times_out(kind) for kind in KINDS))
        # 3. Cancelled while queued; then a waiter queued behind is woken by the release.
        cancelled = [
            asyncio.create_task(_enter(fresh[kind][1](b), asyncio.Event())) for kind in KINDS
        ]
        await asyncio.sleep(0.3)
        for task in cancelled:
            task.cancel()
        for task in cancelled:
            with suppress(asyncio.CancelledError):
                await task
        fresh_entered = {kind: asyncio.Event() for kind in KINDS}
        fresh_waiters = {
            kind: asyncio.create_task(_enter(fresh[kind][1](b), fresh_entered[kind]))
            for kind in KINDS
        }
        await asyncio.sleep(0.3)
        # 4. The releases wake every waiter, by message.
        for kind in KINDS:
            released = time.monotonic()
            await holders[kind].__aexit__(None, None, None)
            woke = await asyncio.wait_for(waiters[kind], WAKE_BOUND)
            assert woke - released < WAKE_BOUND, f"{kind}: woken after {woke - released:.2f} s"
            released = time.monotonic()
            await fresh_holders[kind].__aexit__(None, None, None)
            woke = await asyncio.wait_for(fresh_waiters[kind], WAKE_BOUND)
            assert woke - released < WAKE_BOUND, f"{kind} (fresh name): woken late"
        # 5. A lost lease: LockLost out of `async with`.
        for kind in KINDS:
            side = _sides(kind, f"{tag}-{kind}-3", TTL)[0](a)
            try:
                async with side as held:
                    target: Any = held if kind == "election" else side
                    await expire_lease(target)
                    await asyncio.sleep(5)
            except LockLost:
                pass
            else:
                raise AssertionError(f"{kind}: no LockLost")
        # 6. The user's own commands on the same clients.
        await a.set(f"{tag}-user", "1")
        assert await b.get(f"{tag}-user") in (b"1", "1")
        report["ok"] = True
    except BaseException as exc:
        if not arrived:
            window_gate.drop_out()
        report["error"] = "".join(traceback.format_exception_only(exc)).strip()[-600:]
        report["trace"] = traceback.format_exc()[-3000:]
    finally:
        for client in (a, b):
            for context in list(getattr(client, "_aiolocks_contexts", {}).values()):
                with suppress(Exception):
                    await asyncio.wait_for(context.aclose(), 10)
            with suppress(Exception):
                await client.aclose()
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


# A program that queues a waiter, cancels it and returns from main at once.
_EXIT_PROGRAM = """
import asyncio, importlib, sys
from aiolocks import RedisMutex
library, url, name = sys.argv[1:4]
lib = importlib.import_module(library + ".asyncio")
cls = getattr(lib, "Valkey" if library == "valkey" else "Redis")

async def main():
    client, admin = cls.from_url(url), cls.from_url(url)
    pubsub = admin.pubsub()
    await pubsub.psubscribe("__keyspace@0__:aiolocks:*{" + name + "}:queue")
    task = asyncio.create_task(RedisMutex(client, name).acquire())
    async with asyncio.timeout(10):
        while (await pubsub.get_message(timeout=None) or {}).get("type") != "pmessage":
            pass
    await pubsub.aclose()
    await admin.aclose()
    task.cancel()

asyncio.run(main())
"""


async def _exits(library: str, url: str, make: Callable[[], Any]) -> dict[str, Any]:
    """The clean exit after a cancellation, auto-pipelining on and off."""
    a = make()

    async def exit_with(autopipe: str) -> dict[str, Any]:
        name = f"exit-{autopipe}-{os.getpid()}"
        holder = RedisMutex(a, name, ttl=TTL)
        await holder.acquire()
        env = {**os.environ, "AIOLOCKS_AUTOPIPELINE": autopipe}
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", _EXIT_PROGRAM, library, url, name],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        left = (await holder.inspect()).queue_length
        await holder.release()
        return {
            "ok": done.returncode == 0 and left == 0 and not done.stderr.strip(),
            "queue_left": left,
            "stderr": done.stderr[-1500:],
        }

    try:
        on, off = await asyncio.gather(exit_with("1"), exit_with("0"))
    finally:
        await a.aclose()
    return {"autopipe=1": on, "autopipe=0": off}


KILL_SECONDS = 6.0  # 1-6 errors per ~900 waits on redis-py 5.0.8 and 7.4.1 before the fix
WAITERS = 8


async def _kill_race(library: str, url: str) -> dict[str, Any]:
    """Waiters on fresh names behind another client's holder, on a client with
    `socket_timeout`, while the pub/sub connection is killed every 10-120 ms (`CLIENT KILL
    TYPE pubsub`): each wait times out, never ends in an error of the client's."""
    lib = importlib.import_module(f"{library}.asyncio")
    cls: Any = getattr(lib, "Valkey" if library == "valkey" else "Redis")
    holder_client, client = cls.from_url(url), cls.from_url(url, socket_timeout=1)
    admin = cls.from_url(url)
    errors: list[str] = []
    waits = 0
    done = asyncio.Event()
    rng = random.Random(7)

    async def killer() -> None:
        while not done.is_set():
            with suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(done.wait(), rng.uniform(0.01, 0.12))  # a kill's pace
            with suppress(Exception):
                await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")

    async def waiter(index: int) -> None:
        nonlocal waits
        round_ = 0
        while not done.is_set():
            round_ += 1
            name = f"kill-{os.getpid()}-{index}-{round_}"
            holder = RedisMutex(holder_client, name, ttl=TTL)
            await holder.acquire()
            try:
                if await RedisMutex(client, name, ttl=TTL).acquire(timeout=0.05):
                    errors.append(f"{name}: acquired behind a holder")
                waits += 1
            except Exception as exc:  # what the fix must leave out of acquire()
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                await holder.release()

    kills = asyncio.create_task(killer())
    tasks = [asyncio.create_task(waiter(index)) for index in range(WAITERS)]
    await asyncio.sleep(KILL_SECONDS)  # the probe's length, not a wait for anything
    done.set()
    await asyncio.gather(kills, *tasks)
    for each in (holder_client, client, admin):
        await each.aclose()
    return {"ok": not errors and waits > 0, "waits": waits, "errors": errors[:10]}


DROPPED = 10  # clients made, used (a holding, a wait woken by message) and dropped


async def _dropped(library: str, url: str) -> dict[str, Any]:
    """Clients used and dropped without `aclose()`: each is collected, and its engine's
    connections (the pipeline's link, pub/sub) are closed with it."""
    lib = importlib.import_module(f"{library}.asyncio")
    cls: Any = getattr(lib, "Valkey" if library == "valkey" else "Redis")
    admin = cls.from_url(url)
    tag = f"aiolocks-dropped-{os.getpid()}"
    collected = 0

    def gone() -> None:
        nonlocal collected
        collected += 1

    async def use(index: int) -> None:
        client = cls.from_url(url, client_name=tag)
        weakref.finalize(client, gone)
        holder, waiter = RedisMutex(admin, f"{tag}-{index}"), RedisMutex(client, f"{tag}-{index}")
        await holder.acquire()
        waiting = asyncio.create_task(waiter.acquire(timeout=WAKE_BOUND))
        await asyncio.sleep(0.2)  # queued and subscribed (the release wakes it either way)
        await holder.release()
        assert await waiting
        await waiter.release()

    async def settled() -> None:
        """Every task but this one done (the engines' idle keepers end, the finalizers'
        closes run), within a bound."""
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=QUEUED_BOUND)

    try:
        for index in range(DROPPED):
            await use(index)
        await settled()  # the idle lease keepers end (they hold their engine until then)
        gc.collect()  # the clients' cycles; their engines' loop-end finalizers are scheduled
        await settled()
        left = [c for c in await admin.client_list() if c.get("name") == tag]
    finally:
        await admin.aclose()
    return {"ok": collected == DROPPED and not left, "collected": collected, "left": len(left)}


CLOSED_TTL = 2.0  # the holding's lease: lost by its validity's end at the latest
CLOSED_BOUND = 1.0  # the waiter's error after the close (at once; a timeout would be 8 s)


async def _closed(library: str, url: str) -> dict[str, Any]:
    """A client closed (`aclose()`) while a task holds a lock and another task of the same
    client waits on it: the wait ends at once with ClientClosed, the holding is reported
    lost by its validity's end, the engine opens no connection after the close (the
    server's count of connections received), and none of the client's stays open."""
    lib = importlib.import_module(f"{library}.asyncio")
    cls: Any = getattr(lib, "Valkey" if library == "valkey" else "Redis")
    admin = cls.from_url(url)
    tag = f"aiolocks-closed-{os.getpid()}"
    client = cls.from_url(url, client_name=tag)
    # (strict FIFO: the waiter queued on the server, as another process's would be)
    holder = RedisMutex(client, tag, ttl=CLOSED_TTL, local_handoff=0)
    waiter = RedisMutex(client, tag, ttl=CLOSED_TTL, local_handoff=0)

    async def received() -> int:
        return int((await admin.info("stats"))["total_connections_received"])

    async def wait() -> tuple[str, float]:
        try:
            outcome = repr(await waiter.acquire(timeout=4 * CLOSED_TTL))
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        return outcome, time.monotonic()

    try:
        await holder.acquire()
        async with _Queued(admin, tag) as queued:
            waiting = asyncio.create_task(wait())
            await queued.until(1)
        await asyncio.sleep(0.2)  # its queue call answered and its channel subscribed
        before = await received()
        closed_at = time.monotonic()
        await client.aclose()
        outcome, ended = await asyncio.wait_for(waiting, 8 * CLOSED_TTL)
        try:
            await asyncio.wait_for(holder.lost.wait(), CLOSED_TTL)
            lost: float | None = time.monotonic() - closed_at
        except TimeoutError:
            lost = None
        try:
            await holder.release()
            released = "released"
        except Exception as exc:  # LockLost: it was reported lost
            released = type(exc).__name__
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=QUEUED_BOUND)  # clean-ups and keepers end
        opened = await received() - before
        left = len([c for c in await admin.client_list() if c.get("name") == tag])
    finally:
        await admin.aclose()
    waited = ended - closed_at
    return {
        "ok": outcome.startswith("ClientClosed") and waited < CLOSED_BOUND and lost is not None
        and released == "LockLost" and opened == 0 and left == 0,
        "waiter": outcome, "waited": round(waited, 3), "lost_after": lost,
        "release": released, "opened_after_close": opened, "left": left,
    }  # fmt: skip


async def run(library: str, url: str, unix: str, only: list[str] | None = None) -> dict[str, Any]:
    lib = importlib.import_module(f"{library}.asyncio")
    admin: Any = getattr(lib, "Valkey" if library == "valkey" else "Redis").from_url(url)
    configs = configurations(library, url, unix)
    chosen = {
        name: (make, f"cfg{index}")
        for index, (name, make) in enumerate(configs.items())
        if only is None or name in only
    }
    try:
        shared = _Window(admin, len(chosen))
        reports = await asyncio.gather(
            *(_configuration(make, admin, tag, shared) for make, tag in chosen.values())
        )
        results = dict(zip(chosen, reports, strict=True))
        # A window with any command in it: each configuration measured alone, to name it.
        if any(report["commands_while_waiting"] for report in reports):
            for name, (make, tag) in chosen.items():
                alone = await _configuration(make, admin, f"{tag}a", _Window(admin, 1))
                results[name] = {**alone, "measured": "alone, after a shared window had commands"}
        exits = await _exits(library, url, configs["default"]) if only is None else {}
        kill_race = await _kill_race(library, url) if only is None else {}
        dropped = await _dropped(library, url) if only is None else {}
        closed = await _closed(library, url) if only is None else {}
    finally:
        await admin.aclose()
    return {
        "configs": results, "exits": exits, "kill_race": kill_race, "dropped": dropped,
        "closed": closed,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("unix")
    parser.add_argument("--client", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--only", action="append")
    args = parser.parse_args()
    result = asyncio.run(run(args.client, args.url, args.unix, args.only))
    library = importlib.import_module(args.client)
    print(json.dumps({"client": f"{args.client} {library.__version__}", **result}))


if __name__ == "__main__":
    main()
