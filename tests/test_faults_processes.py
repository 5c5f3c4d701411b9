"""SIGKILL of holder and waiter processes, at random, during a 4-process contended run over
a mutex, a semaphore and a read-write lock (worker: ``tests/workers/fault_worker.py``).

Every kill is replaced by a fresh process, so four keep contending. Afterwards: the
survivors finished, each primitive's history is sound and its counter exact for the work
done under it, no queue entry of a dead process outlived its last heartbeat (its liveness
deadline is at most ttl after the process died), and once the dead leases and entries
have run out nothing is left behind.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio
from _faultreport import record
from _faults import KINDS, audit
from _servers import ServerProcess
from _workers import Spawn, Worker

pytestmark = pytest.mark.faults

WORKER = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
PROCESSES = 4
KILLS = 10  # alternately a holder and a waiter
ITERATIONS = 15
TTL = 1.0
T = TypeVar("T")


@dataclass(frozen=True)
class Kill:
    at: float  # monotonic, once the process was gone
    wall_ms: float  # the same moment on the wall clock (the server's TIME clock)
    tag: str  # the client tag in its queue entries
    kind: str | None  # the primitive it held, for a holder


class Tracked:
    """A worker process and what it printed, with the monotonic time of each line."""

    def __init__(self, worker: Worker, changed: asyncio.Condition) -> None:
        self.worker = worker
        self.events: list[tuple[float, list[str]]] = []
        self.tag = ""
        self.reader = asyncio.create_task(self._read(changed))

    async def _read(self, changed: asyncio.Condition) -> None:
        stdout = self.worker.proc.stdout
        assert stdout is not None
        while raw := await stdout.readline():
            fields = raw.decode().split()
            if fields[:1] == ["tag"]:
                self.tag = fields[1]
            self.events.append((time.monotonic(), fields))
            async with changed:
                changed.notify_all()

    @property
    def last(self) -> str:
        return self.events[-1][1][0] if self.events else ""

    @property
    def alive(self) -> bool:
        return self.worker.proc.returncode is None


async def test_sigkill_of_holders_and_waiters_during_a_contended_run(
    valkey_notify: ServerProcess, spawn: Spawn
) -> None:
    rng = random.Random(20261122)
    name = "sigkill"
    admin = redis.asyncio.Redis.from_url(valkey_notify.url)
    await admin.flushall()
    changed = asyncio.Condition()
    tracked: list[Tracked] = []
    kills: list[Kill] = []

    async def start(index: int) -> None:
        args = (valkey_notify.url, name, index, ITERATIONS, TTL, 20)
        tracked.append(Tracked(await spawn(WORKER, *args), changed))

    async def wait_for(predicate: Callable[[], T], timeout: float = 20) -> T:
        # In this task, holding the condition: what the predicate saw is still true when
        # the caller acts on it (a wait_for task hop let a reader change it in between).
        async with asyncio.timeout(timeout), changed:
            return await changed.wait_for(predicate)

    def grants() -> int:
        return sum(1 for t in tracked for _, fields in t.events if fields[0] == "held")

    try:
        for index in range(PROCESSES):
            await start(index)
        for k in range(KILLS):
            # Let a few holdings happen, then pick a victim in the wanted state.
            goal = grants() + rng.randint(2, 5)

            def reached(goal: int = goal) -> bool:
                return grants() >= goal

            await wait_for(reached)
            want_holder = k % 2 == 0

            def victims(want_holder: bool = want_holder) -> list[Tracked]:
                return [
                    t
                    for t in tracked
                    if t.alive
                    and t.tag
                    and (t.last == "held") == want_holder
                    and t.last != "finished"
                ]

            # Chosen and signalled with no await in between, so it is in the wanted state.
            victim = rng.choice(await wait_for(victims))
            held = victim.events[-1][1][1] if want_holder else None
            victim.worker.kill()
            await victim.worker.proc.wait()
            kills.append(Kill(time.monotonic(), time.time() * 1000, victim.tag, held))
            await start(PROCESSES + k)

        survivors = [t for t in tracked if t.alive]
        for t in survivors:
            assert await asyncio.wait_for(t.worker.proc.wait(), 60) == 0, t.worker.stderr
            await t.reader
            assert t.last == "finished", t.events[-3:]

        # Queue entries left now belong to dead processes, and live ttl past death at most.
        problems: list[str] = []
        dead_tags = {kill.tag: kill.wall_ms for kill in kills}
        for kind in KINDS:
            key = f"aiolocks:{kind}:{{{name}-{kind}}}:waiters"
            waiters: list[Any] = await admin.zrange(key, 0, -1, withscores=True)
            for member, deadline in waiters:
                tag = member.decode().split(":")[2]
                if tag not in dead_tags:
                    problems.append(f"{kind}: queue entry {member!r} of a live process left")
                elif deadline > dead_tags[tag] + TTL * 1000 + 5:
                    problems.append(f"{kind}: {member!r} lives past its last heartbeat + ttl")
        found = await audit(
            admin, {kind: f"{name}-{kind}" for kind in KINDS}, settle_timeout=5 * TTL
        )
        problems += found.problems

        # Recovery after a holder died: until the next holding of that primitive began.
        recover: dict[int, float] = {}
        for number, kill in enumerate(kills):
            next_held = [
                at
                for t in tracked
                for at, fields in t.events
                if fields[:2] == ["held", kill.kind] and at > kill.at
            ]
            if kill.kind is not None and next_held:
                recover[number] = min(next_held) - kill.at
        mutex_recover = [t for n, t in recover.items() if kills[n].kind == "mutex"]
        record(
            "4 SIGKILL of holder/waiter processes",
            trials=len(kills),
            violations=len(problems),
            orphaned=found.orphaned,
            recover=list(recover.values()),
            note=f"{len(tracked)} processes, {found.holdings} holdings; after a mutex holder died "
            f"the next got in after {[round(t * 1000) for t in mutex_recover]} ms (ttl "
            f"{TTL:g} s; a semaphore or RW holder's death may leave another permit free); "
            f"settling took {statistics.median(found.settle_times) * 1000:.0f} ms median",
        )
        assert problems == []
        assert len(recover) == KILLS // 2
    finally:
        for t in tracked:
            t.worker.kill()
            t.reader.cancel()
        await asyncio.gather(*(t.reader for t in tracked), return_exceptions=True)
        await admin.aclose()
