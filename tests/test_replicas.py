"""`replicas=`: a grant is reported only once that many replicas have it (WAIT).

A real primary with one real replica (``REPLICAOF``), started by the test; and a primary
with none, where every grant must be refused and given back.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from _probes import QueueProbe
from _servers import ServerProcess, binary_path, command_count
from redis.asyncio.cluster import RedisCluster

from aiolocks import (
    LockError,
    NotReplicated,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def replicated(
    server_factory: Callable[..., ServerProcess],
) -> AsyncIterator[tuple[redis.asyncio.Redis, redis.asyncio.Redis]]:
    """(a client of a primary, a client of its one replica), the replica in sync."""
    # No 5 s wait for more replicas before the first (diskless) sync.
    primary = server_factory(
        kind="redis" if binary_path("redis") else "valkey",
        extra_args=["--repl-diskless-sync-delay", "0"],
    )
    replica = server_factory(
        kind=primary.kind, extra_args=["--replicaof", "127.0.0.1", str(primary.port)]
    )
    to_primary = redis.asyncio.Redis.from_url(primary.url)
    to_replica = redis.asyncio.Redis.from_url(replica.url)
    try:
        await to_primary.set("replication-check", 1)
        # WAIT blocks (bounded) until the replica has synced and acknowledged that write.
        acked = await to_primary.execute_command("WAIT", 1, 15_000)  # type: ignore[no-untyped-call]
        assert acked == 1, replica.log()
        yield to_primary, to_replica
    finally:
        await to_primary.aclose()
        await to_replica.aclose()


def _primitives(client: redis.asyncio.Redis, name: str, **options: Any) -> list[Any]:
    return [
        RedisMutex(client, f"{name}:mutex", **options),
        RedisSemaphore(client, f"{name}:sem", limit=1, **options),
        RedisReadWriteLock(client, f"{name}:rw", **options).write(),
    ]


async def test_grants_are_on_the_replica_when_reported(
    replicated: tuple[redis.asyncio.Redis, redis.asyncio.Redis],
) -> None:
    primary, replica = replicated
    for lock in _primitives(primary, "r", replicas=1, ttl=30):
        before = await command_count(primary, ["wait"])
        async with lock:
            fence = lock.fencing_token
            # The replica has the fence counter the grant reached (reads on a replica): the
            # top of the block a local hand-off cohort's grant reserves.
            fence_key = lock._spec.keys[3] if isinstance(lock, RedisMutex) else None
            if fence_key is not None:
                assert fence is not None
                top = fence + lock._local_handoff
                assert await replica.get(fence_key) == str(top).encode()
        assert await command_count(primary, ["wait"]) - before == 1


async def test_a_hand_off_is_confirmed_by_the_new_owner(
    replicated: tuple[redis.asyncio.Redis, redis.asyncio.Redis],
) -> None:
    primary, replica = replicated
    url = primary.connection_pool.connection_kwargs
    other = redis.asyncio.Redis(host=url["host"], port=url["port"])
    try:
        holder = RedisMutex(primary, "r:handoff", replicas=1, ttl=30)
        waiter = RedisMutex(other, "r:handoff", replicas=1, ttl=30)
        probe = QueueProbe(other)
        assert await holder.acquire()
        first = holder.fencing_token or 0

        async def take_and_look() -> tuple[int, bytes | str | None, str]:
            assert await waiter.acquire()
            holding = waiter._current()
            assert holding is not None
            # The waiter confirmed its grant (a write on its own connection, then WAIT):
            # the replica already has it as the owner when acquire() returns.
            on_replica = await replica.get(waiter._spec.keys[0])
            await waiter.release()
            return holding.fence, on_replica, holding.token

        waiting = asyncio.create_task(take_and_look())
        await probe.wait_queued(1)
        await holder.release()  # hands the mutex to the waiter, by message
        fence, on_replica, token = await asyncio.wait_for(waiting, 10)
        assert fence > first > 0
        assert on_replica == token.encode()
    finally:
        await other.aclose()


async def test_fences_rise_across_a_failover_to_the_replica(
    replicated: tuple[redis.asyncio.Redis, redis.asyncio.Redis],
) -> None:
    """Grants confirmed on the replica (replicas=1); the replica is promoted (REPLICAOF NO
    ONE): its fence counters have their expiry, and every kind's next fence on it is above
    the ones the old primary handed out (issue 14)."""
    primary, replica = replicated
    before: dict[str, int] = {}
    for lock in _primitives(primary, "fo", replicas=1, ttl=5):
        async with lock:
            before[lock.name] = lock.fencing_token
    await primary.execute_command("WAIT", 1, 5_000)  # type: ignore[no-untyped-call]
    await replica.execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
    for lock in _primitives(replica, "fo", ttl=5):
        fence_key = lock._spec.channel.removesuffix(b":wake") + b":fence"
        assert 0 < await replica.pttl(fence_key) <= 6_000, fence_key
        async with lock:
            assert lock.fencing_token > before[lock.name], lock.name


async def test_without_replicas_the_grant_is_given_back(r: redis.asyncio.Redis) -> None:
    for lock in _primitives(r, "nr", replicas=1, replica_timeout=0.1, ttl=30):
        with pytest.raises(NotReplicated) as info:
            await lock.acquire()
        assert "0 of 1 replica(s)" in str(info.value) and info.value.name == lock.name
        assert lock.fencing_token is None
        assert not await lock.locked()  # given back: free for the next one
    # Nothing is left behind but fence counters (and the semaphore's stored limit).
    left = {key.decode().rsplit(":", 1)[1] async for key in r.scan_iter(match="aiolocks:*")}
    assert left <= {"fence", "limit"}, left


async def test_async_with_raises_and_leaves_the_lock_free(r: redis.asyncio.Redis) -> None:
    lock = RedisMutex(r, "nr:with", replicas=2, replica_timeout=0.05)
    entered = False
    with pytest.raises(NotReplicated):
        async with lock:
            entered = True
    assert not entered
    assert await RedisMutex(r, "nr:with").acquire(blocking=False)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"replicas": -1}, ValueError),
        ({"replicas": True}, TypeError),
        ({"replicas": "1"}, TypeError),
        ({"replicas": 1.0}, TypeError),
        ({"replica_timeout": 0}, ValueError),
        ({"replica_timeout": math.nan}, ValueError),
        ({"replica_timeout": math.inf}, ValueError),
        ({"replica_timeout": "1"}, TypeError),
    ],
)
def test_bad_replica_options(options: dict[str, Any], error: type[Exception]) -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    for make in (
        lambda: RedisMutex(client, "x", **options),
        lambda: RedisSemaphore(client, "x", limit=2, **options),
        lambda: RedisReadWriteLock(client, "x", **options),
    ):
        with pytest.raises(error):
            make()


def test_replicas_are_refused_on_a_cluster_client() -> None:
    cluster = RedisCluster(host="127.0.0.1", port=1)
    with pytest.raises(ValueError, match="Cluster"):
        RedisMutex(cluster, "x", replicas=1)
    RedisMutex(cluster, "x")  # without replicas= a cluster client is fine


def test_not_replicated_is_a_lock_error() -> None:
    assert issubclass(NotReplicated, LockError)
