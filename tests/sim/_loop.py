"""The simulation's event loop: virtual time, and processes that stall or crash.

`VirtualLoop` is asyncio's own selector loop with a selector that never waits: when the
loop would block until its next timer, virtual time jumps there. Nothing real is read or
written (connections are `_net.SimTransport`s), so a run is a pure function of its seed.

A simulated process is a `Proc`; everything it runs (its tasks, their callbacks, the data
its connections deliver) carries the process in the `PROCESS` context variable. The loop
reads that variable on every `call_soon` / `call_at`: a stalled process's callbacks are
held back until the stall ends (in their order), a crashed process's are dropped, so its
tasks and timers vanish at once without running another line (no clean-up, no
cancellation), as in a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import selectors
import time as real_time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

WALL_LIMIT = 240.0  # wall-clock seconds one run may take (a livelock ends as a violation)
START = 1000.0  # virtual monotonic time at the start of a run
_TURN = 1e-6  # virtual time one turn of the loop takes at least
_EPS = 1e-9  # spacing of callbacks held back by a stall (keeps their order)


class Proc:
    """One simulated process (a client): its name and what the simulator did to it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = False
        self.stalled_until = 0.0
        self.stalled_total = 0.0  # seconds its loop was stalled, for the time bounds
        self.stalls: list[tuple[float, float]] = []
        self._held = 0  # callbacks held back by the current stall

    def __repr__(self) -> str:
        return f"<Proc {self.name}>"

    def stalled_between(self, start: float, end: float) -> float:
        """How long this process was stalled within [start, end]."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.stalls)


PROCESS: contextvars.ContextVar[Proc | None] = contextvars.ContextVar("sim_process", default=None)


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is set: every task waits for ever."""


