"""RedisMutex on real servers: waiting cost, renewal, lease loss, bad input, pub/sub faults."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref

import anyio
import pytest
import redis
import redis.asyncio
from _faults import close_client
from _probes import QueueProbe
from _servers import ServerProcess, command_count, has_sharded_pubsub
from conftest import client_from_url, freed_by_reference_counting

from aiolocks import LockLost, LockNotOwned, RedisMutex
from aiolocks._engine._context import context_for

# What a client can send itself; commandstats also counts the commands scripts run.
_TOP_LEVEL = {
    "evalsha", "eval", "script", "config",
    "subscribe", "unsubscribe", "publish", "ssubscribe", "sunsubscribe", "spublish",
}  # fmt: skip


async def _wait_cost(url: str, name: str, seconds: float) -> tuple[int, int]:
    """(commands the waiter sent, all commands the server ran) while one waiter waited
    `seconds` on a held mutex. A script the server did not have cached is one call: its
    EVALSHA answered NOSCRIPT and the EVAL that followed count once (a warm-up cut short
    under load may leave one script unloaded; that is not polling)."""
    holder_client = redis.asyncio.Redis.from_url(url)
    waiter_client = redis.asyncio.Redis.from_url(url)
    observer = redis.asyncio.Redis.from_url(url)
    try:
        holder = RedisMutex(holder_client, name, ttl=30)
        assert await holder.acquire()
        before_eval = await command_count(observer, {"eval"})
        before = await command_count(observer, _TOP_LEVEL)
        before_all = await command_count(observer)
        assert await RedisMutex(waiter_client, name, ttl=30).acquire(timeout=seconds) is False
        after_all = await command_count(observer)
        after = await command_count(observer, _TOP_LEVEL)
        reloads = await command_count(observer, {"eval"}) - before_eval
        await holder.release()
        # minus our own INFO calls, and the NOSCRIPT reply of each reload
        return after - before - reloads, after_all - before_all - 2 - reloads
    finally:
        for client in (holder_client, waiter_client, observer):
            await client.aclose()


async def test_waiting_does_not_poll(server: ServerProcess, r: redis.asyncio.Redis) -> None:
    await _wait_cost(server.url, "m:poll-warm-up", 0.05)  # loads the scripts once
    # The short wait must be long enough to subscribe and queue on a loaded machine (0.5 s
    # was not once, in CI: the waiter timed out after its first try).
    # A server that lost its script cache (a flush, a restart) reloads by EVAL: not polling,
    # and under load the warm-up can end before the waiter reached every script.
    await r.script_flush()
    short = await _wait_cost(server.url, "m:poll-short", 1.0)
    long = await _wait_cost(server.url, "m:poll-long", 3.0)
    # try, the pub/sub mode script and CONFIG GET (once per client), SSUBSCRIBE (or
    # SUBSCRIBE) plus SUBSCRIBE of the keyspace channel, queue (and the SPUBLISH it runs to
    # tell the holder, a default mutex's local hand-off cohort), withdraw: a constant.
    assert long[0] <= 8, long
    assert long == short, (short, long)  # three times the wait, not one command more


@pytest.mark.slow
async def test_renewal_keeps_a_long_body_exclusive(r: redis.asyncio.Redis, url: str) -> None:
    other_client = redis.asyncio.Redis.from_url(url)
    mutex = RedisMutex(r, "m:renew", ttl=1)
    contender = RedisMutex(other_client, "m:renew", ttl=1)
    released_at = 0.0
    try:
        async with mutex:
            token = (await mutex.inspect()).owner
            waiting = asyncio.create_task(contender.acquire())
            await asyncio.sleep(5)  # five leases long; renewal every ttl/3 keeps it
            assert not waiting.done()
            info = await mutex.inspect()
            assert info.owner == token and info.queue_length == 1
            assert not mutex.lost.is_set()
            released_at = time.monotonic()
        assert await asyncio.wait_for(waiting, 5)
        assert time.monotonic() >= released_at
        await contender.release()
    finally:
        await other_client.aclose()


@pytest.mark.parametrize("how", ["deleted", "taken"])
async def test_lost_lease_cancels_the_body_and_raises(r: redis.asyncio.Redis, how: str) -> None:
    mutex = RedisMutex(r, "m:lost", ttl=1)
    finished = False
    started = 0.0
    with pytest.raises(LockLost) as info:
        async with mutex:
            owner = mutex._spec.keys[0]
            if how == "deleted":
                await r.delete(owner)
            else:
                await r.set(owner, "someone-else", px=5000)
            started = time.monotonic()
            await asyncio.sleep(10)
            finished = True
    assert not finished
    assert time.monotonic() - started < 1.0 + 0.5  # noticed within the ttl (renewal at ttl/3)
    assert info.value.name == "m:lost"
    assert mutex.statistics().held_here == 0
    if how == "taken":
        assert await r.get(mutex._spec.keys[0]) == b"someone-else"  # never touched


async def test_a_lost_lease_takes_its_cancellation_back_at_the_exit(
    r: redis.asyncio.Redis,
) -> None:
    """The loss cancels the body through its task; the exit takes that request back (as a
    cancel scope's exit does), so the task is not left counted as being cancelled."""
    mutex = RedisMutex(r, "m:lost-uncancel", ttl=0.6)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    with pytest.raises(LockLost):
        async with mutex:
            await r.delete(mutex._spec.keys[0])
            await asyncio.sleep(10)
    assert task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending either


async def test_a_cancellation_of_its_own_outlives_a_lost_lease(r: redis.asyncio.Redis) -> None:
    """A task cancelled by someone else as its lease is lost stays cancelled: only the
    loss's own request is taken back."""
    mutex = RedisMutex(r, "m:lost-and-cancelled", ttl=0.6)
    inside: asyncio.Future[asyncio.Event] = asyncio.get_running_loop().create_future()

    async def body() -> None:
        async with mutex:
            inside.set_result(mutex.lost)
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    lost = await asyncio.wait_for(inside, 5)
    await r.delete(mutex._spec.keys[0])
    await asyncio.wait_for(lost.wait(), 5)
    task.cancel()  # while the body is cancelled by the loss, or its exit releases
    with pytest.raises((LockLost, asyncio.CancelledError)):
        await task
    assert task.cancelling() == 1


async def test_lost_lease_is_raised_even_if_the_body_finished(r: redis.asyncio.Redis) -> None:
    mutex = RedisMutex(r, "m:lost-finished", ttl=0.6)
    body_done = False
    with pytest.raises(LockLost):
        async with mutex:
            await r.delete(mutex._spec.keys[0])
            with anyio.CancelScope(shield=True):  # the body does not notice the cancel
                await asyncio.wait_for(mutex.lost.wait(), 5)
            body_done = True
    assert body_done


async def test_lost_lease_outside_async_with_sets_event_and_calls_back(
    r: redis.asyncio.Redis,
) -> None:
    reported: list[LockLost] = []
    mutex = RedisMutex(r, "m:lost-plain", ttl=0.6, on_lost=reported.append)
    assert await mutex.acquire()
    await r.delete(mutex._spec.keys[0])
    await asyncio.wait_for(mutex.lost.wait(), 5)
    assert len(reported) == 1 and reported[0].name == "m:lost-plain"
    assert mutex.statistics().lost
    with pytest.raises(LockLost):
        await mutex.release()
    with pytest.raises(LockNotOwned):
        await mutex.release()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": ""}, ValueError),
        ({"name": "a{b"}, ValueError),
        ({"name": "a}b"}, ValueError),
        ({"name": 42}, TypeError),
        ({"ttl": 0}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"ttl": float("inf")}, ValueError),
        ({"ttl": "30"}, TypeError),
        ({"timeout": -0.1}, ValueError),
        ({"prefix": "a{"}, ValueError),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], error: type) -> None:
    # A client for a port nothing listens on: any Redis call would fail differently.
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    args: dict[str, object] = {"name": "ok"}
    args.update(kwargs)
    with pytest.raises(error) as info:
        RedisMutex(client, **args)  # type: ignore[arg-type]
    assert str(info.value)


