"""`SyncLock`: a leased lock of the asyncio API (mutex, semaphore, read-write side) for
threads.

Each acquisition is one task on the background loop (`_runner.py`), the *holder*: it
acquires through the asyncio primitive, wakes the thread at the grant, then waits for the
thread's release and releases, in that same task. So the holding belongs to one task, as
the asyncio API wants, and the thread that acquired is recorded as its owner: another
thread's `release()` gets `LockNotOwned`. A lost lease cannot cancel a thread's body: its
`lost` (a `threading.Event`) is set, `on_lost` is called (on the background loop's thread),
and the release at the end raises `LockLost`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, Generic, ParamSpec, Protocol, Self, TypeVar

from .. import LockLost, LockNotOwned, LockReentry, LockStatistics, LockTimeout
from ._clients import SyncClient, validate_client
from ._runner import Call, PerProcess, process

__all__ = ["LeasedLock", "LostCallback", "SyncLock"]

log = logging.getLogger("aiolocks")

P = ParamSpec("P")
R = TypeVar("R")


class LeasedLock(Protocol):
    """What the sync door uses of an asyncio leased lock (RedisMutex, RedisSemaphore, a
    read-write lock's side): its public API only."""

    @property
    def name(self) -> str: ...

    @property
    def fencing_token(self) -> int | None: ...

    @property
    def lost(self) -> asyncio.Event: ...

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool: ...

    async def release(self) -> None: ...

    async def locked(self) -> bool: ...

    def statistics(self) -> LockStatistics: ...


L = TypeVar("L", bound=LeasedLock)

LostCallback = Callable[[LockLost], object]


class _Holder:
    """One thread's acquisition, held by its holder task on the loop."""

    __slots__ = ("async_lost", "call", "fence", "lost", "release_request")

    def __init__(self, call: Call) -> None:
        self.call = call
        self.fence: int | None = None
        self.lost = threading.Event()
        self.async_lost: asyncio.Event | None = None
        self.release_request: asyncio.Future[None] | None = None  # set: granted


class SyncLock(Generic[L]):
    """Base of the sync door's leased locks: acquisitions owned by the thread that made
    them, through the asyncio primitive `L`."""

    def __init__(
        self, client: SyncClient, name: str, timeout: float | None, on_lost: LostCallback | None
    ) -> None:
        validate_client(client)
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        self._client = client
        self._on_lost = on_lost
        self._timeout = timeout
        self._other: SyncLock[Any] | None = None  # a read-write lock's other side
        self._held: dict[int, _Holder] = {}  # by thread
        self._live: set[_Holder] = set()  # granted, not yet released (on the loop only)
        self._async: PerProcess[L] = PerProcess(self._build)
        self._name: str = self._async.get()[0].name

    def _build(self) -> L:
        """The asyncio primitive of this process (validating every argument)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<aiolocks.sync.{type(self).__name__} {self._name!r}>"

    def _lock(self) -> L:
        lock, fresh = self._async.get()
        if fresh:  # a forked child: nothing of the parent's is held here
            self._held, self._live = {}, set()
        return lock

    # -- acquire / release -------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquire for the current thread; False if not blocking and busy, or on timeout.

        Raises `LockReentry` if the thread holds it already. Ctrl-C (or any exception a
        signal handler raises) while waiting withdraws the queued entry before it is raised.
        """
        lock = self._lock()
        thread = threading.get_ident()
        if thread in self._held:
            raise LockReentry(self._name, "the current thread already holds it (not reentrant)")
        if self._other is not None and thread in self._other._held:
            raise LockReentry(
                self._name, "the current thread holds the other side (that would deadlock)"
            )
        runner = process()
        if runner.in_loop_thread():
            raise RuntimeError(
                "aiolocks.sync called from its own background loop (an on_lost callback?): "
                "that would wait for itself"
            )
        call = Call(runner.loop)
        holder = _Holder(call)
        call.start(self._hold(lock, holder, blocking, timeout))
        try:
            call.wait()
            if holder.release_request is None:  # not granted: the holder ended
                return bool(call.result())
            self._held[thread] = holder
        except BaseException:
            # An interrupt raised just as the grant came (after the wait itself): the
            # holding would have no owner; the holder, cancelled, releases it.
            if holder.release_request is not None and self._held.get(thread) is not holder:
                call.loop.call_soon_threadsafe(call.cancel)
            raise
        return True

    async def _hold(self, lock: L, holder: _Holder, blocking: bool, timeout: float | None) -> bool:
        """The holder task: acquire, wake the thread, wait for its release, release."""
        if not await lock.acquire(blocking, timeout):
            return False
        holder.fence = lock.fencing_token
        holder.async_lost = lost = lock.lost
        if lost.is_set():
            holder.lost.set()
        holder.release_request = asyncio.get_running_loop().create_future()
        self._live.add(holder)
        holder.call.reached()
        try:
            await holder.release_request
        finally:
            self._live.discard(holder)
            await lock.release()
        return True

    def release(self) -> None:
        """Release the current thread's holding.

        Raises `LockNotOwned` if the thread holds nothing (another thread's holding is
        never released), and `LockLost` if the lease had been lost meanwhile.
        """
        self._lock()
        holder = self._held.pop(threading.get_ident(), None)
        if holder is None:
            raise LockNotOwned(self._name, "the current thread does not hold it")
        call = holder.call
        request = holder.release_request
        assert request is not None and call.task is not None
        if not call.task.done():  # done: the loop ended at interpreter exit
            call.loop.call_soon_threadsafe(_answer, request)
            call.wait()
        call.result()

    # -- the current thread's holding --------------------------------------------------

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the current thread's holding (None if it holds nothing)."""
        holder = self._held.get(threading.get_ident())
        return None if holder is None else holder.fence

    @property
    def lost(self) -> threading.Event:
        """Set when the current thread's lease is lost (LockNotOwned if none held)."""
        holder = self._held.get(threading.get_ident())
        if holder is None:
            raise LockNotOwned(self._name, "the current thread does not hold it")
        return holder.lost

    def held(self) -> bool:
        """True if the current thread holds it (a local check, no Redis call)."""
        self._lock()
        return threading.get_ident() in self._held

    def statistics(self) -> LockStatistics:
        """A cheap local snapshot (the lease's time left is the holder task's: None)."""
        lock = self._lock()
        stats: LockStatistics = process().call(_statistics_of(lock))
        holder = self._held.get(threading.get_ident())
        return replace(stats, lost=holder is not None and holder.lost.is_set())

    def locked(self) -> bool:
        """True if anyone holds it right now (asks Redis)."""
        lock = self._lock()
        return process().call(lock.locked)

    # -- loss --------------------------------------------------------------------------

    def _match(self, error: LockLost) -> bool:
        """On the loop: set the `lost` event of the holding `error` reports, if it is one
        of this lock's (the asyncio primitive has just marked it lost)."""
        for holder in list(self._live):
            lost = holder.async_lost
            if lost is not None and lost.is_set() and not holder.lost.is_set():
                holder.lost.set()
                return True
        return False

    def _reported(self, error: LockLost) -> None:
        """The asyncio primitive's `on_lost`."""
        self._match(error)
        self._call_on_lost(error)

    def _call_on_lost(self, error: LockLost) -> None:
        if self._on_lost is None:
            return
        try:
            self._on_lost(error)
        except Exception:
            log.exception("aiolocks: on_lost callback of %r failed", self._name)

    # -- with and decorator ------------------------------------------------------------

    def __enter__(self) -> Self:
        if not self.acquire(timeout=self._timeout):
            assert self._timeout is not None
            raise LockTimeout(self._name, self._timeout)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if threading.get_ident() not in self._held:
            return  # released inside the body already
        try:
            self.release()
        except LockLost as lost:
            if exc is not None:
                raise lost from exc
            raise lost from None

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Use the instance as a decorator: each call of `func` runs holding it."""

        @functools.wraps(func)
        def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return func(*args, **kwargs)

        return locked_call


def _answer(request: asyncio.Future[None]) -> None:
    if not request.done():
        request.set_result(None)


def _statistics_of(lock: LeasedLock) -> Callable[[], Any]:
    async def read() -> LockStatistics:
        return lock.statistics()

    return read
