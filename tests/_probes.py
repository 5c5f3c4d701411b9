"""Event-driven probes into a client's engine state, so tests wait on events, never poll."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio

from aiolocks._base._clients import AnyRedis
from aiolocks._engine._context import ClientContext, context_for
from aiolocks._engine._leasedlock import Cohort

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from _lockworker import on_queued


class QueueProbe:
    """Records, in order, the tokens the acquire script reported as queued on the server;
    `local`: also each task queued behind a local hand-off cohort of the client (recorded
    as "local", as it has no token on the server)."""

    def __init__(self, client: AnyRedis, *, local: bool = False) -> None:
        self.context: ClientContext = context_for(client)
        self.queued: list[str] = []
        self._grew = asyncio.Event()
        on_queued(client, self._queued)
        if local:
            _on_local_wait(self.context, functools.partial(self._queued, "local"))

    def _queued(self, token: str) -> None:
        self.queued.append(token)
        self._grew.set()

    async def wait_queued(self, count: int, timeout: float = 10.0) -> None:
        """Wait until `count` distinct tokens have been queued (bounded)."""

        async def wait() -> None:
            while len(self.queued) < count:
                self._grew.clear()
                await self._grew.wait()

        await asyncio.wait_for(wait(), timeout)


class _Recording(deque[Any]):
    """A cohort's queue of local waiters that tells of each task it queues."""

    def __init__(self, items: deque[Any], on_wait: Callable[[], None]) -> None:
        super().__init__(items)
        self.on_wait = on_wait

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        self.on_wait()


class _Cohorts(dict[Any, Any]):
    """A context's cohorts (`ClientContext.cohorts`), each one's queue recording."""

    def __init__(self, cohorts: dict[Any, Any], on_wait: Callable[[], None]) -> None:
        super().__init__()
        self.on_wait = on_wait
        for key, cohort in cohorts.items():
            self[key] = cohort

    def __setitem__(self, key: Any, cohort: Any) -> None:
        if isinstance(cohort, Cohort):  # (not a task alone: nobody queues behind it)
            cohort._queue = _Recording(cohort._queue, self.on_wait)
        super().__setitem__(key, cohort)


def _on_local_wait(context: ClientContext, on_wait: Callable[[], None]) -> None:
    """Call `on_wait` whenever a task of `context`'s client queues behind its cohort."""
    context.cohorts = _Cohorts(context.cohorts, on_wait)


async def mutex_keys(client: redis.asyncio.Redis, name: str) -> dict[str, Any]:
    """Every aiolocks key of mutex `name`, with its type, for leftover checks."""
    found: dict[str, Any] = {}
    async for key in client.scan_iter(match=f"aiolocks:mutex:{{{name}}}:*"):
        text = key.decode() if isinstance(key, bytes) else key
        found[text.rsplit(":", 1)[1]] = await client.type(key)
    return found


class Renewals:
    """A telemetry recorder that only counts: renewal batches settled, leases lost."""

    def __init__(self) -> None:
        self.count = 0  # leases renewed
        self.lost = 0
        self.changed = asyncio.Event()

    def acquire_started(self, lock: object) -> object:
        return None

    def acquire_ended(self, *args: object) -> None:
        pass

    def released(self, *args: object) -> None:
        pass

    def handed_off(self, *args: object) -> None:
        pass

    def lease_lost(self, *args: object) -> None:
        self.lost += 1
        self.changed.set()

    def renewed(self, leases: Sequence[Any], results: Sequence[object]) -> None:
        self.count += sum(1 for result in results if result == 1)
        self.changed.set()

    async def until(self, renewed: int, timeout: float) -> None:
        """Wait (bounded) until `renewed` leases in all have been renewed."""

        async def wait() -> None:
            while self.count < renewed:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout)
