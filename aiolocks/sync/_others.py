"""The sync door's rate limiter and registry: the asyncio classes of the same names, each
call run on the background loop. Neither holds anything, so no thread owns anything."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any, final

from .. import Limit, LockTimeout, RateLimiterInfo, RateLimiterStatistics, RegistryStatistics
from .. import RedisRateLimiter as AsyncRateLimiter
from .. import RedisRegistry as AsyncRegistry
from ._clients import SyncClient, async_client, validate_client
from ._runner import PerProcess, process

__all__ = ["RedisRateLimiter", "RedisRegistry"]

_LIMITER = inspect.signature(AsyncRateLimiter).parameters
_REGISTRY = inspect.signature(AsyncRegistry).parameters


@final
class RedisRateLimiter:
    """`aiolocks.RedisRateLimiter` for threads: the same GCRA state, so threads and tasks
    share one limit. `with limiter:` waits for a permit (no polling)."""

    def __init__(
        self,
        client: SyncClient,
        name: str,
        *,
        rate: float | None = None,
        per: float = _LIMITER["per"].default,
        burst: int | None = None,
        limits: Iterable[Limit] | None = None,
        timeout: float | None = None,
        prefix: str = _LIMITER["prefix"].default,
    ) -> None:
        validate_client(client)
        self._client = client
        self._timeout = timeout
        self._limiter = PerProcess(
            lambda: AsyncRateLimiter(
                async_client(client),
                name,
                rate=rate,
                per=per,
                burst=burst,
                limits=limits,
                timeout=timeout,
                prefix=prefix,
            )
        )

    def _now(self) -> AsyncRateLimiter:
        return self._limiter.get()[0]

    @property
    def name(self) -> str:
        return self._now().name

    @property
    def rate(self) -> float:
        return self._now().rate

    @property
    def per(self) -> float:
        return self._now().per

    @property
    def burst(self) -> int:
        return self._now().burst

    @property
    def limits(self) -> tuple[Limit, ...]:
        return self._now().limits

    def set_limits(
        self,
        *,
        rate: float | None = None,
        per: float = _LIMITER["per"].default,
        burst: int | None = None,
        limits: Iterable[Limit] | None = None,
    ) -> tuple[Limit, ...]:
        """Change the name's limits live (see `aiolocks.RedisRateLimiter.set_limits`)."""
        limiter = self._now()
        return process().call(
            lambda: limiter.set_limits(rate=rate, per=per, burst=burst, limits=limits)
        )

    def __repr__(self) -> str:
        return f"<aiolocks.sync.RedisRateLimiter {self.name!r}>"

    def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, cost: int = 1
    ) -> bool:
        """Wait for `cost` permits (see `aiolocks.RedisRateLimiter.acquire`)."""
        limiter = self._now()
        return process().call(lambda: limiter.acquire(blocking, timeout, cost=cost))

    def __enter__(self) -> RedisRateLimiter:
        if not self.acquire(timeout=self._timeout):
            assert self._timeout is not None
            raise LockTimeout(self.name, self._timeout, "the next free slot is later")
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None  # nothing to release: the permit was a slot in time

    def statistics(self) -> RateLimiterStatistics:
        """A cheap local snapshot of this instance in this process (no Redis call)."""
        return self._now().statistics()

    def inspect(self) -> RateLimiterInfo:
        """What the server holds for the limiter."""
        return process().call(self._now().inspect)


@final
class RedisRegistry:
    """`aiolocks.RedisRegistry` for threads: the same name -> id hash, ids dense from 1."""

    def __init__(
        self,
        client: SyncClient,
        name: str,
        *,
        prefix: str = _REGISTRY["prefix"].default,
        max_name_bytes: int = _REGISTRY["max_name_bytes"].default,
    ) -> None:
        validate_client(client)
        self._registry = PerProcess(
            lambda: AsyncRegistry(
                async_client(client), name, prefix=prefix, max_name_bytes=max_name_bytes
            )
        )

    def _now(self) -> AsyncRegistry:
        return self._registry.get()[0]

    @property
    def name(self) -> str:
        return self._now().name

    def __repr__(self) -> str:
        return f"<aiolocks.sync.RedisRegistry {self.name!r}>"

    def statistics(self) -> RegistryStatistics:
        return self._now().statistics()

    def register(self, name: str | bytes) -> int:
        """The id of `name`, registering it if new (same name -> same id, forever)."""
        registry = self._now()
        return process().call(lambda: registry.register(name))

    def register_many(self, names: Iterable[str | bytes]) -> list[int]:
        registry, names = self._now(), list(names)
        return process().call(lambda: registry.register_many(names))

    def id_of(self, name: str | bytes) -> int | None:
        registry = self._now()
        return process().call(lambda: registry.id_of(name))

    def ids_of(self, names: Iterable[str | bytes]) -> list[int | None]:
        registry, names = self._now(), list(names)
        return process().call(lambda: registry.ids_of(names))

    def name_of(self, id: int) -> str | None:
        registry = self._now()
        return process().call(lambda: registry.name_of(id))

    def name_bytes_of(self, id: int) -> bytes | None:
        registry = self._now()
        return process().call(lambda: registry.name_bytes_of(id))

    def names_of(self, ids: Iterable[int]) -> list[str | None]:
        registry, ids = self._now(), list(ids)
        return process().call(lambda: registry.names_of(ids))

    def count(self) -> int:
        return process().call(self._now().count)

    def items(
        self, *, batch: int = inspect.signature(AsyncRegistry.items).parameters["batch"].default
    ) -> Iterator[tuple[str, int]]:
        """Every (name, id), a batch per round trip."""
        registry = self._now()
        pages = registry.items(batch=batch)

        async def step() -> Any:
            try:
                return await pages.__anext__()
            except StopAsyncIteration:
                return None

        while (item := process().call(step)) is not None:
            yield item

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return self.items()
