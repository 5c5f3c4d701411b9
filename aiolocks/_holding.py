"""One holding: an acquisition owned by one task, with its own token, fence and lease.

The record every part of a leased lock shares (acquiring, releasing, losing a lease,
max_hold, hand-over, the local hand-off cohorts); it sits below all of them so each can
name it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._leases import Lease

__all__ = ["Holding", "current_task"]


class Holding:
    """One acquisition: owned by one task, with its own token, fence and lease."""

    __slots__ = ("cap", "fence", "lease", "lost", "lost_reason", "task", "token")

    def __init__(self, task: asyncio.Task[Any], token: str, fence: int) -> None:
        self.task = task
        self.token = token
        self.fence = fence
        self.lease: Lease | None = None
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self.cap: asyncio.TimerHandle | None = None  # ends it at `max_hold`


def current_task() -> asyncio.Task[Any]:
    """The task that acquires, releases or hands over: holdings belong to it."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("aiolocks must be used from inside an asyncio task")
    return task
