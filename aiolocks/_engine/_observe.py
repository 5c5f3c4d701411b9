"""Watching an election without polling: one `Hub` per (client, election) in a process.

A hub holds one reference to the election's channel in the engine's notifier (so many
observers share one subscription) and keeps the last known state. It learns of changes from
the messages the election's scripts publish (each carries the new state, so a burst of
changes is seen in order, without a read), from keyspace events on the leader key, from the
notifier's re-syncs (after a reconnect: re-read, and every observer is shown the state
again), and from one timer at the leader's lease end (a crashed leader publishes nothing).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._base._errors import REDIS_ERRORS, ServerUnavailable
from .._waiting._notifier import Hint
from ._context import ClientContext

__all__ = ["Hub", "Observer", "State", "hub_for", "parse_message"]

log = logging.getLogger("aiolocks")

# A read of the state that failed: the server, or the link to it.
_FAILED: tuple[type[Exception], ...] = (ServerUnavailable, *REDIS_ERRORS, OSError)
# After the lease end, the read waits this much more: the server must see it ended too.
_MARGIN = 0.005
_RETRY_MIN, _RETRY_MAX = 0.05, 2.0


@dataclass(frozen=True, slots=True)
class State:
    """An election's state as last seen: a leader (token set) or vacant (token None)."""

    token: str | None
    value: str
    fence: int  # the leader's term; when vacant, a number at or above the last term
    rev: int  # proclamations in this term
    lease_end: float  # monotonic; 0 when vacant

    @property
    def order(self) -> tuple[int, float]:
        """States of one election in the order they happened: terms rise, proclamations
        count up within a term, and a term's end (vacancy) follows all of it."""
        return (self.fence, math.inf if self.token is None else self.rev)

    def same(self, other: State) -> bool:
        """Nothing to show between the two: the same leader and value, or both vacant."""
        if self.token is None:
            return other.token is None
        return (self.token, self.value, self.fence) == (other.token, other.value, other.fence)


def parse_message(payload: bytes) -> State | None:
    """The state an election's message announces (see `_scripts/_election.lua`)."""
    parts = payload.split(b" ", 5)
    try:
        if len(parts) == 4 and parts[0] == b"-" and parts[3] == b"V":
            return State(None, "", int(parts[1]), 0, 0.0)
        if len(parts) >= 5 and parts[3] == b"L":
            value = parts[5].decode() if len(parts) == 6 else ""
            lease_end = time.monotonic() + int(parts[2]) / 1000
            return State(parts[0].decode(), value, int(parts[1]), int(parts[4]), lease_end)
    except (ValueError, UnicodeDecodeError):
        pass
    return None


Read = Callable[[], Awaitable[State]]


class Observer:
    """One `observe()` iteration: the states it has yet to yield, in order."""

    __slots__ = ("__weakref__", "_pending", "_wakeup", "last")

    def __init__(self) -> None:
        self._pending: collections.deque[State] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self.last: State | None = None

    def offer(self, state: State, again: bool) -> None:
        """Queue `state` if it is a change (or `again`: show it even if it is not)."""
        if not again and self.last is not None and state.same(self.last):
            return
        self._pending.append(state)
        self.last = state
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def next(self) -> State:
        while not self._pending:
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        return self._pending.popleft()


_hubs: weakref.WeakKeyDictionary[ClientContext, dict[bytes, Hub]] = weakref.WeakKeyDictionary()


def hub_for(context: ClientContext, channel: bytes, watch_key: bytes, read: Read) -> Hub:
    """The hub of the election whose channel is `channel`, on `context` (made on first use)."""
    hubs = _hubs.get(context)
    if hubs is None:
        hubs = _hubs[context] = {}
        context.on_stop.append(functools.partial(_stop_hubs, context))
    hub = hubs.get(channel)
    if hub is None or hub.closed:
        hub = hubs[channel] = Hub(context, channel, watch_key, read)
    return hub


def _stop_hubs(context: ClientContext) -> None:
    """The engine stopped on `context`: no hub of it arms a timer or reads any more."""
    for hub in list(_hubs.pop(context, {}).values()):
        hub.stop()


