"""aiolocks.testing: the fixtures, used here directly and from a user's suite (pytester),
and the helpers that end leases on the server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import redis.asyncio

from aiolocks import LockLost, LockNotOwned, RedisMutex, RedisReadWriteLock, RedisSemaphore
from aiolocks.testing import Lock, expire_lease, expire_leases


def every_kind(client: redis.asyncio.Redis, name: str) -> dict[str, Lock]:
    rw = RedisReadWriteLock(client, name + ":rw", ttl=5)
    return {
        "mutex": RedisMutex(client, name, ttl=5),
        "semaphore": RedisSemaphore(client, name, limit=2, ttl=5),
        "read": rw.read(),
        "write": rw.write(),
    }


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "read", "write"])
async def test_expire_lease_inside_async_with_cancels_the_body(
    aiolocks_redis: redis.asyncio.Redis, kind: str
) -> None:
    lock = every_kind(aiolocks_redis, "e")[kind]
    reached = False
    with pytest.raises(LockLost, match="lease lost"):
        async with lock:
            await expire_lease(lock)
            reached = True  # never: the body is cancelled at the loss
    assert not reached


async def test_expire_lease_outside_async_with(aiolocks_fakeredis: redis.asyncio.Redis) -> None:
    """Also on fakeredis: the helper needs no real server."""
    told: list[LockLost] = []
    mutex = RedisMutex(aiolocks_fakeredis, "outside", ttl=5, on_lost=told.append)
    assert await mutex.acquire()
    await expire_lease(mutex)
    assert mutex.lost.is_set() and len(told) == 1
    assert not await mutex.locked()  # the server-side lease is gone
    with pytest.raises(LockLost):
        await mutex.release()
    with pytest.raises(LockNotOwned):
        await expire_lease(mutex)  # nothing held any more


async def test_expire_leases_ends_every_holder_anywhere(
    aiolocks_server_url: str, aiolocks_redis: redis.asyncio.Redis
) -> None:
    other = redis.asyncio.Redis.from_url(aiolocks_server_url)
    try:
        permits = RedisSemaphore(other, "pool", limit=3, ttl=0.3)
        lost = []
        for _ in range(2):
            holder = asyncio.create_task(_hold(permits))
            lost.append(await holder)
        assert await expire_leases(RedisSemaphore(aiolocks_redis, "pool", limit=3)) == 2
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in lost)), 5)
        assert await expire_leases(RedisMutex(aiolocks_redis, "pool")) == 0  # not a mutex
    finally:
        await other.aclose()


async def _hold(lock: Lock) -> asyncio.Event:
    """Acquire `lock` in a task of its own (the holding stays with the finished task)."""
    assert await lock.acquire()
    return lock.lost


def test_expire_lease_wants_a_lock() -> None:
    with pytest.raises(TypeError, match="RedisMutex"):
        asyncio.run(
            expire_lease(
                RedisReadWriteLock.__new__(RedisReadWriteLock)  # type: ignore[arg-type]
            )
        )


@pytest.mark.slow
def test_a_users_suite_in_strict_mode(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's aiolocks
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.getenv("PYTHONPATH")])))
    # As a careful user's suite would be: strict mode, warnings as errors, and the loop
    # scope of async fixtures set (pytest-asyncio warns when it is not, an error here).
    pytester.makeini(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = error\n"
    )
    pytester.makeconftest('pytest_plugins = ["aiolocks.testing"]\n')
    pytester.makepyfile(
        test_orders="""
        import pytest
        from aiolocks import LockLost, RedisMutex
        from aiolocks.testing import expire_lease

        @pytest.mark.asyncio
        async def test_real_server(aiolocks_redis, aiolocks_server_url):
            assert aiolocks_server_url.startswith("redis://127.0.0.1:")
            await aiolocks_redis.set("left-over", 1)
            async with RedisMutex(aiolocks_redis, "orders:1") as lock:
                assert lock.fencing_token > 10**15  # microseconds on the server clock

        @pytest.mark.asyncio
        async def test_flushed_before_each_test(aiolocks_redis):
            assert await aiolocks_redis.dbsize() == 0

        @pytest.mark.asyncio
        async def test_lost_lease(aiolocks_fakeredis):
            mutex = RedisMutex(aiolocks_fakeredis, "orders:1", ttl=5)
            with pytest.raises(LockLost):
                async with mutex:
                    await expire_lease(mutex)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
