"""Awaiting what the caller's cancellation or deadline must not cut short.

A script call that may grant or queue a token, or a release, has to finish (or be
followed by its clean-up) even when the task that started it leaves; these helpers run
such a call in a task of its own and bound only the caller's wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._context import ClientContext

__all__ = [
    "UNANSWERED",
    "Unanswered",
    "answered_by",
    "bounded",
    "completed",
    "settled",
    "shielded",
    "unstopped",
]

T = TypeVar("T")

log = logging.getLogger("aiolocks")


class Unanswered:
    """The marker `answered_by` (and `release_until`) return when Redis did not answer in
    time."""


UNANSWERED = Unanswered()


def unstopped(context: ClientContext, call: Awaitable[T]) -> asyncio.Future[T] | None:
    """`call` (a script call that may grant or queue a token) in a task of its own, to await
    shielded: leaving (a cancellation, a deadline) stops the wait, not the call, and the
    token's clean-up is sent after its reply (`withdraw`'s `after`, `settled`).
    Only where the clean-up would not follow it on one connection (auto-pipelining off,
    Cluster: each call on a pooled connection, where the clean-up could overtake it and find
    nothing, and the call then grant or queue the departed token for its ttl). None through
    the auto-pipeline: `call` is awaited as it is."""
    if context.autopipe is not None:
        return None
    return asyncio.ensure_future(call)


async def settled(in_flight: asyncio.Future[T]) -> T | None:
    """The reply of a call `unstopped` left in flight, once it came; None if it failed (a
    lost reply: the clean-up sent next withdraws whatever it did)."""
    try:
        return await in_flight
    except Exception:
        return None


def bounded(awaitable: Awaitable[T], deadline: float | None) -> Awaitable[T]:
    """`awaitable`, awaited until the monotonic time `deadline` at most (TimeoutError);
    without a deadline, `awaitable` itself (no coroutine more in the chain)."""
    if deadline is None:
        return awaitable
    return _bounded(awaitable, deadline)


async def _bounded(awaitable: Awaitable[T], deadline: float) -> T:
    loop_deadline = asyncio.get_running_loop().time() + (deadline - time.monotonic())
    async with asyncio.timeout_at(loop_deadline):
        return await awaitable


async def shielded(call: Callable[[], Awaitable[T]], bound: float) -> T | None:
    """Run `call()` to completion even if the caller is cancelled meanwhile, for at most
    `bound` seconds; errors (the timeout included) give None. A cancellation of the
    caller is re-raised once the call is done."""

    async def run() -> T | None:
        try:
            return await asyncio.wait_for(call(), bound)
        except Exception:
            return None

    return await completed(run())


async def answered_by(awaitable: Awaitable[T], until: float | None) -> T | Unanswered:
    """`completed`, waited for until the monotonic time `until` at most (a lease's
    validity): past it the answer is UNANSWERED and the call goes on in the background
    (a cancelled caller also leaves it running: it completes either way)."""
    if until is None:
        return await completed(awaitable)
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
    except BaseException:
        task.add_done_callback(_log_failure)
        raise
    if task in done:
        return task.result()
    task.add_done_callback(_log_failure)
    return UNANSWERED


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("aiolocks: a release left to finish failed: %r", task.exception())


async def completed(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` (in a task of its own) to the end even if the caller is cancelled
    meanwhile; that cancellation is re-raised once it is done, and wins over its outcome.
    The caller's own CancelledError is re-raised, so that an anyio scope knows it as its own.
    """
    task = asyncio.ensure_future(awaitable)
    cancellation: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as caught:
            if not task.cancelled() and cancellation is None:
                cancellation = caught  # the caller's: never swallowed
        except BaseException:
            break  # the task's own error: result() raises it below
    if cancellation is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller gets
        raise cancellation
    return task.result()
