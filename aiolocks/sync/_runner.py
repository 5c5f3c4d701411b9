"""The one background event loop per process that runs the engine for synchronous callers.

Started on first use, in a daemon thread; stopped at interpreter exit (what is still held
is released then, within the engine's loop-end bound, else its lease lapses by its ttl);
forgotten in a forked child (Celery's prefork pool forks after import), which starts its
own on first use. A blocking call waits on a plain lock the loop releases: no polling, and
Ctrl-C (or a signal handler's exception) interrupts the wait, cancels the call on the loop
and waits for the cancellation's clean-up before it is raised.
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["Call", "PerProcess", "Process", "process"]

T = TypeVar("T")

# How long an interrupted call waits for its cancellation's clean-up (a queued entry
# withdrawn, a grant that raced the interrupt released) before the interrupt is raised.
CLEANUP_BOUND = 5.0

# How long the interpreter's exit waits for the loop's end (the engine releases what is
# still held within its own bound of 1 s; past this the leases lapse by their ttl).
EXIT_BOUND = 3.0


class Call:
    """One coroutine run on the loop for a thread that waits for it, or for a first step
    of it (`reached()`): the thread sleeps on a plain lock, which the loop releases."""

    __slots__ = ("_step", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self._step = _thread.allocate_lock()
        self._step.acquire()

    def start(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` on the loop; the step is reached when it ends (or calls `reached`)."""

        def begin() -> None:
            self.task = self.loop.create_task(coro)
            self.task.add_done_callback(self._ended)

        self.loop.call_soon_threadsafe(begin)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a call whose thread was interrupted logs nothing
        self.reached()

    def reached(self) -> None:
        """On the loop: wake the thread waiting in `wait()` (once per wait)."""
        if self._step.locked():
            self._step.release()

    def wait(self) -> None:
        """In the calling thread: sleep until the step; an interrupt (KeyboardInterrupt, a
        signal handler's exception) cancels the task, waits for its clean-up (bounded), and
        is raised."""
        try:
            self._step.acquire()
        except BaseException:
            self.loop.call_soon_threadsafe(self.cancel)
            self._step.acquire(timeout=CLEANUP_BOUND)
            raise
        # The lock is held again now: armed for the next step.

    def cancel(self) -> None:
        """On the loop: cancel the task (wake the thread at once if it has ended)."""
        if self.task is None:  # not begun yet: `begin` runs before this callback
            return
        if self.task.done():
            self.reached()
        else:
            self.task.cancel()

    def result(self) -> Any:
        """The task's result (it has ended), or its exception raised."""
        assert self.task is not None
        return self.task.result()


class Process:
    """This process's background loop, started on first use."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Future[None] | None = None
        self._lock = threading.Lock()
        self.stopped = False
        # What the sync door keeps per process (the async clients made from sync ones).
        self.state: dict[str, Any] = {}
        # Called on the loop as it ends, after the engine stopped (closing those clients).
        self.at_end: list[Callable[[], Coroutine[Any, Any, Any]]] = []

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            with self._lock:
                if self._loop is None:
                    self._start()
                loop = self._loop
        assert loop is not None
        return loop

    def _start(self) -> None:
        ready = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(ready,), name="aiolocks-sync", daemon=True
        )
        thread.start()
        ready.wait()
        self._thread = thread
        atexit.register(self.stop)

    def _run(self, ready: threading.Event) -> None:
        async def main() -> None:
            loop = self._loop = asyncio.get_running_loop()
            self._stop = loop.create_future()
            ready.set()
            await self._stop
            # What asyncio.run's end does, done here so that the clients close after it:
            # the holders' tasks cancelled (each releases what it holds), then the engine's
            # loop-end watchers closed (they release the rest, bounded, and stop the engine).
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()
            for close in self.at_end:
                with contextlib.suppress(Exception):
                    await close()

        asyncio.run(main())

    def stop(self) -> None:
        """End the loop (at interpreter exit): what is held is released, bounded. The next
        use starts another."""
        self.stopped = True
        loop, thread, stop = self._loop, self._thread, self._stop
        if loop is None or thread is None or stop is None or self.pid != os.getpid():
            return
        if threading.current_thread() is thread:
            raise RuntimeError("aiolocks.sync: the background loop cannot stop itself")
        try:
            loop.call_soon_threadsafe(_finish, stop)
        except RuntimeError:  # closed already
            return
        thread.join(EXIT_BOUND)

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call(self, function: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run `function()` on the loop and wait for its result, from a thread."""
        if self.in_loop_thread():
            raise RuntimeError(
                "aiolocks.sync called from its own background loop (an on_lost callback?): "
                "that would wait for itself; use the asyncio API there"
            )
        call = Call(self.loop)
        call.start(function())
        call.wait()
        result: T = call.result()
        return result


def _finish(stop: asyncio.Future[None]) -> None:
    if not stop.done():
        stop.set_result(None)


_process: Process | None = None
_process_lock = threading.Lock()
# Loops of parent processes a forked child inherited: kept, never used nor closed (closing
# them would touch descriptors the parent still uses; collecting them would warn).
_inherited: list[Process] = []


def process() -> Process:
    """This process's background loop (a forked child gets its own)."""
    global _process
    current = _process
    if current is not None and current.pid == os.getpid() and not current.stopped:
        return current
    with _process_lock:
        if _process is None or _process.pid != os.getpid() or _process.stopped:
            _process = Process()
        return _process


def _after_fork_in_child() -> None:
    global _process, _process_lock
    if _process is not None:
        _inherited.append(_process)
        _process = None
    _process_lock = threading.Lock()  # may have been held by a parent's thread


os.register_at_fork(after_in_child=_after_fork_in_child)


class PerProcess(Generic[T]):
    """An object made afresh in each process that uses it (an asyncio primitive, bound to
    the process's loop and clients): the parent's is never used by a forked child."""

    __slots__ = ("_made", "_make", "_pid")

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made = make()  # at once: the arguments are validated before any Redis call
        self._pid = os.getpid()

    def get(self) -> tuple[T, bool]:
        """(the object, whether it was made afresh for this process just now)."""
        if self._pid == os.getpid():
            return self._made, False
        self._made, self._pid = self._make(), os.getpid()
        return self._made, True
