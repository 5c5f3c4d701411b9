"""Join concurrent one-item requests into batched calls: one call in flight per coalescer.

While a batch is on its way to Redis, new requests gather in the next batch, so under load
batches grow by themselves (10,000 concurrent `register()` calls become a handful of script
calls and never exhaust the connection pool), and a lone request costs one call, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

__all__ = ["Coalescer"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalescer(Generic[K, V]):
    """Serve `submit(key)` calls through `flush(keys) -> values` in batches of `max_batch`.

    Requests for the same key that are pending together share one answer. A caller that is
    cancelled stops waiting; its key is still sent (the call is idempotent by contract).
    """

    def __init__(self, flush: Callable[[list[K]], Awaitable[list[V]]], max_batch: int) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: dict[K, asyncio.Future[V]] = {}
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, key: K) -> V:
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = asyncio.get_running_loop().create_future()
            if self._runner is None:
                # Started now, it first runs on the next loop iteration: every request made
                # in this iteration is in its first batch.
                self._runner = asyncio.create_task(self._run())
        return await asyncio.shield(future)

    async def _run(self) -> None:
        try:
            while self._pending:
                keys = list(self._pending)[: self._max_batch]
                batch = {key: self._pending.pop(key) for key in keys}
                try:
                    values = await self._flush(keys)
                except asyncio.CancelledError:
                    _cancel(batch.values())
                    raise
                except Exception as exc:  # handed to every caller of the batch
                    for future in batch.values():
                        if not future.done():
                            future.set_exception(exc)
                            future.exception()  # retrieved: callers that left must not log it
                    continue
                for future, value in zip(batch.values(), values, strict=True):
                    if not future.done():
                        future.set_result(value)
        except asyncio.CancelledError:
            pending, self._pending = self._pending, {}
            _cancel(pending.values())
            raise
        finally:
            self._runner = None


def _cancel(futures: Iterable[asyncio.Future[Any]]) -> None:
    for future in futures:
        future.cancel()
