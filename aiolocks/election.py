"""`RedisElection`: leader election on Redis (campaign, proclaim, resign, leader, observe).

A campaign is a mutex acquisition whose holder is the leader: the same engine queues the
candidates (FIFO), renews the leader's lease and reports its loss. The election's scripts
also store the leader's value and announce every change on the election's channel, which
`observe()` follows through the engine's notifier (see `_observe.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, final

from ._base import _spec
from ._base._clients import AnyRedis
from ._base._errors import LockLost, map_redis_errors
from ._base._keys import DEFAULT_PREFIX, KeySpace
from ._engine._context import context_for
from ._engine._leasedlock import LeasedLock
from ._engine._observe import Hub, Observer, State, hub_for, info_fields
from ._engine._settings import DEFAULT_TTL, LostCallback
from ._leases._keeper import Holding
from ._scripts import load

__all__ = ["ElectionInfo", "LeaderInfo", "RedisElection", "Term"]

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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
            kind="x",
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

    async def _state(self) -> State:
        spec = self._probe._spec
        with map_redis_errors(self.name):
            reply = await context_for(self._probe._client).run(_INSPECT, spec.keys, ())
        token, value, term, pttl, rev, last, _, clock = reply
        if token is None or int(pttl) == -2:
            # Vacant now: after every term granted so far (at most the counter, or the
            # clock once it expired) and before any to come (above both: grant_fence).
            return State(None, "", max(int(last), int(clock)), 0, 0.0)
        lease_end = time.monotonic() + max(0, int(pttl)) / 1000
        return State(_text(token), _text(value or b""), int(term), int(rev), lease_end)

    async def leader(self) -> LeaderInfo | None:
        """Who leads now (asks Redis): None while vacant."""
        state = await self._state()
        return None if state.token is None else LeaderInfo(**info_fields(state))

    async def inspect(self) -> ElectionInfo:
        """The server's view: leader, value, term, lease left, candidates, last fence."""
        spec = self._probe._spec
        with map_redis_errors(self.name):
            reply = await context_for(self._probe._client).run(_INSPECT, spec.keys, ())
        token, value, term, pttl, _, last, queued, _ = reply
        held = token is not None and int(pttl) != -2
        return ElectionInfo(
            name=self.name,
            leader=_text(token) if held else None,
            value=_text(value or b"") if held else None,
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