class _Selector(selectors.BaseSelector):
    """Registers (the loop's self-pipe) and never waits: `select` moves virtual time."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[int, selectors.SelectorKey] = {}
        self._turns = 0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        self.unregister(fileobj)
        return self.register(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("no callback is ready and no timer is set")
        self._turns += 1
        if not self._turns % 4096 and real_time.monotonic() > self._loop.wall_deadline:
            raise Deadlock("the run took too long in wall-clock time (a livelock?)")
        # Each turn of the loop takes a little time, as on a real clock: a timer armed for
        # less than the clock's resolution ahead cannot fire at the same instant for ever.
        self._loop.advance(max(timeout, _TURN))
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


def _run_if_live(handle: asyncio.Handle) -> None:
    """A ready callback moved behind a stall: run it unless it was cancelled meanwhile
    (whoever holds it may cancel it) or its process crashed."""
    if handle.cancelled():
        return
    proc = _proc_of(handle)
    if proc is not None and proc.dead:
        return
    handle._run()


def _nothing() -> None:
    pass


def _proc_of(handle: asyncio.Handle) -> Proc | None:
    context: contextvars.Context | None = getattr(handle, "_context", None)
    return None if context is None else context.get(PROCESS)


class VirtualLoop(asyncio.SelectorEventLoop):
    """asyncio's loop on virtual time, with per-process stalls and crashes."""

    def __init__(self) -> None:
        self._now = START
        super().__init__(_Selector(self))
        self.advanced = 0.0  # virtual seconds that passed while nothing ran
        self.wall_deadline = real_time.monotonic() + WALL_LIMIT
        self.set_task_factory(_task_factory)

    def time(self) -> float:
        return self._now

    connector: Callable[..., Any] | None = None  # opens a simulated connection

    async def create_connection(
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: Any = None,
        port: Any = None,
        **kwargs: Any,
    ) -> Any:
        assert self.connector is not None
        return await self.connector(protocol_factory, host, port)

    def advance(self, seconds: float) -> None:
        self._now += seconds
        self.advanced += seconds

    # -- scheduling, filtered by process -----------------------------------------------

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> asyncio.Handle:
        if context is None:
            context = contextvars.copy_context()
        proc = context.get(PROCESS)
        if proc is not None:
            if proc.dead:
                return self._dropped(callback, args, context)
            if proc.stalled_until > self._now:
                return self._hold(proc, callback, args, context)
        return super().call_soon(callback, *args, context=context)

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if context is None:
            context = contextvars.copy_context()
        proc = context.get(PROCESS)
        if proc is not None:
            if proc.dead:
                return self._dropped(callback, args, context)
            if proc.stalled_until > when:
                return self._hold(proc, callback, args, context)
        return super().call_at(when, callback, *args, context=context)

    def _dropped(
        self, callback: Callable[..., Any], args: tuple[Any, ...], context: contextvars.Context
    ) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(self._now, callback, args, self, context)
        handle._cancelled = True
        return handle

    def _hold(
        self,
        proc: Proc,
        callback: Callable[..., Any],
        args: tuple[Any, ...],
        context: contextvars.Context,
    ) -> asyncio.TimerHandle:
        proc._held += 1
        when = proc.stalled_until + proc._held * _EPS
        return super().call_at(when, callback, *args, context=context)

    # -- what the simulator does to a process ------------------------------------------

    def stall(self, proc: Proc, seconds: float) -> None:
        """Freeze `proc`'s loop for `seconds`: nothing of it runs until then, in order."""
        if proc.dead:
            return
        start = self._now
        until = max(proc.stalled_until, start + seconds)
        if until <= proc.stalled_until:
            return
        proc.stalled_until = until
        proc.stalls.append((start, until))
        proc._held = 0
        # Ready callbacks of the process move behind the stall (the others keep their order).
        # (Replaced in place by a no-op: the loop may be part way through this deque.)
        ready: Any = self._ready  # type: ignore[attr-defined]
        for index, handle in enumerate(ready):
            if _proc_of(handle) is proc and not handle.cancelled():
                proc._held += 1
                super().call_at(
                    until + proc._held * _EPS,
                    _run_if_live,
                    handle,
                    context=handle._context.copy(),
                )
                ready[index] = asyncio.Handle(_nothing, (), self, None)
        # Timers due before the end move to it, keeping their order.
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        early = sorted(
            (h for h in scheduled if h.when() < until and _proc_of(h) is proc),
            key=lambda h: h.when(),
        )
        for handle in early:
            proc._held += 1
            handle._when = until + proc._held * _EPS  # type: ignore[attr-defined]
        if early:
            heapq.heapify(scheduled)

    def crash(self, proc: Proc) -> None:
        """`proc` vanishes: none of its callbacks, tasks or timers runs again."""
        proc.dead = True
        ready: Any = self._ready  # type: ignore[attr-defined]
        for handle in list(ready):
            if _proc_of(handle) is proc:
                handle.cancel()
        for handle in self._scheduled:  # type: ignore[attr-defined]
            if _proc_of(handle) is proc:
                handle.cancel()

    def live_timers(self) -> list[asyncio.TimerHandle]:
        """Timers still set, of processes that did not crash."""
        return [
            h
            for h in self._scheduled  # type: ignore[attr-defined]
            if not h.cancelled() and not getattr(_proc_of(h), "dead", False)
        ]


_TASK_PROCS: weakref.WeakKeyDictionary[asyncio.Task[Any], Proc] = weakref.WeakKeyDictionary()


def _task_factory(
    loop: asyncio.AbstractEventLoop, coro: Any, context: contextvars.Context | None = None
) -> asyncio.Task[Any]:
    task = asyncio.Task(coro, loop=loop, context=context)
    proc = (context if context is not None else contextvars.copy_context()).get(PROCESS)
    if proc is not None:
        _TASK_PROCS[task] = proc
    return task


def proc_of_task(task: asyncio.Future[Any]) -> Proc | None:
    """The process a task belongs to (None: the simulator's)."""
    return _TASK_PROCS.get(task) if isinstance(task, asyncio.Task) else None


def in_process(proc: Proc | None) -> contextvars.Context:
    """A fresh context that belongs to `proc` (None: the simulator's own)."""
    context = contextvars.Context()
    context.run(PROCESS.set, proc)
    return context
