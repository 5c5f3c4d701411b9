"""The measured bodies of the peer benchmark, shared by the parent and its worker processes.

Each function runs one workload against one opened `Peer` and returns raw observations
(timestamps on the system-wide monotonic clock, so records of different processes on the
same machine can be merged); `bench_peers.py` turns them into figures.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio
from _harness import CommandLog, is_setup, server_calls
from _peers import Peer

NAME = "bench:lock"
COUNTER = "bench:counter"

Body = Callable[[int], Coroutine[Any, Any, None]]


async def run_workers(peer: Peer, count: int, body: Body) -> list[str]:
    """Run `body(0..count-1)` at once: as tasks, or as threads with a loop each for a
    blocking peer. Returns the workers' exceptions, as text."""
    if not peer.threaded:
        outcomes = await asyncio.gather(*(body(i) for i in range(count)), return_exceptions=True)
        return [repr(outcome) for outcome in outcomes if isinstance(outcome, BaseException)]
    errors: list[str] = []
    barrier = threading.Barrier(count)

    def thread_main(index: int) -> None:
        try:
            barrier.wait(timeout=60)
            asyncio.run(body(index))
        except BaseException as exc:  # reported, like a task's exception
            errors.append(repr(exc))

    threads = [threading.Thread(target=thread_main, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()

    def join_all() -> None:
        for thread in threads:
            thread.join()

    await asyncio.to_thread(join_all)
    return errors


# ------------------------------------------------------------------- 1-3: acquire loops


async def contend(
    peer: Peer, *, tasks: int, iterations: int, critical: bool, cap: float, prefix: str = ""
) -> dict[str, Any]:
    """`tasks` workers x `iterations` of acquire -> (GET, SET+1 if `critical`) -> release.

    records: [acquired_at, wait_s, hold_s, release_s, worker], one per acquisition.
    """
    locks = [peer.lock(NAME) for _ in range(tasks)]
    records: list[tuple[float, float, float, float, str]] = []
    increments: list[int] = []
    timeouts: list[int] = []
    truncated: list[int] = []
    deadline = time.monotonic() + cap

    async def body(index: int) -> None:
        lock = locks[index]
        for _ in range(iterations):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                truncated.append(index)
                return
            t0 = time.perf_counter()
            acquired = await lock.acquire(remaining)
            t1 = time.perf_counter()
            if not acquired:
                timeouts.append(index)
                return
            at = time.monotonic()
            try:
                if critical:
                    value = await peer.get(COUNTER)
                    await peer.set(COUNTER, int(value or 0) + 1)
                    increments.append(index)
            finally:
                t2 = time.perf_counter()
                await lock.release()
                records.append((at, t1 - t0, t2 - t1, time.perf_counter() - t2, f"{prefix}{index}"))

    started = time.monotonic()
    cpu = time.process_time()  # this process, every thread
    errors = await run_workers(peer, tasks, body)
    return {
        "cpu_s": time.process_time() - cpu,
        "records": records,
        "increments": len(increments),
        "timeouts": len(timeouts),
        "truncated": bool(truncated),
        "errors": errors,
        "started": started,
        "ended": time.monotonic(),
    }


# ---------------------------------------------------------------------- 4: waiting cost


async def settle(log: CommandLog, at_most: float, quiet_for: float = 0.5) -> float:
    """Wait until the client has sent nothing for `quiet_for` s (every waiter is parked),
    or `at_most` s for clients that never go quiet (pollers). Watches a local counter."""
    started = time.monotonic()
    last, since = log.mark(), started
    while time.monotonic() - started < at_most:
        await asyncio.sleep(0.05)
        now, mark = time.monotonic(), log.mark()
        if mark != last:
            last, since = mark, now
        elif now - since >= quiet_for:
            break
    return round(time.monotonic() - started, 3)


async def server_cpu(admin: redis.asyncio.Redis) -> float:
    """CPU seconds (user + system) the server has used so far."""
    info: dict[str, Any] = await admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def info_snapshot(admin: redis.asyncio.Redis) -> dict[str, Any]:
    """Server counters the scale and waiting workloads compare (INFO is never counted)."""
    info: dict[str, Any] = await admin.info()
    calls, usec = await server_calls(admin)
    return {
        "at": time.monotonic(),
        "calls": calls,
        "usec": usec,
        "connections_received": int(info["total_connections_received"]),
        "connected_clients": int(info["connected_clients"]),
        "used_memory": int(info["used_memory"]),
    }


async def observe(
    log: CommandLog, admin: redis.asyncio.Redis, window: float
) -> tuple[list[int], list[dict[str, Any]]]:
    """Client marks and server snapshots at the start, middle and end of `window` s."""
    marks = [log.mark()]
    snapshots = [await info_snapshot(admin)]
    for _ in range(2):
        await asyncio.sleep(window / 2)
        marks.append(log.mark())
        snapshots.append(await info_snapshot(admin))
    return marks, snapshots


def server_commands(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Commands the server ran between two snapshots (INFO and connection set-up left out)."""
    return sum(
        calls - before["calls"].get(name, 0)
        for name, calls in after["calls"].items()
        if name != "info" and not is_setup(name)
    )


def lock_commands(counter: Counter[str]) -> int:
    """Client-side commands that are not connection set-up."""
    return sum(n for name, n in counter.items() if not is_setup(name))


async def waiting_cost(
    peer: Peer,
    holder: Peer,
    admin: redis.asyncio.Redis,
    *,
    waiters: int,
    window: float,
    settle_s: float,
    cap: float,
) -> dict[str, Any]:
    """`waiters` workers wait on a lock `holder` holds; commands over a `window` of waiting
    (in two halves), then the holder lets go and the waiters drain."""
    held = holder.lock(NAME)
    if not await held.acquire(5.0):
        return {"error": "the holder could not take the lock"}
    locks = [peer.lock(NAME) for _ in range(waiters)]
    served: list[int] = []
    deadline = time.monotonic() + settle_s + window + cap

    async def body(index: int) -> None:
        if await locks[index].acquire(max(0.0, deadline - time.monotonic())):
            served.append(index)
            await locks[index].release()

    start_mark = peer.log.mark()
    start = await info_snapshot(admin)
    runner = asyncio.ensure_future(run_workers(peer, waiters, body))
    settled = await settle(peer.log, settle_s)
    marks, snapshots = await observe(peer.log, admin, window)
    released = time.monotonic()
    await held.release()
    errors = await runner
    drained = time.monotonic() - released

    def client(a: int, b: int) -> int:
        return lock_commands(peer.log.commands_since(marks[a], marks[b]))

    whole = lock_commands(peer.log.commands_since(start_mark, marks[2]))
    halves = [client(0, 1), client(1, 2)]
    server_halves = [server_commands(snapshots[i], snapshots[i + 1]) for i in range(2)]
    return {
        "waiters": waiters,
        "settled_s": settled,
        "window_s": round(snapshots[2]["at"] - snapshots[0]["at"], 3),
        "client_commands_in_window": sum(halves),
        "client_commands_by_half": halves,
        "server_commands_in_window": sum(server_halves),
        "server_commands_by_half": server_halves,
        "client_commands_whole_wait": whole,
        "client_commands_per_waiter_whole_wait": round(whole / waiters, 3),
        "client_commands_per_waiter_in_window": round(sum(halves) / waiters, 3),
        "server_commands_per_waiter_in_window": round(sum(server_halves) / waiters, 3),
        "client_by_command_in_window": dict(
            peer.log.commands_since(marks[0], marks[2]).most_common()
        ),
        "connections_opened": snapshots[1]["connections_received"] - start["connections_received"],
        "connected_clients_added": snapshots[1]["connected_clients"] - start["connected_clients"],
        "served": len(served),
        "drain_s": round(drained, 3),
        "errors": sorted(set(errors))[:3],
        "error_count": len(errors),
    }


# --------------------------------------------------------------------- 5: hand-off


class Baton(Protocol):
    """How two contenders tell each other 'I hold it now', outside Redis."""

    async def send(self) -> None: ...

    async def recv(self, timeout: float) -> None: ...


class PipeBaton:
    """One byte over a pair of OS pipes between two worker processes."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._read_fd = read_fd
        self._write_fd = write_fd

    async def send(self) -> None:
        os.write(self._write_fd, b"h")

    async def recv(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        data = await asyncio.wait_for(
            loop.run_in_executor(None, os.read, self._read_fd, 1), timeout
        )
        if not data:
            raise ConnectionError("the other contender has gone")


class QueueBaton:
    """The same between two tasks of one process (the floor's hand-off)."""

    def __init__(self, inbox: asyncio.Queue[None], outbox: asyncio.Queue[None]) -> None:
        self._inbox = inbox
        self._outbox = outbox

    async def send(self) -> None:
        self._outbox.put_nowait(None)

    async def recv(self, timeout: float) -> None:
        await asyncio.wait_for(self._inbox.get(), timeout)


async def handoff(
    peer: Peer, *, me: int, rounds: int, baton: Baton, hold: tuple[float, float], cap: float
) -> list[tuple[int, float, float]]:
    """Two contenders (me = 0 or 1) take turns: round k is held by contender k % 2, whose
    acquire() was called while the other held round k-1. Returns (k, acquired, released)."""
    lock = peer.lock(NAME)
    rng = random.Random(me)
    out: list[tuple[int, float, float]] = []
    deadline = time.monotonic() + cap
    for k in range(rounds):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if k % 2 != me:
            await baton.recv(remaining)  # the other holds round k: ask for k + 1 now
            continue
        if not await lock.acquire(remaining):
            break
        acquired = time.monotonic()
        await baton.send()
        # Hold long enough that the other's acquire() is surely waiting when we let go.
        await asyncio.sleep(rng.uniform(*hold))
        await lock.release()
        out.append((k, acquired, time.monotonic()))
    return out


async def run_handoff_in_thread_or_task(
    peer: Peer, **kwargs: Any
) -> list[tuple[int, float, float]]:
    """`handoff` as the peer's only worker (a thread for a blocking peer)."""
    result: list[list[tuple[int, float, float]]] = []

    async def body(_index: int) -> None:
        result.append(await handoff(peer, **kwargs))

    errors = await run_workers(peer, 1, body)
    if errors:
        raise RuntimeError(errors[0])
    return result[0]


# ---------------------------------------------------------------------- 7: scale


def rss_bytes() -> int:
    """Resident set size of this process now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


async def scale(
    peer: Peer,
    admin: redis.asyncio.Redis,
    *,
    waiters: int,
    names: int,
    settle_s: float,
    window: float,
    cap: float,
) -> dict[str, Any]:
    """`waiters` tasks over `names` names: the first per name holds until every name is
    held; the rest wait. Measures the waiting state, then the time to drain everything."""
    rss_before = rss_bytes()
    start = await info_snapshot(admin)
    piled = asyncio.Event()
    drain = asyncio.Event()
    holding: list[int] = []
    served: list[int] = []
    timeouts: list[int] = []
    deadline = time.monotonic() + cap

    tried: list[int] = []  # tasks whose acquire() returned or raised
    all_tried = asyncio.Event()

    async def body(index: int) -> None:
        lock = peer.lock(f"bench:scale:{index % names}")
        try:
            acquired = await lock.acquire(max(0.0, deadline - time.monotonic()))
        finally:
            tried.append(index)
            if len(tried) == waiters:
                all_tried.set()
        if not acquired:
            timeouts.append(index)
            return
        try:
            if not drain.is_set():  # one of the first holders: wait for every name to be held
                holding.append(index)
                if len(holding) == names:
                    piled.set()
                await drain.wait()
        finally:
            await lock.release()
        served.append(index)

    started = time.monotonic()
    runner = asyncio.ensure_future(run_workers(peer, waiters, body))
    result: dict[str, Any] = {"waiters": waiters, "names": names}
    # Until every name is held, or no task is still asking (errors, timeouts), or the cap.
    pile_up = asyncio.ensure_future(piled.wait())
    stuck = asyncio.ensure_future(all_tried.wait())
    left = max(0.0, deadline - time.monotonic())
    await asyncio.wait({pile_up, stuck}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    pile_up.cancel()
    stuck.cancel()
    if piled.is_set():
        result["pile_up_s"] = round(time.monotonic() - started, 3)
    else:
        result["capped"] = f"only {len(holding)} of {names} names held"
    result["settled_s"] = await settle(peer.log, settle_s)
    marks, snapshots = await observe(peer.log, admin, window)
    rss_waiting = rss_bytes()
    released = time.monotonic()
    drain.set()
    try:
        errors = await asyncio.wait_for(runner, max(1.0, deadline - time.monotonic()))
        result["drain_s"] = round(time.monotonic() - released, 3)
    except TimeoutError:
        errors = []
        result["capped"] = f"drain not done within the cap ({len(served)} of {waiters} served)"
    halves = [lock_commands(peer.log.commands_since(marks[i], marks[i + 1])) for i in range(2)]
    result.update(
        {
            "served": len(served),
            "timeouts": len(timeouts),
            "error_count": len(errors),
            "errors": sorted(set(errors))[:3],
            "connections_opened": snapshots[0]["connections_received"]
            - start["connections_received"],
            "connected_clients_added": snapshots[0]["connected_clients"]
            - start["connected_clients"],
            "client_connections_made": peer.log.connections_made,
            "rss_added_mb": round((rss_waiting - rss_before) / 2**20, 1),
            "rss_per_waiter_kb": round((rss_waiting - rss_before) / waiters / 1024, 2),
            "server_memory_added_mb": round(
                (snapshots[0]["used_memory"] - start["used_memory"]) / 2**20, 2
            ),
            "window_s": round(snapshots[2]["at"] - snapshots[0]["at"], 3),
            "client_commands_by_half": halves,
            "client_by_command_by_half": [
                dict(peer.log.commands_since(marks[i], marks[i + 1]).most_common(6))
                for i in range(2)
            ],
            "server_commands_by_half": [
                server_commands(snapshots[i], snapshots[i + 1]) for i in range(2)
            ],
        }
    )
    return result
