"""`max_hold`: a cap on how long one holding lasts, on every leased primitive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from aiolocks import LockLost, RedisMutex, RedisReadWriteLock, RedisSemaphore

Factory = Callable[..., Any]

FACTORIES: dict[str, Factory] = {
    "mutex": lambda client, name, **kw: RedisMutex(client, name, **kw),
    "semaphore1": lambda client, name, **kw: RedisSemaphore(client, name, limit=1, **kw),
    "rw-read": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).read(),
    "rw-write": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).write(),
}
# The side that a holder of FACTORIES[kind] excludes (a reader excludes writers only).
CONTENDERS: dict[str, Factory] = {
    **FACTORIES,
    "rw-read": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).write(),
}

TTL = 0.6
MAX_HOLD = 2.0


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_a_body_longer_than_max_hold_is_cancelled_with_lock_lost(
    clients: list[redis.asyncio.Redis], kind: str
) -> None:
    lock = FACTORIES[kind](clients[0], "mh:body", ttl=TTL, max_hold=MAX_HOLD)
    other = CONTENDERS[kind](clients[1], "mh:body", ttl=TTL)
    reached_end = False
    started = time.monotonic()
    with pytest.raises(LockLost) as caught:
        async with lock:
            # Past several ttls the holding is still renewed: nobody else gets in.
            await asyncio.sleep(3 * TTL)
            assert await other.acquire(blocking=False) is False
            await asyncio.sleep(30)  # would run far longer than max_hold
            reached_end = True
    elapsed = time.monotonic() - started
    assert not reached_end
    assert "max_hold=2" in str(caught.value), caught.value
    assert MAX_HOLD <= elapsed < MAX_HOLD + 2.0, elapsed
    # The cancelled body's clean-up gave it back: the other side gets it at once.
    assert await other.acquire(timeout=2.0) is True
    await other.release()


@pytest.mark.parametrize("kind", ["mutex", "rw-read"])
async def test_a_stuck_holder_loses_the_lock_by_itself(
    clients: list[redis.asyncio.Redis], kind: str
) -> None:
    """A holder that never releases: renewal stops at max_hold, the lease ends on the
    server within a ttl after that, and a waiter gets it."""
    lock = FACTORIES[kind](clients[0], "mh:stuck", ttl=TTL, max_hold=MAX_HOLD)
    other = CONTENDERS[kind](clients[1], "mh:stuck", ttl=TTL)
    lost: list[LockLost] = []
    lock._on_lost = lost.append
    assert await lock.acquire()
    started = time.monotonic()
    assert await other.acquire(timeout=MAX_HOLD + 3.0) is True
    waited = time.monotonic() - started
    assert MAX_HOLD * 0.9 <= waited < MAX_HOLD + TTL + 2.0, waited
    assert lock.lost.is_set()
    assert len(lost) == 1 and "max_hold" in lost[0].reason
    await other.release()
    with pytest.raises(LockLost, match="max_hold"):
        await lock.release()


async def test_a_release_before_max_hold_disarms_it(
    clients: list[redis.asyncio.Redis],
) -> None:
    lock = RedisMutex(clients[0], "mh:quick", ttl=TTL, max_hold=0.3)
    async with lock:
        pass
    assert await lock.acquire()  # a fresh holding: a fresh cap
    await asyncio.sleep(0.15)
    assert not lock.lost.is_set()
    await lock.release()
    await asyncio.sleep(0.3)  # the first holding's cap would have fired by now
    assert lock.statistics().leases_lost == 0


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1, ValueError), (float("inf"), ValueError), ("5", TypeError),
     (True, TypeError)],
)  # fmt: skip
def test_bad_max_hold_is_refused_at_construction(
    fake_r: redis.asyncio.Redis, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="max_hold"):
        RedisMutex(fake_r, "mh:bad", max_hold=value)  # type: ignore[arg-type]


def test_max_hold_with_local_handoff_is_refused(fake_r: redis.asyncio.Redis) -> None:
    with pytest.raises(ValueError, match="max_hold cannot be combined with local_handoff"):
        RedisMutex(fake_r, "mh:cohort", max_hold=5, local_handoff=4)
