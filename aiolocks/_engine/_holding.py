"""One holding: an acquisition owned by one task, with its own token, fence and lease.

The record every part of a leased lock shares (acquiring, releasing, losing a lease,
max_hold, hand-over, the local hand-off cohorts); it sits below all of them so each can
name it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from .._base._clients import AnyRedis
from .._leases._lease import Lease
from ._context import ClientContext, context_for

__all__ = ["Holding", "Owner", "current_task"]


class Owner(Protocol):
    """What a holding calls on the lock it belongs to (its lease's two callbacks)."""

    _client: AnyRedis

    def _lease_lost(self, holding: Holding, reason: str) -> None: ...

    async def _release_call(self, context: ClientContext, token: str) -> bool | None: ...


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease.

    Kept small, as a process may hold 100,000 at once and the garbage collector goes
    through every one at each full collection: the `lost` event is made only when asked
    for, and the `async with` body is cancelled through its task, without a cancel scope.
    """

    __slots__ = (
        "body",
        "cancelled",
        "cap",
        "fence",
        "lease",
        "lock",
        "lost_event",
        "lost_reason",
        "task",
        "token",
    )

    def __init__(self, lock: Owner, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.lock = lock
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost_reason: str | None = None  # set once: the holding is lost
        self.lost_event: asyncio.Event | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`
        self.body = False  # its task is in the body of `async with`: a loss cancels it
        self.cancelled = False  # a loss cancelled its task (to be taken back at the exit)

    @property
    def is_lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def lost(self) -> asyncio.Event:
        """Set when the holding is lost; made when first asked for."""
        if self.lost_event is None:
            self.lost_event = asyncio.Event()
            if self.lost_reason is not None:
                self.lost_event.set()
        return self.lost_event

    def mark_lost(self, reason: str) -> None:
        """Record the loss and set the `lost` event, if one was made."""
        self.lost_reason = reason
        if self.lost_event is not None:
            self.lost_event.set()

    def cancel_body(self) -> None:
        """Cancel the task's `async with` body at the loss, as a cancel scope would: at
        once if the task waits, else at its next wait (never the task's own clean-up)."""
        if not self.body or self.cancelled:
            return
        if self.task is asyncio.current_task():
            asyncio.get_running_loop().call_soon(self.cancel_body)
            return
        self.cancelled = True
        self.task.cancel()

    def end_body(self) -> None:
        """The body has ended: the cancellation `cancel_body` asked for is taken back (as
        a cancel scope's exit does), so that only others' requests stay counted."""
        self.body = False
        if self.cancelled:
            self.cancelled = False
            self.task.uncancel()

    # As its lease's owner (`_leases.LeaseOwner`): the lease calls these on the holding
    # itself, so no callback object is made per holding (a burst of 100,000 holdings would
    # be that many more objects for every full collection of the garbage collector).
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
