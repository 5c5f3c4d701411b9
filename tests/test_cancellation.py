"""Cancellation at any await leaves nothing behind: no holder, no queue entry, no stuck waiter."""

from __future__ import annotations

import asyncio
import gc
import random
import time
import weakref
from typing import Any

import pytest
import redis.asyncio
from _probes import QueueProbe, mutex_keys
from conftest import Backend, cancelled_attempt, client_from_url

from aiolocks import LockTimeout, RedisMutex
from aiolocks._engine._context import context_for
from aiolocks._scripts import Script


async def test_500_acquisitions_cancelled_at_random_points(any_backend: Backend) -> None:
    rng = random.Random(20261122)
    clients = [any_backend.client() for _ in range(2)]
    await clients[0].flushall()
    name = "x:storm"
    mutexes = [RedisMutex(client, name, ttl=5) for client in clients]
    outcomes = {"acquired": 0, "cancelled": 0}

    async def storm() -> None:
        for _ in range(10):
            await asyncio.gather(
                *(cancelled_attempt(mutexes[i % 2], rng, outcomes) for i in range(50))
            )

    await asyncio.wait_for(storm(), 60)
    assert outcomes["acquired"] + outcomes["cancelled"] == 500
    assert outcomes["cancelled"] > 0  # the storm really cancelled mid-way

    keys = await mutex_keys(clients[0], name)
    assert set(keys) <= {"fence"}, keys  # no owner, no queue, no waiters left
    for client, mutex in zip(clients, mutexes, strict=True):
        context = context_for(client)
        assert len(context.waitqueue) == 0
        assert mutex.statistics().held_here == 0 and mutex.statistics().tasks_waiting == 0
    fresh = RedisMutex(clients[1], name)
    assert await fresh.acquire(blocking=False)  # at once: nothing stuck ahead of it
    await fresh.release()


@pytest.mark.parametrize("point", ["in-flight", "queued", "granted-unread"])
async def test_cancel_at_each_point_hands_the_lock_on(
    r: redis.asyncio.Redis, url: str, point: str
) -> None:
    other = redis.asyncio.Redis.from_url(url)
    try:
        holder = RedisMutex(r, "x:point", ttl=5)
        victim = RedisMutex(other, "x:point", ttl=5)
        behind = RedisMutex(r, "x:point", ttl=5)
        assert await holder.acquire()
        probe = QueueProbe(other)
        task = asyncio.create_task(victim.acquire())
        if point == "in-flight":
            await asyncio.sleep(0)
        else:
            await probe.wait_queued(1)  # the server has it in the queue
        behind_task = asyncio.create_task(behind.acquire())
        if point == "granted-unread":
            # Release hands the lock to the victim, whose grant message stays unread.
            notifier = context_for(other).notifier
            notifier._on_grant = lambda wake, payload: None  # type: ignore[method-assign]
            await holder.release()
            assert (await victim.inspect()).owner is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if point != "granted-unread":
            await holder.release()
        # Whatever the victim had reached, the lock goes on to the next waiter.
        assert await asyncio.wait_for(behind_task, 5)
        info = await behind.inspect()
        assert info.queue_length == 0
        await behind.release()
        assert not await behind.locked()
    finally:
        await other.aclose()


async def test_timeout_of_a_queued_waiter_withdraws_it(r: redis.asyncio.Redis) -> None:
    holder = RedisMutex(r, "x:timeout", ttl=5)
    assert await holder.acquire()
    for _ in range(3):
        assert await RedisMutex(r, "x:timeout").acquire(timeout=0.05) is False
    assert (await holder.inspect()).queue_length == 0
    await holder.release()
    assert set(await mutex_keys(r, "x:timeout")) == {"fence"}


@pytest.mark.parametrize("local_handoff", [None, 0], ids=["default", "strict-fifo"])
@pytest.mark.parametrize("holder_client", ["same", "other"])
@pytest.mark.parametrize("how", ["cancelled", "timed-out"])
async def test_a_failed_acquisition_leaves_its_task_to_reference_counting(
    r: redis.asyncio.Redis, url: str, local_handoff: int | None, holder_client: str, how: str
) -> None:
    """A task that ends with its acquisition failed (cancelled while waiting, or its
    `LockTimeout` uncaught) is freed by reference counting, as with `asyncio.Lock`: the
    acquisition's frames, kept by the exception's traceback, referred to the task that kept
    the exception. Waiting behind a holder of this client (a local wait with the default
    mutex) or of another client (a wait on the server)."""
    name = f"freed-failed:{how}:{holder_client}:{local_handoff}"
    other = client_from_url(url)
    timeout = 0.05 if how == "timed-out" else None

    async def waiter() -> None:
        async with RedisMutex(r, name, local_handoff=local_handoff, timeout=timeout):
            raise AssertionError("the lock is held elsewhere all along")

    async def fail_once() -> weakref.ref[asyncio.Task[None]]:
        task = asyncio.create_task(waiter())
        if how == "cancelled":
            await asyncio.sleep(0.02)  # (queued by then, locally or on the server, or not yet)
            task.cancel()
        await asyncio.wait([task])  # (awaiting it would raise here: this frame in the chain)
        assert task.cancelled() if how == "cancelled" else type(task.exception()) is LockTimeout
        return weakref.ref(task)

    holder = RedisMutex(r if holder_client == "same" else other, name, ttl=10)
    try:
        async with holder:
            await fail_once()  # (scripts loaded, subscriptions made)
            gc.collect()
            gc.disable()
            try:
                assert (await fail_once())() is None, "the task is left to the collector"
            finally:
                gc.enable()
    finally:
        await other.aclose()


async def test_cancelled_release_still_releases(r: redis.asyncio.Redis) -> None:
    mutex = RedisMutex(r, "x:release")
    context = context_for(r)
    inner = context.run
    in_flight = asyncio.Event()

    async def stalled_first_release(
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        retry: bool = True,
        sent: Any = None,
    ) -> Any:
        if script is mutex._spec.release and not in_flight.is_set():
            in_flight.set()
            await asyncio.Event().wait()  # never answers: only a cancellation ends it
        return await inner(script, keys, args, retry=retry, sent=sent)

    context.run = stalled_first_release  # type: ignore[method-assign]

    async def hold_then_release() -> None:
        assert await mutex.acquire()
        await mutex.release()

    task = asyncio.create_task(hold_then_release())
    await asyncio.wait_for(in_flight.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await mutex.locked()  # the shielded re-run released it
    assert mutex.statistics().held_here == 0


@pytest.mark.parametrize("steps", range(5))
async def test_a_cancellation_reaches_a_pooled_calls_caller_at_once(url: str, steps: int) -> None:
    """Issue 40 (simulation seed 373: a release answered 0.8 s past its lease's validity).
    With a socket_timeout, redis-py writes under `asyncio.wait_for`, which on Python 3.11
    returns instead of raising a cancellation that lands as the write finishes: the caller
    then waited for the reply. Cancelled `steps` loop iterations into a call the server
    answers after 2 s (BLPOP), the caller leaves at once, whichever iteration it is."""
    client = redis.asyncio.Redis.from_url(url, socket_timeout=10)
    try:
        runner = context_for(client)
        await runner.call("PING")  # connected: the call below only writes and reads
        call = asyncio.ensure_future(runner.call("BLPOP", "cancel:never", "2"))
        for _ in range(steps):
            await asyncio.sleep(0)
        cancelled_at = time.monotonic()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert time.monotonic() - cancelled_at < 1.0  # not the 2 s of the reply
    finally:
        await client.aclose()
