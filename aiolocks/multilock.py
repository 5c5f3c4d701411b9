"""`RedisMultiLock`: all of several mutex names, or none, for one task at a time.

On a single server a first script takes every name at once when all are free with nobody
queued. Otherwise (and always on Cluster) it is built on the engine as it is: each name is
acquired as a `RedisMutex` would acquire it (same keys, same scripts, same FIFO queue), one
name after the other in one global order (the names sorted by their UTF-8 bytes), so that
multi-locks over overlapping sets, given in any order, cannot deadlock. Each name taken gets
its own lease in the keeper at once; the caller is told of success only when every name is
held, and a failure, timeout or cancellation gives back every name taken so far (shielded,
bounded).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Iterable
from typing import Any, final

from ._base import _clock, _spec
from ._base._clients import AnyRedis, is_cluster
from ._base._errors import LockLost, map_redis_errors
from ._base._keys import DEFAULT_PREFIX, validate_name
from ._base._query import query
from ._base._telemetry import Counters
from ._engine import _acquire, _release
from ._engine._context import ClientContext
from ._engine._leasedlock import LeasedLock
from ._engine._settings import DEFAULT_TTL, LostCallback
from ._leases._keeper import Callbacks, Holding, Lease
from ._scripts import load
from .mutex import MutexInfo, RedisMutex, mutex_spec

__all__ = ["RedisMultiLock"]

_TRY_ALL = load("multi_try")


def _fences(reply: list[Any]) -> list[int] | None:
    """`_TRY_ALL`'s reply decoded: every name's fence, in sorted order, when the token took
    them all ({1, fences...}); None when it took none ({0})."""
    return [int(fence) for fence in reply[1:]] if int(reply[0]) == 1 else None


class _Taken:
    """The names one acquisition holds so far: their fences and leases."""

    __slots__ = ("fences", "holding", "leases", "lost_reason", "unconfirmed")

    def __init__(self) -> None:
        self.fences: dict[str, int] = {}
        self.leases: list[Lease] = []
        self.holding: Holding | None = None  # once every name is held
        self.lost_reason: str | None = None  # a name lost before that
        # The one-script try took every name but answered late: the names are confirmed one
        # by one, and a failure gives them all back (the token may hold any of them).
        self.unconfirmed = False


def _validate_names(names: object) -> tuple[str, ...]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(f"names must be a list of names, not {type(names).__name__}")
    given = tuple(validate_name(name) for name in names)
    if not given:
        raise ValueError("names must not be empty")
    if len(set(given)) != len(given):
        twice = sorted({name for name in given if given.count(name) > 1})
        raise ValueError(f"names must be distinct; given more than once: {twice}")
    return given


def _valid_until(holding: Holding, taken: _Taken | None) -> float | None:
    """Until when `holding` is known valid: until the first of its names' leases ends."""
    if holding.lease is None:
        return None
    leases = [holding.lease] if taken is None else taken.leases
    return min((lease.valid_until for lease in leases), default=holding.lease.valid_until)


def _let_go(taken: _Taken | None) -> None:
    """An acquisition's names are being released (their renewal stopped): each lease lets
    go of its callbacks, which refer to `taken`, which refers to the leases (a cycle the
    garbage collector would otherwise have to find, with the lock and its holding)."""
    for lease in () if taken is None else taken.leases:
        lease.disowned()


def _all_held(results: Iterable[bool | None]) -> bool | None:
    """One release answer for several names: False if any was not held, None if unsure."""
    answers = list(results)
    if False in answers:
        return False
    return None if None in answers else True


