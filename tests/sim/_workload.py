"""The random run of one seed: processes, their tasks, the faults, and the bounds checked
as each call returns."""

from __future__ import annotations

import asyncio
import gc
import random
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiolocks
from aiolocks import (
    LockError,
    LockHandle,
    LockLost,
    LockTimeout,
    RedisElection,
    RedisMultiLock,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)

from ._loop import Proc, proc_of_task
from ._net import Conn
from ._world import (
    GRANT_BOUND,
    LOST_SLACK,
    OUTAGE_BACKOFF,
    TIMEOUT_SLACK,
    TRY_BOUND,
    Hold,
    Result,
    World,
)


@dataclass
class Resource:
    kind: str  # mutex, cohort, multi, semaphore, rw, election
    names: tuple[str, ...]
    ttl: float
    limit: int = 1
    local_handoff: int = 0
    max_hold: float | None = None


class Run:
    """One seed's processes, tasks and faults."""

    def __init__(self, world: World, duration: float) -> None:
        self.world = world
        self.rng = random.Random(world.rng.getrandbits(64))
        self.duration = duration
        rng = self.rng
        ttl = rng.choice((1.0, 1.5, 2.0, 3.0))
        self.resources = [
            Resource("mutex", ("m1",), ttl),
            Resource("mutex", ("m2",), rng.choice((1.0, 2.0)), max_hold=rng.choice((None, 1.5))),
            Resource("multi", ("m2", "m3"), ttl),
            Resource("mutex", ("m3",), ttl),
            Resource("cohort", ("c1",), ttl, local_handoff=rng.choice((1, 2, 4))),
            Resource("semaphore", ("s1",), ttl, limit=rng.choice((1, 2, 3))),
            Resource("rw", ("rw1",), ttl),
            Resource("election", ("e1",), ttl),
        ]
        weights = [rng.random() + 0.2 for _ in self.resources]
        self.weights = weights
        self.handles: list[tuple[Resource, LockHandle, float]] = []
        self.locks: dict[tuple[Proc, int], Any] = {}
        self.free_since: dict[str, float | None] = {}
        self.orphan_since: dict[str, float] = {}
        self.strict = {"m1"}  # names no multi-lock or cohort shares (orphan check)
        self.queued: dict[Proc, int] = {}  # tasks of each process in a blocking acquire
        # Processes whose mutexes are strict FIFO (`local_handoff=0`); the others run the
        # default (a cohort of 16 holdings and 10 ms). Drawn from a generator of its own,
        # so that the seed's other draws stay as they were.
        self.fifo: set[Proc] = set()
        self.fifo_rng = random.Random(f"{world.seed}:fifo")
        self.until = 0.0

    # -- the run -----------------------------------------------------------------------

    def spawn_processes(
        self, body: Callable[[Proc, int], Coroutine[Any, Any, None]], prefix: str
    ) -> list[asyncio.Task[None]]:
        """2-4 simulated processes, each with 2-6 tasks running `body(proc, n)`."""
        world, rng = self.world, self.rng
        tasks = []
        for p in range(rng.randint(2, 4)):
            proc = world.new_proc(
                f"P{p}",
                autopipe=rng.random() < 0.6,
                socket_timeout=rng.choice((None, 1.0, 3.0)),
                retry=rng.random() < 0.5,
            )
            if self.fifo_rng.random() < 0.4:
                self.fifo.add(proc)
                world.net.log(f"{proc.name}: its mutexes are strict FIFO (local_handoff=0)")
            for w in range(rng.randint(2, 6)):
                tasks.append(world.spawn(proc, body(proc, w), f"{prefix}{w}"))
        return tasks

    async def await_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for every task until 60 s after the run; one still running then is HUNG."""
        world, loop = self.world, asyncio.get_running_loop()
        deadline = self.until + 60
        for task in tasks:
            if _dead(task):
                continue
            remaining = deadline - loop.time()
            done, _ = await asyncio.wait({task}, timeout=max(0.0, remaining))
            if not done and not _dead(task):
                world.violate(f"HUNG task {task.get_name()} still running 60 s after the run")

    async def main(self) -> None:
        world = self.world
        loop = asyncio.get_running_loop()
        self.until = loop.time() + self.duration
        tasks = self.spawn_processes(self.worker, "w")
        faults = loop.create_task(self.faults(), context=world.sim)
        monitor = loop.create_task(self.monitor(), context=world.sim)
        await self.await_tasks(tasks)
        faults.cancel()
        monitor.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                world.violate(f"task {task.get_name()} failed: {exc!r}")
        world.check_history()
        self.check_losses()
        await world.settle(max(r.ttl for r in self.resources))

    def lock_for(self, proc: Proc, res: Resource, worker: int) -> Any:
        # Instances are shared by the tasks of a process (half the time) or per task.
        key = (proc, id(res) * 100 + (worker if self.rng.random() < 0.5 else 99))
        lock = self.locks.get(key)
        if lock is None:
            client = self.world.clients[proc]
            if res.kind == "mutex" and res.max_hold is not None:
                # (strict FIFO by itself: a cohort's lease would outlive the cap)
                lock = RedisMutex(client, res.names[0], ttl=res.ttl, max_hold=res.max_hold)
            elif res.kind == "mutex" and proc in self.fifo:
                # Strict FIFO, its waiters queued behind the other processes' cohorts.
                lock = RedisMutex(client, res.names[0], ttl=res.ttl, local_handoff=0)
            elif res.kind == "mutex":
                lock = RedisMutex(client, res.names[0], ttl=res.ttl)  # the default
            elif res.kind == "cohort":
                lock = RedisMutex(
                    client, res.names[0], ttl=res.ttl, local_handoff=res.local_handoff
                )
            elif res.kind == "multi":
                names = list(res.names)
                self.rng.shuffle(names)
                lock = RedisMultiLock(client, names, ttl=res.ttl)
            elif res.kind == "semaphore":
                lock = RedisSemaphore(client, res.names[0], limit=res.limit, ttl=res.ttl)
            elif res.kind == "rw":
                lock = RedisReadWriteLock(client, res.names[0], ttl=res.ttl)
            else:
                lock = RedisElection(client, res.names[0], ttl=res.ttl)
            self.locks[key] = lock
        return lock

    async def worker(self, proc: Proc, worker: int) -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(self.rng.getrandbits(64))
        while loop.time() < self.until:
            res = rng.choices(self.resources, self.weights)[0]
            if self.handles and rng.random() < 0.5:
                await self.adopt(proc, worker, rng)
            op = asyncio.ensure_future(self.one(proc, worker, res, rng))
            if rng.random() < 0.15:
                # Cancellation at any await: a random moment of the call or the holding.
                await asyncio.wait({op}, timeout=rng.choice((0.0, 0.0005, 0.002, 0.02, 0.3)))
                if not op.done():
                    self.world.net.log(f"{proc.name}/w{worker} cancels its {res.kind} {res.names}")
                op.cancel()
            try:
                await op
            except asyncio.CancelledError:
                if not op.cancelled():
                    raise
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            await asyncio.sleep(rng.expovariate(20))

    async def one(self, proc: Proc, worker: int, res: Resource, rng: random.Random) -> None:
        world = self.world
        loop = asyncio.get_running_loop()
        lock = self.lock_for(proc, res, worker)
        if res.kind == "election":
            await self.campaign(proc, worker, res, lock, rng)
            return
        side = ""
        if res.kind == "rw":
            side = rng.choice(("read", "write"))
            lock = lock.read() if side == "read" else lock.write()
        mode = rng.random()
        blocking, timeout = True, None
        if mode < 0.25:
            blocking = False
        elif mode < 0.85:
            timeout = rng.choice((0.01, 0.1, 0.5, 1.0, 3.0))
        start = loop.time()
        task = asyncio.current_task()
        assert task is not None
        watched = res.kind == "mutex"
        if watched:
            world.waiting.setdefault(res.names[0], {})[task] = (proc, start)
        if blocking:
            self.queued[proc] = self.queued.get(proc, 0) + 1
        world.acquires += 1
        try:
            got = await lock.acquire(blocking=blocking, timeout=timeout)
        except ServerUnavailable:
            got = False
            self.check_call_time(
                proc,
                start,
                try_bound(proc) if not blocking else None,
                f"acquire {res.kind} {res.names}",
            )
            return
        except LockLost:
            got = False  # a multi-lock losing an earlier name while waiting
            return
        finally:
            if watched:
                world.waiting.get(res.names[0], {}).pop(task, None)
            if blocking:
                self.queued[proc] -= 1
        limit = timeout if timeout is not None else (try_bound(proc) if not blocking else None)
        self.check_call_time(
            proc,
            start,
            limit,
            f"acquire {res.kind} {res.names} (timeout={timeout}, blocking={blocking})",
        )
        if not got:
            return
        hold = self.record(proc, worker, res, lock, side, task, adopted=False)
        world.net.log(f"{proc.name}/w{worker} holds {hold.kind} {res.names} {hold.token[:8]}")
        await self.hold_and_release(proc, res, lock, hold, rng)

    def record(
        self,
        proc: Proc,
        worker: int,
        res: Resource,
        lock: Any,
        side: str,
        task: asyncio.Task[Any],
        adopted: bool,
    ) -> Hold:
        holding = lock._holdings[task]
        leases: list[Any] = []
        if res.kind == "multi":
            taken = lock._taken.get(holding.token)
            fences = dict(taken.fences)
            leases = list(taken.leases)
        else:
            fences = {res.names[0]: holding.fence}
            if holding.lease is not None:
                leases = [holding.lease]
        kind = side or res.kind
        hold = Hold(
            kind=kind,
            names=res.names,
            proc=proc,
            task=f"w{worker}",
            token=holding.token,
            fences=fences,
            start=asyncio.get_running_loop().time(),
            holding=holding,
            leases=leases,
            limit=res.limit,
            adopted=adopted,
            ttl=res.ttl,
        )
        self.world.granted(hold)
        return hold

    async def hold_and_release(
        self, proc: Proc, res: Resource, lock: Any, hold: Hold, rng: random.Random
    ) -> None:
        loop = asyncio.get_running_loop()
        if rng.random() < 0.2:
            await self.body(proc, res, lock, hold, rng)
            return
        try:
            await asyncio.sleep(rng.choice((0.0, 0.001, 0.01, 0.1, 0.5, res.ttl * 1.5)))
            if (
                res.kind in ("mutex", "semaphore")
                and rng.random() < 0.15
                and not hold.holding.is_lost
            ):
                try:
                    handle = lock.detach()
                except LockLost:
                    pass
                else:
                    self.world.released(hold)
                    hold.detached = True
                    self.world.net.log(f"{proc.name}/{hold.task} detaches {res.names}")
                    self.handles.append((res, handle, loop.time()))
                    return
        finally:
            if hold.released_at is None:
                released = self.world.released(hold)
                valid = min((lease.valid_until for lease in hold.leases), default=released)
                try:
                    await lock.release()
                except (LockLost, ServerUnavailable):
                    pass  # documented: the server unreachable (a restart) during release
                except LockError as exc:
                    self.world.violate(f"release of {hold.names} raised {exc!r}")
                # The wait follows the validity as renewals move it (`release_until`).
                valid = max(valid, _validity(hold, valid))
                self.check_call_time(
                    proc, released, max(0.0, valid - released),
                    f"release {hold.kind} {hold.names}", slack=LOST_SLACK,
                )  # fmt: skip

    async def body(
        self, proc: Proc, res: Resource, lock: Any, hold: Hold, rng: random.Random
    ) -> None:
        """The body of `async with`, long (up to four ttls, asleep or busy with short
        awaits); half the time it outlives its lease, its process's renewals answered too
        late. A loss must cancel it, and its exit raise LockLost."""
        loop = asyncio.get_running_loop()
        world = self.world
        holding = hold.holding
        holding.body = True  # (as `__aenter__` does when its acquire() returned True)
        if holding.is_lost:
            holding.cancel_body()
        length = rng.choice((0.5, 2.0, 4.0)) * res.ttl
        if rng.random() < 0.5:
            delay = res.ttl * rng.choice((0.8, 1.5))
            loop.call_later(rng.uniform(0.0, length / 2), self.slow_renewals, proc, delay, length)
        error: asyncio.CancelledError | None = None
        try:
            if rng.random() < 0.5:
                await asyncio.sleep(length)
            else:
                for _ in range(int(length / 0.01)):
                    await asyncio.sleep(0.01)
        except asyncio.CancelledError as exc:
            hold.body_cancelled = loop.time()
            error = exc
        released = world.released(hold)
        valid = _validity(hold, released)
        try:
            await lock.__aexit__(None if error is None else type(error), error, None)
        except LockLost:
            hold.lock_lost = True
        except ServerUnavailable:
            pass  # documented: the server unreachable (a restart) during release
        self.check_body(hold)
        valid = max(valid, _validity(hold, valid))
        self.check_call_time(
            proc, released, max(0.0, valid - released), f"release {hold.kind} {hold.names}",
            slack=LOST_SLACK,
        )  # fmt: skip
        task = asyncio.current_task()
        if error is not None and task is not None and task.cancelling():
            raise error  # the worker's own cancellation, not the loss's

    def check_body(self, hold: Hold) -> None:
        """A loss reported while the body ran cancelled it within the bound, and the exit
        raised LockLost."""
        lost, released = hold.lost_at(), hold.released_at
        if lost is None or released is None or lost >= released:
            return
        due = lost + LOST_SLACK + hold.proc.stalled_between(lost, lost + 30)
        who = f"{hold.proc.name}/{hold.task} {hold.kind} {hold.names}"
        if hold.body_cancelled is None or hold.body_cancelled > due:
            when = "never" if hold.body_cancelled is None else f"{hold.body_cancelled - lost:.3f} s"
            self.world.violate(
                f"BODY NOT CANCELLED {who}: lost at {lost - 1000:.4f}, cancelled {when}"
            )
        if not hold.lock_lost:
            self.world.violate(f"NO LockLost {who}: lost at {lost - 1000:.4f} in its body")

    def slow_renewals(self, proc: Proc, delay: float, seconds: float) -> None:
        """The replies to `proc`'s lease renewals come `delay` late for `seconds`."""
        if proc.dead:
            return
        world = self.world
        until = world.loop.time() + seconds
        world.net.log(f"{proc.name} SLOW RENEWALS +{delay:.3f} s for {seconds:.3f} s")
        world.fault("slow renewal", proc)
        world.net.slow_renewals[proc] = (until, delay)

    async def adopt(self, proc: Proc, worker: int, rng: random.Random) -> None:
        res, handle, _ = self.handles.pop(rng.randrange(len(self.handles)))
        lock = self.lock_for(proc, res, worker)
        task = asyncio.current_task()
        assert task is not None
        try:
            await lock.adopt(handle)
        except (LockLost, ServerUnavailable):
            return  # ended (or adopted) already; or the server is down (a restart)
        hold = self.record(proc, worker, res, lock, "", task, adopted=True)
        await self.hold_and_release(proc, res, lock, hold, rng)

    async def campaign(
        self, proc: Proc, worker: int, res: Resource, election: RedisElection, rng: random.Random
    ) -> None:
        loop = asyncio.get_running_loop()
        timeout = rng.choice((0.0, 0.1, 1.0, 3.0))
        start = loop.time()
        hold: Hold | None = None
        try:
            async with election.campaign(f"{proc.name}-{worker}", timeout=timeout) as term:
                self.check_call_time(proc, start, timeout or try_bound(proc), "campaign")
                holding = term._holding
                hold = Hold(
                    kind="election", names=res.names, proc=proc, task=f"w{worker}",
                    token=holding.token, fences={res.names[0]: term.fencing_token},
                    start=loop.time(), holding=holding,
                    leases=[holding.lease] if holding.lease is not None else [], ttl=res.ttl,
                )  # fmt: skip
                self.world.granted(hold)
                try:
                    await asyncio.sleep(rng.choice((0.0, 0.01, 0.3, res.ttl * 1.5)))
                    if rng.random() < 0.3:
                        await term.proclaim(f"{proc.name}-{worker}-again")
                finally:
                    self.world.released(hold)
        except (LockTimeout, ServerUnavailable):
            if hold is None:
                self.check_call_time(proc, start, timeout or try_bound(proc), "campaign")
        except LockLost:
            pass

    def check_call_time(
        self,
        proc: Proc,
        start: float,
        limit: float | None,
        what: str,
        slack: float = TIMEOUT_SLACK,
    ) -> None:
        """A call with a bound returned within it (plus the slack; a stalled loop's time
        does not count against the library)."""
        if limit is None:
            return
        now = asyncio.get_running_loop().time()
        took = now - start - proc.stalled_between(start, now)
        if took > limit + slack:
            self.world.violate(
                f"SLOW {what} by {proc.name}: took {took:.3f} s (bound {limit:g} + {slack:g} s)"
            )

    def check_losses(self) -> None:
        """LockLost (the `lost` event) came within the slack after the validity ended: as
        the engine counted it, and as the server's record says (the oracle's)."""
        world = self.world
        world.oracle.check_losses(LOST_SLACK, world.loop.time())
        world.oracle.check_fairness(world.loop.time())
        for hold in world.holds:
            lost = hold.lost_at()
            released = hold.released_at
            if hold.detached:
                continue  # handed over: the adopter learns of a loss (adopt raises LockLost)
            if hold.end == released or (released is not None and released <= hold.end):
                continue
            if lost is not None and lost <= hold.end:
                continue
            if hold.end >= world.loop.time() - 1:
                continue
            # The belief ended by its validity: the loss must be reported soon after.
            stalled = hold.proc.stalled_between(hold.end, hold.end + 30)
            due = hold.end + LOST_SLACK + stalled
            if getattr(hold.proc, "crashed_at", float("inf")) <= due:
                continue  # the process died before it was due to report it
            if lost is None or lost > due:
                late = "never" if lost is None else f"{lost - hold.end:.3f} s late"
                world.violate(
                    f"LATE LOSS {hold.proc.name}/{hold.task} {hold.kind} {hold.names} "
                    f"fence={list(hold.fences.values())}: validity ended at "
                    f"{hold.end - 1000:.4f}, lost reported {late}"
                )

    # -- faults ------------------------------------------------------------------------

    async def faults(self) -> None:
        world, rng = self.world, self.rng
        loop = asyncio.get_running_loop()
        crash_at = loop.time() + rng.uniform(1, self.duration) if rng.random() < 0.4 else None
        restart_at = loop.time() + rng.uniform(1, self.duration) if rng.random() < 0.15 else None
        # The server's clock steps back (a failover to a replica whose clock is behind, the
        # data kept); not with a restart, whose lost fence counter the clock must outrun.
        clock_at = None
        if restart_at is None and rng.random() < 0.35:
            clock_at = loop.time() + rng.uniform(1, self.duration)
        rate = rng.choice((0.3, 1.0, 3.0))
        while loop.time() < self.until:
            await asyncio.sleep(rng.expovariate(rate))
            now = loop.time()
            live = [p for p in world.procs if not p.dead]
            if crash_at is not None and now >= crash_at and len(live) > 1:
                # Preferably a process with several tasks waiting in queues: they must be
                # purged, and the queues move on.
                queued = [p for p in live if self.queued.get(p, 0) >= 2]
                if queued or now >= crash_at + 5:
                    crash_at = None
                    world.crash(rng.choice(queued or live))
                    continue
            if restart_at is not None and now >= restart_at:
                restart_at = None
                world.fault("restart", None)
                world.net.restart(rng.choice((0.0, 0.2, 1.0)))
                continue
            if clock_at is not None and now >= clock_at:
                clock_at = None
                world.fault("clock back", None)
                world.net.step_clock_back(rng.choice((0.01, 0.3, 1.0, 3.0)))
                continue
            kind = rng.choice(("latency", "stall", "reset", "push", "loss", "loop", "renewal"))
            if kind == "renewal" and live:
                delay = rng.choice((0.05, 0.3, 1.0, 2.0))
                self.slow_renewals(rng.choice(live), delay, rng.uniform(0.3, 3.0))
                continue
            conns = [c for c in world.net.conns if not c.closed and not c.proc.dead]
            if kind == "loop" and live:
                world.stall(rng.choice(live), rng.choice((0.05, 0.3, 1.0, 2.0)))
                continue
            if not conns:
                continue
            if kind in ("push", "loss"):
                subs = [c for c in conns if c.subscriber]
                if not subs:
                    continue
                conn = rng.choice(subs)
            else:
                conn = rng.choice(conns)
            world.fault(kind, conn.proc)
            if kind == "latency":
                conn.latency = rng.choice((0.02, 0.1, 0.4))
                conn.latency_faults += 1
                world.net.log(f"{conn.proc.name} c{conn.id} LATENCY {conn.latency}")
                loop.call_later(rng.uniform(0.1, 2.0), _end_latency_fault, conn)
            elif kind == "stall":
                conn.stall(rng.choice((0.1, 0.5, 1.5, 3.0)))
            elif kind == "reset":
                conn.reset("injected")
            elif kind == "push":
                conn.push_delay = rng.choice((0.05, 0.3, 1.0, 2.0))
                world.net.log(f"{conn.proc.name} c{conn.id} PUSH DELAY {conn.push_delay}")
                loop.call_later(rng.uniform(0.5, 3.0), setattr, conn, "push_delay", 0.0)
            else:
                conn.push_loss = 0.5
                world.net.log(f"{conn.proc.name} c{conn.id} PUSH LOSS")
                loop.call_later(rng.uniform(0.2, 1.0), setattr, conn, "push_loss", 0.0)

    # -- liveness ----------------------------------------------------------------------

    async def monitor(self) -> None:
        """A free mutex name with a live waiter is granted within the bound."""
        loop = asyncio.get_running_loop()
        names = sorted({r.names[0] for r in self.resources if r.kind == "mutex"})
        while True:
            await asyncio.sleep(0.05)
            now = loop.time()
            for name in names:
                self.check_free(name, now)

    def check_free(self, name: str, now: float) -> None:
        world, net = self.world, self.world.net
        waiting = [
            (proc, since)
            for proc, since in world.waiting.get(name, {}).values()
            if not proc.dead and proc.stalled_until <= now
        ]
        prefix = f"aiolocks:mutex:{{{name}}}:".encode()
        owner = net.value(prefix + b"owner")
        if owner is not None and waiting and name in self.strict:
            self.check_orphan(name, owner.decode(), waiting, now)
        else:
            self.orphan_since.pop(name, None)
        free = bool(waiting) and owner is None
        if free:
            tags = world.tags()
            zset = net.value(prefix + b"waiters")
            now_ms = net.now_ms()
            for score, member in getattr(zset, "_byscore", ()):
                if score < now_ms:
                    continue
                proc = tags.get(member.split(b":")[2].decode())
                if proc is None or proc.dead or proc.stalled_until > now:
                    free = False  # the server may rightly grant it to one that cannot answer
        if not free:
            self.free_since[name] = None
            return
        since = self.free_since.get(name)
        if since is None:
            self.free_since[name] = now
            return
        if since == -1.0 or now - since <= GRANT_BOUND:
            return
        procs = {proc for proc, _ in waiting}
        if any(world.excused(p, since - OUTAGE_BACKOFF - 1) for p in procs):
            return
        self.free_since[name] = -1.0  # reported once until it changes
        shown = ", ".join(f"{p.name} since {s - 1000:.4f}" for p, s in waiting)
        world.violate(
            f"STARVED {name!r}: free with live waiters ({shown}) for "
            f"{now - since:.3f} s (bound {GRANT_BOUND} s)"
        )

    def check_orphan(
        self, name: str, token: str, waiting: list[tuple[Proc, float]], now: float
    ) -> None:
        """The owner is a live process's token that nobody there believes it holds (a grant
        to a waiter that left): it must not keep the name from live waiters."""
        world = self.world
        proc = world.recorder.tokens.get(token.split("+")[0])
        # A holding detached for another process to adopt is in hand-over: its owner is
        # none of the tasks until then (the handle may never be adopted: then its ttl ends it).
        believed = any(
            h.token == token and (h.detached or world.believed(h, now)) for h in world.holds
        )
        if proc is None or proc.dead or proc.stalled_until > now or believed:
            self.orphan_since.pop(name, None)
            return
        since = self.orphan_since.setdefault(name, now)
        if since == -1.0 or now - since <= GRANT_BOUND:
            return
        procs = {p for p, _ in waiting} | {proc}
        if any(world.excused(p, since - OUTAGE_BACKOFF - 1) for p in procs):
            return
        self.orphan_since[name] = -1.0
        world.violate(
            f"ORPHANED {name!r}: owned for {now - since:.3f} s by {proc.name}'s token "
            f"{token[:8]}, which no task there holds, while {len(waiting)} wait(s)"
        )


