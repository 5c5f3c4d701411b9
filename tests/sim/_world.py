"""One simulated run: processes with many tasks using every primitive through aiolocks,
faults injected from the seed, and the invariants checked during and after.

`run(seed)` builds everything from `random.Random(seed)` and returns a `Result` whose
`violations` must be empty. Scenarios (`_scenarios.py`) drive the same `World` by hand.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from aiolocks._engine._context import _ATTRIBUTE
from aiolocks._engine._release import CLEANUP_BOUND

from ._loop import PROCESS, Proc, VirtualLoop, in_process, proc_of_task
from ._net import Net
from ._oracle import TROUBLE_BEFORE, Oracle
from ._patches import Recorder, install, lapse

# The engine's documented bounds (docs/architecture.md, "What happens on each fault").
TIMEOUT_SLACK = 0.2  # acquire(timeout=t) returns within t + 0.2 s
TRY_BOUND = 2.0  # blocking=False: ServerUnavailable after socket_timeout, or 2 s
LOST_SLACK = 0.3  # LockLost within the validity + 0.3 s
GRANT_BOUND = 1.0  # a free name with a live waiter is granted within this (quiet links)
OUTAGE_BACKOFF = 2.0  # a waiter's re-check backs off up to 2 s after a failed call


class Violation(AssertionError):
    pass


@dataclass
class Hold:
    """One holding a task believes it has, from acquire() returning True."""

    kind: str  # mutex, cohort, multi, semaphore, read, write, election
    names: tuple[str, ...]
    proc: Proc
    task: str
    token: str
    fences: dict[str, int]
    start: float
    holding: Any
    leases: list[Any]
    limit: int = 1
    adopted: bool = False
    detached: bool = False
    released_at: float | None = None
    taken_away: float | None = None  # an operator ended it on the server (scenarios)
    end: float = float("inf")
    lost_times: dict[int, float] = field(default_factory=dict)  # the recorder's, once granted
    ttl: float = 0.0  # as the simulator configured it (the oracle's, not the engine's)
    body_cancelled: float | None = None  # `async with` body: when a cancellation reached it
    lock_lost: bool = False  # `async with` body: its exit raised LockLost

    def lost_at(self) -> float | None:
        return self.lost_times.get(id(self.holding))


@dataclass
class Result:
    seed: int
    violations: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    holds: int = 0
    acquires: int = 0
    virtual: float = 0.0
    commands: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    summary: str = ""


class World:
    """The loop, the network, the processes and the record of what they believed."""

    def __init__(self, seed: int, keyspace_events: bool | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        random.seed(seed)  # redis-py's back-off jitter
        self.loop = VirtualLoop()
        if keyspace_events is None:
            keyspace_events = self.rng.random() < 0.5
        self.net = Net(self.loop, random.Random(self.rng.getrandbits(64)), keyspace_events)
        self.loop.connector = self._connect
        self.net.scripts = _script_names()
        self.recorder: Recorder = install(self.loop, random.Random(self.rng.getrandbits(64)))
        self.procs: list[Proc] = []
        self.clients: dict[Proc, aioredis.Redis] = {}
        self.holds: list[Hold] = []
        self.active: list[Hold] = []
        self.violations: list[str] = []
        self.faults: dict[str, int] = {}
        self.fault_times: dict[Proc | None, list[float]] = {}
        self.waiting: dict[str, dict[asyncio.Task[Any], tuple[Proc, float]]] = {}
        self.acquires = 0
        self.sim = in_process(None)
        self.started_tasks: list[asyncio.Task[Any]] = []
        self.errors: list[str] = []
        self.graveyard: list[asyncio.Task[Any]] = []
        self.loop.set_exception_handler(self._exception)
        self.oracle = Oracle(self)
        self.net.observer = self.oracle
        self.recorder.on_validity = self.oracle.validity_set
        self.recorder.on_lost = lambda: self.oracle.step("loss report")

    # -- processes ----------------------------------------------------------------------

    async def _connect(self, protocol_factory: Any, host: Any = None, port: Any = None) -> Any:
        proc = PROCESS.get()
        assert proc is not None, "a connection opened outside any simulated process"
        conn = await self.net.connect(proc)
        protocol = protocol_factory()
        conn.transport.set_protocol(protocol)
        protocol.connection_made(conn.transport)
        return conn.transport, protocol

    def new_proc(
        self, name: str, autopipe: bool, socket_timeout: float | None, retry: bool
    ) -> Proc:
        proc = Proc(name)
        proc.autopipe = autopipe  # type: ignore[attr-defined]
        proc.socket_timeout = socket_timeout  # type: ignore[attr-defined]
        self.procs.append(proc)
        kwargs: dict[str, Any] = {"socket_timeout": socket_timeout}
        if retry:
            kwargs["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.01), 3)
        else:
            kwargs["retry"] = Retry(ExponentialBackoff(), 0)
        # Built inside the process, so everything it makes belongs to it.
        client = in_process(proc).run(
            lambda: aioredis.Redis(host="sim", port=6379, protocol=2, **kwargs)
        )
        self.clients[proc] = client
        return proc

    def spawn(self, proc: Proc, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self.loop.create_task(
            coro,  # type: ignore[arg-type]
            name=f"{proc.name}/{name}",
            context=in_process(proc),
        )
        self.started_tasks.append(task)
        return task

    def fault(self, kind: str, proc: Proc | None) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.fault_times.setdefault(proc, []).append(self.loop.time())

    def crash(self, proc: Proc) -> None:
        self.net.log(f"CRASH {proc.name}")
        self.fault("crash", proc)
        proc.crashed_at = self.loop.time()  # type: ignore[attr-defined]
        # Its tasks stay referenced (never run, never collected mid-run).
        self.graveyard.extend(t for t in asyncio.all_tasks(self.loop) if proc_of_task(t) is proc)
        self.loop.crash(proc)
        self.net.crash(proc)

    def stall(self, proc: Proc, seconds: float) -> None:
        self.net.log(f"LOOP STALL {proc.name} {seconds:.3f} s")
        self.fault("loop stall", proc)
        self.loop.stall(proc, seconds)

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message"))
        task = context.get("task") or context.get("future")
        proc = proc_of_task(task) if isinstance(task, asyncio.Future) else None
        if proc is not None and proc.dead:
            return  # a crashed process's tasks are destroyed pending: expected
        exc = context.get("exception")
        self.errors.append(f"{self.now():.4f} {message} {exc!r} {task!r}")

    # -- the record ---------------------------------------------------------------------

    def now(self) -> float:
        return self.loop.time() - 1000.0

    def violate(self, text: str) -> None:
        line = f"t={self.now():.4f} {text}"
        self.net.log("VIOLATION " + text)
        self.violations.append(line)

    def released(self, hold: Hold) -> float:
        """`hold` lets go now (its release starts): a step of the oracle. Returns now."""
        hold.released_at = now = self.loop.time()
        self.oracle.step("release")
        return now

    def troubled(self, proc: Proc, since: float) -> bool:
        """Whether a fault of `proc`'s own (its links, its loop, its renewals) came at or
        after `since`: after a restart it may learn of its loss only at its validity's end
        (a slow renewal reply, a stalled link), not a third of a ttl after."""
        return any(t >= since for t in self.fault_times.get(proc, ()))

    def excused(self, proc: Proc | None, since: float) -> bool:
        """Whether a fault touched `proc` (or the server) since `since`."""
        times = [*self.fault_times.get(proc, ()), *self.fault_times.get(None, ())]
        return any(t >= since for t in times)

    def believed(self, hold: Hold, at: float) -> bool:
        if hold.released_at is not None and hold.released_at <= at:
            return False
        if hold.taken_away is not None and hold.taken_away <= at:
            return False
        lost = hold.lost_at()
        if lost is not None and lost <= at:
            return False
        if getattr(hold.proc, "crashed_at", None) is not None:
            return False
        return all(lease.valid_until > at for lease in hold.leases)

    def granted(self, hold: Hold) -> None:
        """A task's acquire returned True: check it against what others believe now."""
        hold.lost_times = self.recorder.lost_at
        self.holds.append(hold)
        self.oracle.granted(hold)
        now = self.loop.time()
        if not self.believed(hold, now):
            # Granted with no validity left (its call answered after a loop stall outlived
            # it): the holder knows it holds nothing valid, and the keeper reports the loss.
            self.net.log(f"{hold.proc.name}/{hold.task}: granted with no validity left")
            return
        self.active = [h for h in self.active if self.believed(h, now)]
        for name in hold.names:
            others = [h for h in self.active if name in h.names]
            if hold.kind in ("semaphore",):
                if len([h for h in others if h.kind == "semaphore"]) + 1 > hold.limit:
                    self._overlap(hold, others, name)
            elif hold.kind == "read":
                if any(h.kind == "write" for h in others):
                    self._overlap(hold, others, name)
            elif others:
                self._overlap(hold, others, name)
        self.active.append(hold)

    def _overlap(self, hold: Hold, others: list[Hold], name: str) -> None:
        restart = [r for r in self.net.restarts if any(self.since(h) < r for h in [*others, hold])]
        if restart:
            return  # the documented gap after a restart without persistence (checked after)
        shown = ", ".join(
            f"{h.proc.name}/{h.task} {h.kind} fence={h.fences.get(name)} since "
            f"{h.start - 1000:.4f} valid_until={_valid_until(h) - 1000:.4f}"
            for h in others
        )
        self.violate(
            f"OVERLAP on {name!r}: {hold.proc.name}/{hold.task} {hold.kind} "
            f"fence={hold.fences.get(name)} granted while held by {shown}"
        )

    # -- after the run ------------------------------------------------------------------

    def check_history(self) -> None:
        """Overlaps and fence order over the whole history, belief ends computed exactly."""
        end_of_run = self.loop.time()
        for hold in self.holds:
            ends = [end_of_run]
            if hold.released_at is not None:
                ends.append(hold.released_at)
            lost = hold.lost_at()
            if lost is not None:
                ends.append(lost)
            if hold.taken_away is not None:
                ends.append(hold.taken_away)
            crashed = getattr(hold.proc, "crashed_at", None)
            if crashed is not None:
                ends.append(crashed)
            for lease in hold.leases:
                gone = lapse(self.recorder, lease, min(ends))
                if gone is not None:
                    ends.append(gone)
            hold.end = min(ends)
        by_name: dict[str, list[Hold]] = {}
        for hold in self.holds:
            for name in hold.names:
                by_name.setdefault(name, []).append(hold)
        for name, holds in by_name.items():
            holds.sort(key=lambda h: h.start)
            for i, a in enumerate(holds):
                for b in holds[i + 1 :]:
                    if b.start >= a.end and b.end > b.start and _exclusive(a, b):
                        # a ended before b began: its fence is smaller (hand-over keeps it),
                        # unless b was granted the name before a restart that emptied the
                        # server, a after it (the documented gap: b learns of its loss at
                        # its next renewal; its older, lower fence is what keeps it out)
                        fa, fb = a.fences[name], b.fences[name]
                        if (
                            not fa < fb
                            and not (b.adopted and fa == fb)
                            and not self._restart_gap([a, b], b.start)
                        ):
                            self.violate(
                                f"FENCE ORDER on {name!r}: {a.proc.name}/{a.task} fence={fa} "
                                f"held {a.start - 1000:.4f}-{a.end - 1000:.4f}, then "
                                f"{b.proc.name}/{b.task} fence={fb} from {b.start - 1000:.4f}"
                            )
            self._check_overlaps(name, holds)

    def _check_overlaps(self, name: str, holds: list[Hold]) -> None:
        events: list[tuple[float, int, Hold]] = []
        for hold in holds:
            if hold.end > hold.start:
                events.append((hold.start, 1, hold))
                events.append((hold.end, 0, hold))
        events.sort(key=lambda e: (e[0], e[1]))
        current: list[Hold] = []
        for at, starting, hold in events:
            if not starting:
                if hold in current:
                    current.remove(hold)
                continue
            conflict = False
            if hold.kind == "semaphore":
                conflict = len(current) + 1 > hold.limit
            elif hold.kind == "read":
                conflict = any(h.kind == "write" for h in current)
            else:
                conflict = bool(current)
            if conflict and not self._restart_gap([*current, hold], at):
                shown = ", ".join(
                    f"{h.proc.name}/{h.task} {h.kind} fence={h.fences.get(name)} "
                    f"{h.start - 1000:.4f}-{h.end - 1000:.4f}"
                    for h in current
                )
                line = (
                    f"OVERLAP on {name!r} (history): {hold.proc.name}/{hold.task} {hold.kind} "
                    f"fence={hold.fences.get(name)} {hold.start - 1000:.4f}-{hold.end - 1000:.4f}"
                    f" with {shown}"
                )
                if not any(line.split(" (history)")[1] in v for v in self.violations):
                    self.violate(line)
            current.append(hold)

    def since(self, hold: Hold) -> float:
        """When the oldest lease of `hold` was granted (a multi-lock takes its names one by
        one: a name may be held from before a restart the rest were taken after), or the
        server ran it, if earlier (a grant run before a restart that emptied the server,
        its reply heard after it: the holder learns of the loss at its next renewal)."""
        firsts = [
            self.recorder.validity.get(id(lease), [(hold.start, 0.0)])[0][0]
            for lease in hold.leases
        ]
        return min([hold.start, self.oracle.server_ran(hold), *firsts])

    def _restart_gap(self, holds: list[Hold], at: float) -> bool:
        """The documented gap: a holder from before a restart learns of it at its next
        renewal (ttl/3), while a waiter may be granted on the emptied server."""
        for restart in self.net.restarts:  # (when the emptied server answers again)
            before = [h for h in holds if self.since(h) < restart]
            if (
                before
                and at >= restart
                and all(
                    h.end <= restart + max(lz.ttl for lz in h.leases or [_Ttl]) / 3 + 0.5
                    or self.troubled(h.proc, restart - TROUBLE_BEFORE)
                    for h in before
                )
            ):
                return True
        return False

    def check_end(self, ttl_max: float) -> None:
        """Nothing left behind: no key without expiry, no live process's queue entry now;
        no key at all, no task, no timer after the idle window."""
        tags = self.tags()
        for key, item in self.net.live_items():
            if item.expireat is None:
                self.violate(f"LEFTOVER key without expiry: {key!r}")
            if key.endswith(b":waiters"):
                for deadline, member in getattr(item.value, "_byscore", ()):
                    if deadline < self.net.now_ms():
                        continue  # dead on the server already: the next script purges it
                    proc = tags.get(member.split(b":")[2].decode())
                    if proc is not None and not proc.dead:
                        self.violate(f"LEFTOVER queue entry of {proc.name} in {key!r}: {member!r}")

    def tags(self) -> dict[str, Proc]:
        """Each live client's queue-entry tag (see `WaitQueue.member`) -> its process."""
        tags = {}
        for proc, client in self.clients.items():
            for context in getattr(client, _ATTRIBUTE, {}).values():
                tags[context.waitqueue.tag] = proc
        return tags

    async def settle(self, ttl_max: float) -> None:
        """Close every live client and wait out the engine's idle windows and the keys'
        expiry; then nothing may be left."""
        self.check_end(ttl_max)
        # The clean-ups of abandoned acquisitions go on in the background for up to
        # max(5 s, ttl): let them end before the clients close. (Closed earlier, a clean-up
        # still running opens a new connection on the closed client, which stays open:
        # issue 25's shutdown, not checked here.)
        await asyncio.sleep(max(CLEANUP_BOUND, ttl_max) + 1)
        for proc, client in self.clients.items():
            if not proc.dead:
                await asyncio.wait_for(self._close(proc, client), 30)
        await asyncio.sleep(max(35.0, 2 * ttl_max + 2))
        left = list(self.net.live_items())
        if left:
            self.violate(f"LEFTOVER keys after the idle window: {[k for k, _ in left][:8]}")
        current = asyncio.current_task()
        tasks = [
            t
            for t in asyncio.all_tasks(self.loop)
            if t is not current and not t.done() and not getattr(proc_of_task(t), "dead", False)
        ]
        if tasks:
            self.violate(f"LEFTOVER tasks: {tasks[:5]}")
        timers = [h for h in self.loop.live_timers() if h.when() > 0]
        mine = self.net._expiry
        timers = [h for h in timers if h is not mine and _proc_name(h) is not None]
        if timers:
            self.violate(f"LEFTOVER timers: {timers[:5]}")
        if not any(p.dead for p in self.procs):
            gc.collect()
            pending = [
                f
                for f in gc.get_objects()
                if isinstance(f, asyncio.Future)
                and not isinstance(f, asyncio.Task)
                and not f.done()
                and f.get_loop() is self.loop
            ]
            if pending:
                self.violate(f"LEFTOVER futures: {[_describe(f) for f in pending[:5]]}")
        if self.errors:
            for error in self.errors[:5]:
                self.violate(f"ERROR logged by the loop: {error}")

    async def _close(self, proc: Proc, client: aioredis.Redis) -> None:
        done = asyncio.get_running_loop().create_future()

        async def close() -> None:
            try:
                await client.aclose()
            finally:
                done.set_result(None)

        self.spawn(proc, close(), "aclose")
        await done


