"""Event-driven probes into a client's engine state, so tests wait on events, never poll."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio

from aiolocks._clients import AnyRedis
from aiolocks._context import ClientContext, context_for

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from _lockworker import queued_token


class QueueProbe:
    """Records, in order, the tokens the acquire script reported as queued on the server."""

    def __init__(self, client: AnyRedis) -> None:
        self.context: ClientContext = context_for(client)
        self.queued: list[str] = []
        self._changed = asyncio.Condition()
        inner: Callable[..., Awaitable[Any]] = self.context._execute

        async def execute(*args: Any, **options: Any) -> Any:
            reply = await inner(*args, **options)
            token = queued_token(args, reply)
            if token is not None and token not in self.queued:
                self.queued.append(token)
                async with self._changed:
                    self._changed.notify_all()
            return reply

        self.context._execute = execute

    async def wait_queued(self, count: int, timeout: float = 10.0) -> None:
        """Wait until `count` distinct tokens have been queued (bounded)."""

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.queued) >= count)

        await asyncio.wait_for(wait(), timeout)


async def mutex_keys(client: redis.asyncio.Redis, name: str) -> dict[str, Any]:
    """Every aiolocks key of mutex `name`, with its type, for leftover checks."""
    found: dict[str, Any] = {}
    async for key in client.scan_iter(match=f"aiolocks:mutex:{{{name}}}:*"):
        text = key.decode() if isinstance(key, bytes) else key
        found[text.rsplit(":", 1)[1]] = await client.type(key)
    return found
