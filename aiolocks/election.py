"""`RedisElection`: leader election on Redis (campaign, proclaim, resign, leader, observe).

A campaign is a mutex acquisition whose holder is the leader: the same engine queues the
candidates (FIFO), renews the leader's lease and reports its loss. The election's scripts
also store the leader's value and announce every change on the election's channel, which
`observe()` follows through the engine's notifier (the last section, "Observing").

Observing: Watching an election without polling: one `Hub` per (client, election) in a process.

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
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, final

from ._base import _clock, _spec
from ._base._adapter import text
from ._base._clients import AnyRedis
from ._base._errors import REDIS_ERRORS, LockLost, ServerUnavailable, map_redis_errors, retrieved
from ._base._keys import DEFAULT_PREFIX, KeySpace
from ._engine._context import ClientContext, context_for
from ._engine._leasedlock import LeasedLock
from ._engine._settings import DEFAULT_TTL, LostCallback
from ._leases._keeper import Holding
from ._scripts import load
from ._waiting._notifier import Hint

__all__ = ["ElectionInfo", "LeaderInfo", "RedisElection", "Term"]

log = logging.getLogger("aiolocks")

_ACQUIRE = load("election_acquire", "election")
_RELEASE = load("election_release", "election")
_RENEW = load("election_renew")
_PROCLAIM = load("election_proclaim", "election")
_INSPECT = load("election_inspect")

# A value is stored with the leader and carried by every message about it.
MAX_VALUE_BYTES = 65536


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The leader of an election: its value, its term's fencing token, and how long its
    lease lasts from now at the latest (it is renewed while the leader lives)."""

    value: str
    fencing_token: int
    lease_remaining: float  # seconds


@dataclass(frozen=True, slots=True)
class ElectionInfo:
    """What the server says about an election (from `RedisElection.inspect()`)."""

    name: str
    leader: str | None  # token of the leader
    value: str | None  # the leader's value
    term: int | None  # the leader's fencing token
    lease_remaining_ms: int | None  # of the leader
    candidates: int  # candidates queued (live or not yet purged)
    fence: int  # the last fencing token handed out (0: nobody was ever elected)


def _validate_value(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"value must be a str, not {type(value).__name__}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"value must be encodable as UTF-8: {exc.reason}") from None
    if size > MAX_VALUE_BYTES:
        raise ValueError(f"value is too long: {size} bytes in UTF-8, at most {MAX_VALUE_BYTES}")
    return value


class _Candidacy(LeasedLock):
    """One campaign: a lease on the election's leader key, with the value it runs on."""

    _kind = "election"

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        value: str,
        *,
        ttl: float,
        timeout: float | None,
        prefix: str,
        on_lost: LostCallback | None,
    ) -> None:
        self._value = _validate_value(value)
        super().__init__(client, name, ttl=ttl, timeout=timeout, prefix=prefix, on_lost=on_lost)

    def _make_spec(self) -> _spec.Spec:
        keys = KeySpace(self._prefix, self._kind, self._name)
        leader, queue, waiters, fence, candidates = (
            keys.key(part) for part in ("leader", "queue", "waiters", "fence", "candidates")
        )
        return _spec.Spec(
            name=self._name,
            side="x",
            keys=(leader, queue, waiters, fence, candidates),
            # A candidate's value lives as long as its queue entry.
            heartbeat_keys=(waiters, queue, candidates),
            channel=keys.key("wake"),
            watch_key=leader,
            acquire=_ACQUIRE,
            release=_RELEASE,
            renew=_RENEW,
            renew_keys=(leader, fence),
            args=(self._value,),
        )