def _validity(hold: Hold, default: float) -> float:
    return min((lease.valid_until for lease in hold.leases), default=default)


def try_bound(proc: Proc) -> float:
    """How long a `blocking=False` try may take: the client's socket_timeout, or 2 s."""
    return getattr(proc, "socket_timeout", None) or TRY_BOUND


def _dead(task: asyncio.Task[Any]) -> bool:
    proc = proc_of_task(task)
    return bool(proc is not None and proc.dead)


def run(seed: int, duration: float = 30.0, trace: bool = True) -> Result:
    """Run seed `seed` to the end; the result lists its violations and its trace."""
    world = World(seed)
    if not trace:
        world.net.trace = type(world.net.trace)(maxlen=0)
    sim = Run(world, duration)
    loop = world.loop
    try:
        loop.run_until_complete(loop.create_task(sim.main(), context=world.sim))
    except Exception as exc:  # the simulator itself, or a deadlock
        world.violate(f"run failed: {exc!r}")
    finally:
        _close_loop(loop)
    result = Result(seed)
    result.violations = world.violations
    result.trace = list(world.net.trace)
    result.holds = len(world.holds)
    result.acquires = world.acquires
    result.virtual = loop.time() - 1000
    result.commands = world.net.commands
    result.faults = dict(world.faults)
    result.summary = (
        f"seed {seed}: {len(world.procs)} processes, {world.acquires} acquires, "
        f"{len(world.holds)} holdings, {world.net.commands} commands, "
        f"{result.virtual:.1f} virtual s, keyspace events "
        f"{'on' if world.net.keyspace_events else 'off'}, faults {result.faults}"
    )
    return result


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close the run's loop. The coroutines of crashed processes' tasks are dropped
    without running their clean-up (closing one runs its `finally` blocks, whose awaits
    complain that nobody runs them): they vanished with their process."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()
        gc.collect()
    finally:
        sys.unraisablehook = hook


__all__ = ["Resource", "Run", "aiolocks", "run"]


def _end_latency_fault(conn: Conn) -> None:
    """A latency fault ends; the link's own latency comes back when the last overlapping one
    has ended (restoring what each saw at its start left a link slow for good when two
    overlapped and ended in the other order)."""
    conn.latency_faults -= 1
    if not conn.latency_faults:
        conn.latency = conn.base_latency