def _valid_until(hold: Hold) -> float:
    return min((lease.valid_until for lease in hold.leases), default=0.0)


def _describe(future: asyncio.Future[Any]) -> str:
    """A pending future, and for a shield's outer future the inner one it waits for."""
    text = repr(future)
    for callback, _ in getattr(future, "_callbacks", None) or ():
        for cell in getattr(callback, "__closure__", None) or ():
            inner = cell.cell_contents
            if isinstance(inner, asyncio.Future) and inner is not future:
                text += f" (shielding {inner!r})"
    return text


def _script_names() -> dict[bytes, str]:
    """SHA1 -> script name, for the trace."""
    import sys

    from aiolocks._scripts import Script

    names = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("aiolocks"):
            for value in list(vars(module).values()):
                if isinstance(value, Script):
                    names[value.sha.encode()] = value.name
    return names


def _exclusive(a: Hold, b: Hold) -> bool:
    """Whether one of two holdings excludes the other (fences order only those: permits
    of a semaphore, or readers, may be granted in one order and learned in another)."""
    if a.kind == "semaphore" or b.kind == "semaphore":
        return a.limit == 1 and b.limit == 1
    return not (a.kind == "read" and b.kind == "read")


class _Ttl:
    ttl = 0.0


def _proc_name(handle: asyncio.Handle) -> str | None:
    context = getattr(handle, "_context", None)
    proc = None if context is None else context.get(PROCESS)
    return None if proc is None else proc.name


Op = Callable[[], Awaitable[Any]]
