"""LockCore: what every leased lock keeps, and the hooks each primitive overrides.

An instance may be shared by many tasks, like `asyncio.Lock`: each acquisition is its own
`Holding`, owned by the task that made it. This class keeps an instance's settings and its
holdings by task, and a holding's life here: its lease given to the keeper, capped at
`max_hold`, and reported when lost (the `async with` body cancelled, `on_lost` called).
`LeasedLock` (`_leasedlock.py`) builds the public calls on it; the hooks (`_make_spec`,
`_hold`, `_release_call`, ...) are where a primitive such as the multi-lock differs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .._base import _spec, _telemetry
from .._base._clients import AnyRedis, ensure_async_client
from .._base._errors import LockLost, LockNotOwned
from .._base._keys import DEFAULT_PREFIX, validate_name, validate_prefix
from .._leases._lease import Lease, LeaseOwner
from .._scripts import Script
from . import _release
from ._context import ClientContext
from ._holding import Holding, current_task
from ._settings import (
    DEFAULT_REPLICA_TIMEOUT,
    DEFAULT_TTL,
    LostCallback,
    validate_max_hold,
    validate_replica_timeout,
    validate_replicas,
    validate_timeout,
    validate_ttl,
)

__all__ = ["LockCore"]

log = logging.getLogger("aiolocks")


class LockCore:
    """An instance's settings, its holdings by task, and the engine hooks."""

    _kind = "lock"
    _local_handoff = 0  # > 0: tasks of this process pass the lease on (see _cohort.py)
    _handle_kind = ""  # the `LockHandle.kind` of its holdings (see detach / adopt)

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        max_hold: float | None = None,
    ) -> None:
        self._client = ensure_async_client(client)
        self._name = validate_name(name)
        self._prefix = validate_prefix(prefix)
        self._ttl = validate_ttl(ttl)
        self._ttl_ms = max(1, round(self._ttl * 1000))
        self._timeout = validate_timeout(timeout)
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        self._on_lost = on_lost
        self._replicas = validate_replicas(replicas, self._client)
        self._replica_timeout_ms = validate_replica_timeout(replica_timeout)
        self._max_hold = validate_max_hold(max_hold)
        if self._max_hold is not None and self._local_handoff:
            # A cohort's lease outlives each local holding; capping one would end the chain.
            raise ValueError("max_hold cannot be combined with local_handoff")
        self._holdings: dict[asyncio.Task[Any], Holding] = {}
        self._waiting = 0
        self._spec = self._make_spec()

    @property
    def name(self) -> str:
        return self._name

    @property
    def ttl(self) -> float:
        return self._ttl

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"<{kind} {self._name!r} ttl={self._ttl:g} held_here={len(self._holdings)}>"

    # -- the hooks a primitive overrides -------------------------------------------------

    def _make_spec(self) -> _spec.Spec:
        raise NotImplementedError

    def _adopt_call(self) -> tuple[Script, tuple[bytes, ...]]:
        """The script (and its keys) that moves a holding to a new token, for `adopt()`."""
        raise NotImplementedError

    def _held_elsewhere(self, task: asyncio.Task[Any]) -> Holding | None:
        """A holding of `task` that makes acquiring this one a self-deadlock (e.g. the other
        side of a read-write lock); none by default."""
        return None

    def _hold(self, context: ClientContext, task: asyncio.Task[Any], grant: _spec.Grant) -> None:
        """`task` holds this instance now, by `grant`: its lease renewed, its cap armed."""
        holding = self._install(task, grant.token, grant.fence)
        holding.lease = self._new_lease(grant, holding)
        context.keeper.hold(holding.lease)
        self._cap(context, holding, grant.granted_at)

    def _stop_renewal(self, context: ClientContext, holding: Holding) -> None:
        """Take `holding`'s lease(s) out of the keeper (released, detached or capped)."""
        if holding.lease is not None:
            context.keeper.drop(holding.lease)

    async def _release_call(self, context: ClientContext, token: str) -> bool | None:
        """Run the release script(s) for `token` once (see `_release.release`)."""
        return await _release.release(context, self._spec, token, self._ttl_ms)

    async def _release_surely(
        self, context: ClientContext, holding: Holding
    ) -> bool | _release.Unanswered | None:
        """`_release_call` for `holding`, completed even if the caller is cancelled
        meanwhile; its lease is renewed until the release is answered, which is waited for
        while the lease is known valid (`Unanswered` past it, the release going on in the
        background)."""
        if holding.lease is None:
            self._stop_renewal(context, holding)
            return await _release.release_surely(context, self._spec, holding.token, self._ttl_ms)
        lease = holding.lease
        return await _release.release_until(
            context, self._spec, holding.token, self._ttl_ms, lease.valid_until, lease=lease
        )

    # -- the holdings, by task -------------------------------------------------------------

    def _new_lease(self, grant: _spec.Grant, owner: LeaseOwner) -> Lease:
        return Lease(
            self._spec.renew,
            self._spec.renew_keys,
            (grant.token, self._ttl_ms),
            self._ttl,
            grant.granted_at,
            owner,
        )

    def _install(
        self, task: asyncio.Task[Any], token: str, fence: int, lease: Lease | None = None
    ) -> Holding:
        """Record that `task` holds this instance now."""
        holding = Holding(self, task, token, fence)
        holding.lease = lease
        self._holdings[task] = holding
        return holding

    def _take_holding(self) -> Holding:
        holding = self._find_holding()
        del self._holdings[holding.task]
        holding.end_body()  # released inside its `async with` body: no loss cancels it now
        return holding

    def _find_holding(self) -> Holding:
        """The current task's holding, else one of a task that has finished."""
        task = current_task()
        holding = self._holdings.get(task)
        if holding is not None:
            return holding
        for owner, held in self._holdings.items():
            if owner.done():  # e.g. acquired inside asyncio.wait_for's own task
                return held
        raise LockNotOwned(self._name, "the current task does not hold it")

    def _current(self) -> Holding | None:
        task = asyncio.current_task()
        return None if task is None else self._holdings.get(task)

    # -- max_hold: a holding is renewed that long at most ----------------------------------

    def _cap(self, context: ClientContext, holding: Holding, since: float) -> None:
        """Arm `max_hold` for `holding`, counted from `since` (monotonic)."""
        if self._max_hold is None or holding.lease is None:
            return
        delay = max(0.0, since + self._max_hold - time.monotonic())
        holding.cap = asyncio.get_running_loop().call_later(
            delay, self._max_hold_reached, context, holding
        )

    def _max_hold_reached(self, context: ClientContext, holding: Holding) -> None:
        """Stop renewing `holding` and report it lost; its lease then ends on the server by
        itself (or sooner, when the cancelled body releases it)."""
        holding.cap = None
        lease = holding.lease
        if lease is None or lease.lost or holding.is_lost:
            return
        self._stop_renewal(context, holding)
        lease.lost = True
        assert self._max_hold is not None
        self._lease_lost(
            holding, f"held for max_hold={self._max_hold:g} s, so its renewal was stopped"
        )

    @staticmethod
    def _uncap(holding: Holding) -> None:
        if holding.cap is not None:
            holding.cap.cancel()
            holding.cap = None

    # -- a lost lease: the holder is told --------------------------------------------------

    def _lost_error(self, holding: Holding) -> LockLost:
        return LockLost(self._name, f"lease lost: {holding.lost_reason}", token=holding.token)

    def _lease_lost(self, holding: Holding, reason: str) -> None:
        holding.mark_lost(reason)
        _telemetry.on_lease_lost(self._spec, holding.token)
        if self._holdings.get(holding.task) is holding:
            holding.cancel_body()
        if self._on_lost is not None:
            try:
                self._on_lost(self._lost_error(holding))
            except Exception:
                log.exception("aiolocks: on_lost callback of %r failed", self._name)
