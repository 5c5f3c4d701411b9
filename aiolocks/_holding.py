"""One holding: an acquisition owned by one task, with its own token, fence and lease.

The record every part of a leased lock shares (acquiring, releasing, losing a lease,
max_hold, hand-over, the local hand-off cohorts); it sits below all of them so each can
name it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ._clients import AnyRedis
from ._context import ClientContext, context_for
from ._leases import Lease

__all__ = ["Holding", "Owner", "current_task"]


class Owner(Protocol):
    """What a holding calls on the lock it belongs to (its lease's two callbacks)."""

    _client: AnyRedis

    def _lease_lost(self, holding: Holding, reason: str) -> None: ...

    async def _release_call(self, context: ClientContext, token: str) -> bool | None: ...


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease."""

    __slots__ = ("cap", "fence", "lease", "lock", "lost", "lost_reason", "task", "token")

    def __init__(self, lock: Owner, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.lock = lock
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`

    # Its lease's callbacks, as methods: one object each per holding, where a partial of
    # the lock's method was three (a burst of 100,000 holdings is that many more objects
    # for every full collection of the garbage collector to go through).
    def lease_lost(self, reason: str) -> None:
        self.lock._lease_lost(self, reason)

    async def give_back(self) -> bool | None:
        return await self.lock._release_call(context_for(self.lock._client), self.token)


def current_task() -> asyncio.Task[Any]:
    """The task that acquires, releases or hands over: holdings belong to it."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("aiolocks must be used from inside an asyncio task")
    return task