@final
class Term:
    """One leadership term, from `async with election.campaign(value) as term`.

    If the lease is lost, the `async with` body is cancelled and `LockLost` raised, as for
    every lock of aiolocks; `lost` is set at the same moment.
    """

    __slots__ = ("_candidacy", "_holding", "value")

    def __init__(self, candidacy: _Candidacy, holding: Holding) -> None:
        self._candidacy = candidacy
        self._holding = holding
        self.value = candidacy._value  # the value this term proclaimed last

    @property
    def fencing_token(self) -> int:
        """This term's fencing token: strictly increasing from one term to the next."""
        return self._holding.fence

    @property
    def lost(self) -> asyncio.Event:
        """Set when the leadership is lost (the lease ended or was taken)."""
        return self._holding.lost

    async def proclaim(self, value: str) -> None:
        """Publish a new value for this term, keeping the leadership: `leader()` returns it
        and observers see it. `LockLost` if this term is over."""
        value = _validate_value(value)
        candidacy = self._candidacy
        spec = candidacy._spec
        args = (self._holding.token, spec.channel, value)
        with map_redis_errors(candidacy.name):
            reply = await context_for(candidacy._client).run(_PROCLAIM, spec.keys[:1], args)
        if int(reply[0]) != 1:
            raise LockLost(candidacy.name, "not the leader any more", token=self._holding.token)
        self.value = value

    async def resign(self) -> None:
        """End the term now (from the task that campaigned): the next candidate is elected
        at once. Leaving the `async with` block afterwards does nothing more."""
        await self._candidacy.release()

    def __repr__(self) -> str:
        return f"<Term {self._candidacy.name!r} fence={self.fencing_token} value={self.value!r}>"


class _Campaign(AbstractAsyncContextManager[Term]):
    __slots__ = ("_candidacy",)

    def __init__(self, candidacy: _Candidacy) -> None:
        self._candidacy = candidacy

    async def __aenter__(self) -> Term:
        candidacy = self._candidacy
        await candidacy.__aenter__()
        holding = candidacy._current()
        assert holding is not None
        return Term(candidacy, holding)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._candidacy.__aexit__(exc_type, exc, tb)


@final
class RedisElection:
    """Leader election: of the processes campaigning under one name, one leads at a time.

    - `campaign(value)` waits until elected; candidates are elected in the order they
      campaigned (FIFO, across processes). The leader holds a lease renewed in the
      background; if it is lost, the `async with` body is cancelled and `LockLost` raised.
      Leaving the block resigns, and the next candidate is elected at once.
    - Every term has a fencing token, strictly increasing from one term to the next.
    - `leader()` asks who leads; `observe()` follows every change without polling.
    """

    __slots__ = ("_probe",)

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
    ) -> None:
        # Validates every argument now, and gives the keys, channel and client.
        self._probe = _Candidacy(
            client, name, "", ttl=ttl, timeout=None, prefix=prefix, on_lost=on_lost
        )

    @property
    def name(self) -> str:
        return self._probe.name

    @property
    def ttl(self) -> float:
        return self._probe.ttl

    def __repr__(self) -> str:
        return f"<RedisElection {self.name!r} ttl={self.ttl:g}>"

    def campaign(
        self, value: str, *, timeout: float | None = None
    ) -> AbstractAsyncContextManager[Term]:
        """`async with election.campaign(value) as term:` runs the body as the leader.

        Waits until elected (FIFO among candidates); `LockTimeout` if not within `timeout`
        seconds (`timeout=0`: one try). The task that entered the block owns the term.
        """
        probe = self._probe
        candidacy = _Candidacy(
            probe._client, probe.name, value, ttl=probe.ttl, timeout=timeout,
            prefix=probe._prefix, on_lost=probe._on_lost,
        )  # fmt: skip
        return _Campaign(candidacy)

    async def _inspect(self) -> list[Any]:
        with map_redis_errors(self.name):
            reply: list[Any] = await context_for(self._probe._client).run(
                _INSPECT, self._probe._spec.keys, ()
            )
        return reply

    async def _state(self) -> State:
        token, value, term, pttl, rev, last, _, clock = await self._inspect()
        if token is None or int(pttl) == -2:
            # Vacant now: after every term granted so far (at most the counter, or the
            # clock once it expired) and before any to come (above both: grant_fence).
            return State(None, "", max(int(last), int(clock)), 0, 0.0)
        lease_end = _clock.monotonic() + max(0, int(pttl)) / 1000
        return State(text(token), text(value or b""), int(term), int(rev), lease_end)

    async def leader(self) -> LeaderInfo | None:
        """Who leads now (asks Redis): None while vacant."""
        state = await self._state()
        return None if state.token is None else LeaderInfo(**info_fields(state))

    async def inspect(self) -> ElectionInfo:
        """The server's view: leader, value, term, lease left, candidates, last fence."""
        token, value, term, pttl, _, last, queued, _ = await self._inspect()
        held = token is not None and int(pttl) != -2
        return ElectionInfo(
            name=self.name,
            leader=text(token) if held else None,
            value=text(value or b"") if held else None,
            term=int(term) if held else None,
            lease_remaining_ms=max(0, int(pttl)) if held else None,
            candidates=int(queued),
            fence=int(last),
        )

    def observe(self) -> AsyncIterator[LeaderInfo | None]:
        """The current leader (None while vacant) first, then every change, in order:
        elected, proclaimed, resigned, lease ended. Never polls: it wakes on the election's
        messages, keyspace events and a timer at the leader's lease end. After the
        subscription was lost and is back, the current state is shown again.
        """
        return _Observation(self)