class Hub:
    """The observers of one election in one process, and the state they are shown."""

    def __init__(self, context: ClientContext, channel: bytes, watch_key: bytes, read: Read):
        self._context = context
        self._channel = channel
        self._watch_key = watch_key
        self._read = read
        self._observers: list[Observer] = []
        self.state: State | None = None
        self.closed = False
        self._started: asyncio.Future[None] | None = None
        self._retained = False
        self._timer: asyncio.TimerHandle | None = None
        self._reading: asyncio.Task[None] | None = None
        self._again: bool | None = None  # re-read after the current read (True: re-show)
        self._retry = _RETRY_MIN

    async def join(self, observer: Observer) -> None:
        """Add `observer`; it is offered the current state (read first if none is known).
        The first read's failure (`ServerUnavailable`) is raised, and the observer left."""
        self._observers.append(observer)
        if self.state is not None:
            observer.offer(self.state, again=False)
            return
        if self._started is None or (self._started.done() and self.state is None):
            self._started = asyncio.ensure_future(self._start())
            # Its failure is read even when every observer left before it ended (a Ctrl-C
            # while the first read waits): no "exception was never retrieved" at exit.
            self._started.add_done_callback(_retrieve)
        try:
            await asyncio.shield(self._started)
        except BaseException:
            self.leave(observer)
            raise

    async def _start(self) -> None:
        notifier = self._context.notifier
        try:
            if not self._retained:
                notifier.listen(self._channel, self._hint)
                await notifier.retain(self._channel, self._watch_key)
                self._retained = True
            if not self.closed:
                self._apply(await self._read(), again=False)
        finally:
            if self.closed:  # everyone left meanwhile
                self._close()

    def leave(self, observer: Observer) -> None:
        with contextlib.suppress(ValueError):
            self._observers.remove(observer)
        if not self._observers and not self.closed:
            self.closed = True
            if self._started is not None and not self._started.done():
                return  # `_start` closes it once its subscription is in place
            self._close()

    def stop(self) -> None:
        """The engine stopped: end its timer and its read (its observers see no more)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._reading is not None:
            self._reading.cancel()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._reading is not None:
            self._reading.cancel()
        self._context.notifier.unlisten(self._channel, self._hint)
        if self._retained:
            self._retained = False
            self._context.notifier.release(self._channel)
        hubs = _hubs.get(self._context)
        if hubs is not None and hubs.get(self._channel) is self:
            del hubs[self._channel]

    # -- what changes the state --------------------------------------------------------

    def _hint(self, hint: Hint, payload: bytes) -> None:
        if self.closed:
            return
        if hint is Hint.MESSAGE:
            state = parse_message(payload)
            if state is not None:
                self._apply(state, again=False)
                return
        self._refresh(again=hint is Hint.RESYNC)

    def _apply(self, state: State, again: bool) -> None:
        if self.state is None or state.order > self.state.order:
            self.state = state
        elif state.order == self.state.order and state.token is not None:
            self.state = state  # the same term, a fresher lease end (a re-read)
        current = self.state
        for observer in list(self._observers):
            observer.offer(current, again)
        self._arm(current.lease_end if current.token is not None else None)

    def _arm(self, at: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if at is None or self.closed or self._context.closed:
            return  # nothing to watch, or the engine has stopped (its loop is ending)
        loop = asyncio.get_running_loop()
        delay = max(0.0, at - time.monotonic()) + _MARGIN
        self._timer = loop.call_later(delay, self._refresh, False)

    def _refresh(self, again: bool) -> None:
        """Read the state (one read at a time; a hint meanwhile makes one more)."""
        if self.closed:
            return
        if self._reading is not None and not self._reading.done():
            self._again = bool(self._again) or again
            return
        self._reading = asyncio.get_running_loop().create_task(self._reread(again))

    async def _reread(self, again: bool) -> None:
        while True:
            try:
                state = await self._read()
            except _FAILED as exc:
                # Unreachable for now: try again after a back-off (the notifier's re-sync
                # after its reconnect usually comes first), and show the state again then.
                log.debug("aiolocks: reading election %r failed: %r", self._channel, exc)
                if self.closed or self._context.closed:
                    return  # nobody to tell, or the engine has stopped: no retry timer
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self._retry, self._refresh, True)
                self._retry = min(self._retry * 2, _RETRY_MAX)
                return
            self._retry = _RETRY_MIN
            self._apply(state, again)
            if self._again is None:
                return
            again, self._again = self._again, None


def info_fields(state: State) -> dict[str, Any]:
    """`LeaderInfo` fields of a leader state, the lease counted from now."""
    return {
        "value": state.value,
        "fencing_token": state.fence,
        "lease_remaining": max(0.0, state.lease_end - time.monotonic()),
    }


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()