def test_a_sync_client_is_refused() -> None:
    with pytest.raises(TypeError, match=r"redis\.asyncio"):
        RedisMutex(redis.Redis(host="127.0.0.1", port=1), "ok")  # type: ignore[arg-type]


async def test_bad_acquire_arguments_fail_before_any_redis_call() -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    mutex = RedisMutex(client, "ok")
    with pytest.raises(ValueError):
        await mutex.acquire(timeout=-1)
    with pytest.raises(ValueError):
        await mutex.acquire(blocking=False, timeout=1)
    assert context_for(client).commands_sent == 0
    await client.aclose()


async def test_pubsub_connection_killed_while_waiting(r: redis.asyncio.Redis, url: str) -> None:
    waiters_client = redis.asyncio.Redis.from_url(url)
    try:
        holder = RedisMutex(r, "m:pubsub-kill", ttl=30)
        # Strict FIFO: 20 tasks of one client, each queued on the server.
        shared = RedisMutex(waiters_client, "m:pubsub-kill", ttl=30, local_handoff=0)
        probe = QueueProbe(waiters_client)
        assert await holder.acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            async with shared:
                order.append(i)
                await asyncio.sleep(0)

        tasks = []
        for i in range(20):
            tasks.append(asyncio.create_task(waiter(i)))
            await probe.wait_queued(i + 1)
        killed = await r.client_kill_filter(_type="pubsub")
        assert killed >= 1
        await holder.release()  # this grant message is published while nobody listens
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert order == list(range(20))
        assert not await shared.locked()
        # Later grants from another client still arrive: the subscription is back (a
        # missed one would leave the waiter to its 30 s safety-net timer).
        for _ in range(3):
            assert await holder.acquire()
            waiting = asyncio.create_task(shared.acquire())
            await probe.wait_queued(len(probe.queued) + 1)
            await holder.release()
            assert await asyncio.wait_for(waiting, 5)
            await shared.release()
    finally:
        await waiters_client.aclose()