class _Observation:
    """`RedisElection.observe()`: an async iterator; stops being fed when closed or dropped."""

    __slots__ = ("__weakref__", "_closed", "_election", "_hub", "_observer")

    def __init__(self, election: RedisElection) -> None:
        self._election = election
        self._observer = Observer()
        self._hub: Hub | None = None
        self._closed = False

    def __aiter__(self) -> _Observation:
        return self

    async def __anext__(self) -> LeaderInfo | None:
        if self._closed:
            raise StopAsyncIteration
        if self._hub is None:
            probe = self._election._probe
            spec = probe._spec
            context = context_for(probe._client)
            assert spec.watch_key is not None
            hub = hub_for(context, spec.channel, spec.watch_key, self._election._state)
            await hub.join(self._observer)  # on failure it has left the hub
            self._hub = hub
        state = await self._observer.next()
        return None if state.token is None else LeaderInfo(**info_fields(state))

    async def aclose(self) -> None:
        """Stop observing (also done when the iterator is dropped)."""
        self._closed = True
        self._leave()

    def _leave(self) -> None:
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.leave(self._observer)

    def __del__(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop any more: the notifier went with it
            self._leave()


# -- observing: one hub per client and election ----------------------------------------

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
            lease_end = _clock.monotonic() + int(parts[2]) / 1000
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


def hubs_of(context: ClientContext) -> dict[bytes, Hub]:
    """The election hubs of `context`, by channel; stopped when the engine stops on it."""
    hubs: dict[bytes, Hub] = context.keep("election hubs", dict, _stop_hubs)
    return hubs


def hub_for(context: ClientContext, channel: bytes, watch_key: bytes, read: Read) -> Hub:
    """The hub of the election whose channel is `channel`, on `context` (made on first use)."""
    hubs = hubs_of(context)
    hub = hubs.get(channel)
    if hub is None or hub.closed:
        hub = hubs[channel] = Hub(context, channel, watch_key, read)
    return hub


def _stop_hubs(hubs: dict[bytes, Hub]) -> None:
    """The engine stopped on the hubs' client: none arms a timer or reads any more."""
    stopping = list(hubs.values())
    hubs.clear()
    for hub in stopping:
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
            self._started.add_done_callback(retrieved)
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
        hubs = hubs_of(self._context)
        if hubs.get(self._channel) is self:
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
        delay = max(0.0, at - _clock.monotonic()) + _MARGIN
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
        "lease_remaining": max(0.0, state.lease_end - _clock.monotonic()),
    }
