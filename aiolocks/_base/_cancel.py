"""Cancellation that a library below us swallowed is delivered again, or recognised.

On Python 3.11, `asyncio.wait_for` returns the result and drops a cancellation that
arrives in the same loop iteration as the result (fixed in Python 3.12), and
redis-py awaits it around every socket write when the client has a `socket_timeout`. A
cancelled acquire would then return normally, and `asyncio.timeout` would not fire. The
engine counts the task's pending cancellation requests before such a call and, if one
arrived and was not delivered, raises `CancelledError` itself. `cancelling()` tells a
background task whether an error it caught is its own cancellation in disguise.
"""

from __future__ import annotations

import asyncio
import math

import anyio

__all__ = ["cancelling", "pending", "redeliver"]


def pending() -> int:
    """How many cancellation requests of the current task are pending (0 outside a task,
    and outside a running loop: `map_redis_errors` also wraps synchronous code)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return 0
    return 0 if task is None else task.cancelling()


def redeliver(before: int) -> None:
    """Raise `CancelledError` if a cancellation was requested since `pending()` returned
    `before` but the awaited call returned normally instead of raising it.

    Not when an anyio cancel scope around us is cancelled: anyio delivers its cancellation
    again at the next await by itself, with the message its scope recognises (a bare
    `CancelledError` would escape the scope).
    """
    if pending() > before and anyio.current_effective_deadline() != -math.inf:
        raise asyncio.CancelledError


def cancelling() -> bool:
    """True when the current task is being cancelled (a shutdown racing a dropped socket
    can surface from redis-py as ConnectionError instead of CancelledError)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