@final
class RedisMultiLock(LeasedLock):
    """All of several names at once, or none: the same names and keys as `RedisMutex`.

    - Excludes, and is excluded by, a `RedisMutex` on any of its names, and any other
      multi-lock over an overlapping set.
    - All or none: `acquire()` returns True only when every name is held; a timeout, a
      refusal (`blocking=False`) or a cancellation gives back every name taken so far.
    - No deadlock among multi-locks whatever order their names are given in: every
      multi-lock takes its names in one global order (sorted); on each name it waits in that
      name's FIFO queue, so a stream of single-name holders cannot starve it.
    - One lease per name, renewed together; losing any of them cancels the body with
      `LockLost` naming that name. `fencing_tokens` gives each name's fence.
    - Shared by many tasks and not reentrant, like `RedisMutex`. Free names are taken in
      one atomic script on a single server; otherwise (and on Cluster) name by name, and
      while it waits for a later name it holds the earlier ones (see the docs page).
    """

    _kind = "mutex"  # its keys are the mutexes'

    def __init__(
        self,
        client: AnyRedis,
        names: Iterable[str],
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
        max_hold: float | None = None,
    ) -> None:
        self._given = _validate_names(names)
        self._names = tuple(sorted(self._given, key=str.encode))
        self._taken: dict[str, _Taken] = {}  # by token: acquisitions and holdings
        super().__init__(
            client, self._names[0], ttl=ttl, timeout=timeout, prefix=prefix, on_lost=on_lost,
            max_hold=max_hold,
        )  # fmt: skip
        self._name = ", ".join(self._given)  # for messages

    def _make_spec(self) -> _spec.Spec:
        counters = Counters()  # one instance: one set of counts, whichever name they touch
        self._specs = tuple(mutex_spec(self._prefix, name, counters) for name in self._names)
        return self._specs[0]

    @property
    def names(self) -> tuple[str, ...]:
        """The names, in the order given."""
        return self._given

    @property
    def fencing_tokens(self) -> dict[str, int] | None:
        """Each name's fencing token for the current task's holding (None if it holds
        nothing), in the order the names were given. `fencing_token` is the first one's in
        sorted order."""
        holding = self._current()
        taken = None if holding is None else self._taken.get(holding.token)
        if taken is None:
            return None
        return {name: taken.fences[name] for name in self._given}

    # -- the engine hooks ----------------------------------------------------------------

    async def _acquire_grant(
        self, context: ClientContext, local_handoff: int, blocking: bool, deadline: float | None
    ) -> _spec.Grant | None:
        """Take every name, all or none: at once when all are free (single server), else
        one by one in sorted order, each as a mutex."""
        token = _clock.token_hex(16)
        taken = _Taken()
        grants: list[_spec.Grant] = []
        miss = _spec.Miss(unanswered=False)
        try_bound, deadline = self._try_deadline(blocking, deadline)
        try:
            if not is_cluster(self._client):
                tried = await self._take_all(context, token, taken, deadline)
                if tried is None:  # the deadline passed during the try (nothing is left)
                    self._missed(_spec.Miss(unanswered=True), try_bound, token)
                    return None
                grants = tried
            if not grants:
                for spec in self._specs:
                    with map_redis_errors(spec.name):
                        grant = await _acquire.acquire(
                            context, spec, token, self._ttl_ms,
                            blocking=blocking, deadline=deadline,
                        )  # fmt: skip
                    if isinstance(grant, _spec.Miss):
                        miss = grant
                        break
                    self._took(context, taken, spec, grant)
                    grants.append(grant)
        except BaseException:
            await self._give_back(context, token, taken, deadline)
            raise
        if len(grants) == len(self._specs) and taken.lost_reason is None:
            due = min(lease.next_due for lease in taken.leases)
            for lease in taken.leases:
                lease.due_at(due)  # renewed together from now on: one batch
                context.keeper.hold(lease)  # (held already: the keeper takes the new due)
            self._taken[token] = taken
            return _spec.Grant(token, grants[0].fence, grants[0].granted_at)
        await self._give_back(context, token, taken, deadline)
        if taken.lost_reason is not None:
            raise LockLost(
                self._name, f"lease lost while taking the other names: {taken.lost_reason}",
                token=token,
            )  # fmt: skip
        self._missed(miss, try_bound, token)
        return None

    async def _take_all(
        self, context: ClientContext, token: str, taken: _Taken, deadline: float | None
    ) -> list[_spec.Grant] | None:
        """One script that takes every name if all are free with nobody queued (then the
        grants, in sorted order), else changes nothing (then []); None when `deadline`
        passed first. Answered so late that the leases have less than half their validity
        left (the late-grant check of `_acquire`): [] too, the names then confirmed one by
        one (the mutex script re-arms a name the token holds)."""
        keys = tuple(key for spec in self._specs for key in spec.keys)
        sent_at = _clock.monotonic()

        async def call() -> Any:
            with map_redis_errors(self._name):
                return await context.run(_TRY_ALL, keys, (token, self._ttl_ms))

        in_flight = _release.InFlight(call(), context)
        try:
            reply = await in_flight.reply(deadline)
        except BaseException as exc:
            # The script may have run: give back whatever the token may hold (after its
            # reply), awaited up to the deadline (a little past it), then in the background.
            taken.unconfirmed = True
            await self._give_back(context, token, taken, deadline, in_flight.after())
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                return None
            raise
        fences = _fences(reply)
        if fences is None:
            return []
        if _acquire.late_grant(sent_at, self._ttl_ms):
            taken.unconfirmed = True
            return []
        grants = [_spec.Grant(token, fence, sent_at) for fence in fences]
        for spec, grant in zip(self._specs, grants, strict=True):
            self._took(context, taken, spec, grant)
        return grants

    def _took(
        self, context: ClientContext, taken: _Taken, spec: _spec.Spec, grant: _spec.Grant
    ) -> None:
        """`grant` holds `spec`'s name: its lease goes to the keeper at once."""
        owner = Callbacks(
            functools.partial(self._name_lost, context, taken, spec, grant.token),
            functools.partial(_release.release, context, spec, grant.token, self._ttl_ms),
        )
        lease = Lease(
            spec.renew, spec.renew_keys, (grant.token, self._ttl_ms), self._ttl,
            grant.granted_at, owner,
        )  # fmt: skip
        context.keeper.hold(lease)
        taken.leases.append(lease)
        taken.fences[spec.name] = grant.fence

    async def _give_back(
        self,
        context: ClientContext,
        token: str,
        taken: _Taken,
        deadline: float | None,
        after: Awaitable[Any] | None = None,
    ) -> None:
        """Release every name `token` may hold, awaited until a little past `deadline` (or up
        to CLEANUP_BOUND without one), then in the background, as `_release.withdraw`; after
        `after` (the reply of its call in flight)."""
        for lease in taken.leases:
            context.keeper.drop(lease)
        taken.leases.clear()
        specs = [spec for spec in self._specs if taken.unconfirmed or spec.name in taken.fences]
        taken.fences.clear()
        taken.unconfirmed = False
        if specs:
            until = None if deadline is None else max(deadline, _clock.monotonic()) + _release.GRACE
            await _release.withdraw(
                context, specs[0], token, self._ttl_ms, until,
                call=functools.partial(self._release_all, context, specs, token), after=after,
            )  # fmt: skip

    def _hold(self, context: ClientContext, task: asyncio.Task[Any], grant: _spec.Grant) -> None:
        taken = self._taken[grant.token]
        holding = self._install(task, grant.token, grant.fence, taken.leases[0])
        taken.holding = holding
        self._cap(context, holding, grant.granted_at)

    def _name_lost(
        self, context: ClientContext, taken: _Taken, spec: _spec.Spec, token: str, reason: str
    ) -> None:
        """The keeper lost one name's lease: the holder is told (now, or when it holds), and
        that name's token given back at once (`_release.give_back_lost`)."""
        _release.give_back_lost(context, spec, token, self._ttl_ms)
        reason = f"{spec.name!r}: {reason}"
        if taken.holding is None:
            taken.lost_reason = taken.lost_reason or reason
        elif not taken.holding.is_lost:
            self._lease_lost(taken.holding, reason)

    def _stop_renewal(self, context: ClientContext, holding: Holding) -> None:
        taken = self._taken.get(holding.token)
        for lease in () if taken is None else taken.leases:
            context.keeper.drop(lease)

    async def _release_all(
        self, context: ClientContext, specs: Iterable[_spec.Spec], token: str
    ) -> bool | None:
        calls = (_release.release(context, spec, token, self._ttl_ms) for spec in specs)
        return _all_held(await asyncio.gather(*calls))

    async def _release_call(self, context: ClientContext, token: str) -> bool | None:
        _let_go(self._taken.pop(token, None))
        return await self._release_all(context, self._specs, token)

    async def _release_surely(
        self, context: ClientContext, holding: Holding
    ) -> bool | _release.Unanswered | None:
        # Bounded by the validity of its leases, as a mutex's release: by the first to end
        # (the names are held together only while all are valid; their renewals are
        # aligned, but not before the first batch is answered: a name whose grant came
        # late has a shorter validity than one renewed just before). Not renewed meanwhile
        # (one release call per name).
        self._stop_renewal(context, holding)
        token = holding.token
        taken = self._taken.pop(token, None)
        until = _valid_until(holding, taken)
        _let_go(taken)
        call = functools.partial(self._release_all, context, self._specs, token)
        if until is None:
            return await _release.completed(call())
        return await _release.release_until(
            context, self._specs[0], token, self._ttl_ms, until, call
        )

    # -- what the server says ------------------------------------------------------------

    @query
    async def locked(self) -> bool:
        """True if anyone holds any of the names right now (asks Redis)."""
        with map_redis_errors(self._name):
            pipe = self._client.pipeline(transaction=False)
            for spec in self._specs:
                pipe.exists(spec.keys[0])
            return any(await pipe.execute())

    async def inspect(self) -> dict[str, MutexInfo]:
        """Each name's `MutexInfo` (holder, lease left, queue length, last fence)."""
        return {
            name: await RedisMutex(self._client, name, prefix=self._prefix).inspect()
            for name in self._given
        }