async def test_hand_off_publishes_only_across_clients(r: redis.asyncio.Redis, url: str) -> None:
    other = redis.asyncio.Redis.from_url(url)
    try:
        for clients, expected in (((r, r), 0), ((r, other), 10)):
            # Strict FIFO: one client's hand-off through the server's queue (a cohort's
            # is local, no script at all).
            holder = RedisMutex(clients[0], "m:publish", ttl=30, local_handoff=0)
            waiter = RedisMutex(clients[1], "m:publish", ttl=30, local_handoff=0)
            probe = QueueProbe(clients[1])
            before = await command_count(r, {"spublish"}), await command_count(r, {"publish"})
            for _ in range(10):
                assert await holder.acquire()
                waiting = asyncio.create_task(waiter.acquire())
                await probe.wait_queued(len(probe.queued) + 1)
                await holder.release()  # hands the lock to the queued waiter
                assert await asyncio.wait_for(waiting, 5)
                await waiter.release()
            # With sharded pub/sub (Redis 7+, Valkey) grants go out by SPUBLISH (to the
            # channel's shard only, on Cluster), never PUBLISH; on Redis 6.2 by PUBLISH.
            after = await command_count(r, {"spublish"}), await command_count(r, {"publish"})
            sent = (after[0] - before[0], after[1] - before[1])
            assert sent == ((expected, 0) if await has_sharded_pubsub(r) else (0, expected))
    finally:
        await other.aclose()


async def test_a_try_that_hands_a_free_name_to_a_waiter_of_its_own_client_wakes_it(
    redis_plain: ServerProcess,
) -> None:
    """A lease ended without a release (no keyspace events here) while a waiter of the same
    client is queued: another task's try makes that waiter the owner, and its acquire's
    reply carries no grant, so the grant is published even within the client: the waiter
    wakes at once, not at its 30 s safety-net timer."""
    client, admin = client_from_url(redis_plain.url), client_from_url(redis_plain.url)
    try:
        await admin.flushall()
        # Strict FIFO: a waiter of the holder's own client queued on the server.
        holder = RedisMutex(client, "own", ttl=30, local_handoff=0)
        waiter = RedisMutex(client, "own", ttl=30, local_handoff=0)
        probe = QueueProbe(client)
        assert await holder.acquire()
        waiting = asyncio.create_task(waiter.acquire(timeout=20))
        await probe.wait_queued(1)
        await admin.delete("aiolocks:mutex:{own}:owner")  # the holder's lease ends
        assert await RedisMutex(client, "own", ttl=30).acquire(blocking=False) is False
        assert await asyncio.wait_for(waiting, 5)
        await waiter.release()
        with contextlib.suppress(LockLost, LockNotOwned):
            await holder.release()
    finally:
        await close_client(client)
        await close_client(admin)


async def test_a_released_mutex_is_freed_without_the_garbage_collector(
    r: redis.asyncio.Redis,
) -> None:
    """A mutex made, held and released (as a request handler does, in a task of its own)
    is freed by reference counting: its holding owned its own lease, each referring to the
    other, and every cycle's mutex, holding, lease and task waited for the garbage collector
    (and, held long enough, for a full collection)."""

    async def cycle() -> weakref.ref[RedisMutex]:
        mutex = RedisMutex(r, "freed-by-refcount")
        async with mutex:
            await asyncio.sleep(0)
        return weakref.ref(mutex)

    assert await freed_by_reference_counting(cycle), "the mutex is left to the garbage collector"
