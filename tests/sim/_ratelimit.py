"""The rate limiter under the simulation's faults: `ratelimit-faults` runs a few seeds of
2-4 processes taking permits of one `RedisRateLimiter` (blocking, with timeouts, tries,
random costs and cancellations) while the seed's faults hit them (latency, stalls,
resets, loop stalls, a crash, a restart), and checks each against the guarantee.

The oracle stands on the server and the simulator's clock: each reservation's reply gives
its slot on the server's clock (the loop's virtual time), and for every acquisition that
returned True, (1) the slots of all grants satisfy the limit (at most burst + rate x t /
per permits in any interval t) and (2) it returned no earlier than its slot. A restart of
the server without persistence forgets the state (a new burst may follow at once): windows
are counted on each side of a restart separately. At the end, nothing may be left (the
world's `settle`: no key after the idle window, no task, no timer).
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import random
from typing import Any

from aiolocks import RedisRateLimiter, ServerUnavailable

from ._loop import Proc
from ._net import EPOCH
from ._scenarios import SCENARIOS
from ._workload import Run, _close_loop
from ._world import Result, World

SEEDS = (1, 2, 3, 4, 5, 6)
DURATION = 20.0
NAME = "r1"

# The replies of the reservations made by the current task's call (see `_spy`): a list set
# by the caller, which the call's own task (a copy of the caller's context) appends to.
_replies: contextvars.ContextVar[list[list[Any]]] = contextvars.ContextVar("replies")


def _spy() -> Any:
    """Keep each reservation's reply where its caller can read it; returns the original."""
    original = RedisRateLimiter._call

    async def call(self: RedisRateLimiter, context: Any, args: tuple[Any, ...]) -> list[Any]:
        reply: list[Any] = await original(self, context, args)
        _replies.get().append(reply)
        return reply

    RedisRateLimiter._call = call  # type: ignore[method-assign]
    return original


class LimiterRun(Run):
    """One seed: the processes, their tasks taking permits, the seed's faults."""

    def __init__(self, world: World, duration: float) -> None:
        super().__init__(world, duration)
        rng = self.rng
        self.rate = rng.choice((5.0, 20.0, 50.0))
        self.per = rng.choice((1.0, 0.5))
        self.burst = rng.choice((1, 3, int(self.rate)))
        self.resources = []
        self.grants: list[tuple[int, int, float, str]] = []  # slot µs, cost, returned, who
        self.reserved: list[int] = []  # the server's clock (µs) at each grant's reservation

    async def main(self) -> None:
        world = self.world
        loop = asyncio.get_running_loop()
        self.until = loop.time() + self.duration
        tasks = self.spawn_processes(self.user, "u")
        faults = loop.create_task(self.faults(), context=world.sim)
        await self.await_tasks(tasks)
        faults.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                world.violate(f"task {task.get_name()} failed: {task.exception()!r}")
        self.check_limit()
        await world.settle(2.0)

    async def user(self, proc: Proc, worker: int) -> None:
        world = self.world
        rng = random.Random(self.rng.getrandbits(64))
        loop = asyncio.get_running_loop()
        client = world.clients[proc]
        limiter = RedisRateLimiter(client, NAME, rate=self.rate, per=self.per, burst=self.burst)
        while loop.time() < self.until:
            cost = 1 if rng.random() < 0.8 else rng.randint(1, self.burst)
            mode = rng.choice(("wait", "wait", "timeout", "try", "cancel"))
            replies: list[list[Any]] = []
            _replies.set(replies)
            try:
                if mode == "wait":
                    granted = await limiter.acquire(cost=cost)
                elif mode == "timeout":
                    granted = await limiter.acquire(timeout=rng.choice((0.0, 0.1, 0.5)), cost=cost)
                elif mode == "try":
                    granted = await limiter.acquire(blocking=False, cost=cost)
                else:
                    bound = rng.choice((0.01, 0.1, 0.3))
                    granted = await asyncio.wait_for(limiter.acquire(cost=cost), bound)
            except (TimeoutError, ServerUnavailable):
                granted = False
            if granted:
                self.note_grant(proc, worker, cost, loop.time(), replies)
            await asyncio.sleep(rng.expovariate(1 / 0.05))

    def note_grant(
        self, proc: Proc, worker: int, cost: int, returned: float, replies: list[list[Any]]
    ) -> None:
        who = f"{proc.name}/u{worker}"
        if len(replies) != 1 or int(replies[0][0]) != 1:
            self.world.violate(f"{who}: granted without one reservation's reply ({replies!r})")
            return
        reply = replies[0]
        slot = int(reply[4]) + int(reply[1])
        self.grants.append((slot, cost, returned, who))
        self.reserved.append(int(reply[4]))  # on which side of a restart it was reserved
        returned_us = (EPOCH + returned) * 1e6
        if returned_us + 1 < slot:
            early = (slot - returned_us) / 1000
            self.world.violate(f"{who}: granted {early:.3f} ms before its slot on the server")

    def check_limit(self) -> None:
        """The grants' slots, in every window, on each side of every restart."""
        restarts = sorted((EPOCH + at) * 1e6 for at in self.world.net.restarts)
        interval = -(-self.per * 1e6 // self.rate)  # µs per permit, rounded up as the limiter
        epochs: dict[int, list[tuple[int, int]]] = {}
        # By when each was reserved: a slot reserved before a restart may lie after it.
        for (slot, cost, _, _), reserved in zip(self.grants, self.reserved, strict=True):
            epochs.setdefault(bisect.bisect_right(restarts, reserved), []).append((slot, cost))
        for grants in epochs.values():
            grants.sort()
            slots = [slot for slot, _ in grants]
            costs = [0]
            for _, cost in grants:
                costs.append(costs[-1] + cost)
            for first, start in enumerate(slots):
                for window in (0.0, interval, 5 * interval, self.per * 1e6, 3 * self.per * 1e6):
                    last = bisect.bisect_right(slots, start + window)
                    permits = costs[last] - costs[first]
                    allowed = self.burst + window / interval
                    if permits > allowed:
                        self.world.violate(
                            f"BOUND {permits} permits in {window / 1e3:.1f} ms from slot "
                            f"{start}, above {allowed:.2f}"
                        )
                        return


def run_seed(seed: int, duration: float = DURATION) -> Result:
    world = World(seed)
    original = _spy()
    sim = LimiterRun(world, duration)
    loop = world.loop
    try:
        loop.run_until_complete(loop.create_task(sim.main(), context=world.sim))
    except Exception as exc:
        world.violate(f"run failed: {exc!r}")
    finally:
        _close_loop(loop)
        RedisRateLimiter._call = original  # type: ignore[method-assign]
    result = Result(seed)
    result.violations = world.violations
    result.trace = list(world.net.trace)
    result.virtual = loop.time() - 1000
    result.faults = dict(world.faults)
    result.summary = (
        f"ratelimit seed {seed}: rate {sim.rate:g}/{sim.per:g} s burst {sim.burst}, "
        f"{len(world.procs)} processes, {len(sim.grants)} grants, faults {result.faults}"
    )
    return result


def ratelimit_faults() -> Result:
    """RedisRateLimiter under every fault: grants within the limit, never before the slot."""
    results = [run_seed(seed) for seed in SEEDS]
    combined = Result(0)
    combined.violations = [f"seed {r.seed}: {line}" for r in results for line in r.violations]
    failed = [r for r in results if r.violations]
    combined.trace = failed[0].trace if failed else results[-1].trace[-50:]
    combined.summary = "; ".join(r.summary for r in results)
    return combined


SCENARIOS["ratelimit-faults"] = ratelimit_faults
