"""RedisSemaphore on real servers: the limit, FIFO, counts, limit changes and mismatches,
bad input, several permits at once, lease loss.

Waiters are known to be queued on the server through `QueueProbe` (the reply of the
acquire script said so), never by polling Redis.
"""

from __future__ import annotations

import asyncio
import re
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import pytest
import redis.asyncio
from _probes import QueueProbe
from conftest import Tasks, freed_by_reference_counting

from aiolocks import (
    LimitMismatch,
    LockError,
    LockLost,
    LockTimeout,
    RedisSemaphore,
)
from aiolocks._engine._context import context_for

T = TypeVar("T")

BOUND = 5.0  # longest wait for something that should happen at once


@pytest.fixture
async def r2(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A second client on the same server (its own engine context)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


def _prefix(name: str) -> str:
    return f"aiolocks:semaphore:{{{name}}}:"


async def semaphore_keys(client: redis.asyncio.Redis, name: str) -> dict[str, Any]:
    """Every aiolocks key of semaphore `name`: its type, full value, and whether it expires."""
    found: dict[str, Any] = {}
    async for key in client.scan_iter(match=f"{_prefix(name)}*"):
        raw_kind = await client.type(key)
        kind = raw_kind.decode() if isinstance(raw_kind, bytes) else str(raw_kind)
        value: Any
        if kind == "string":
            value = await client.get(key)
        elif kind == "list":
            value = await client.lrange(key, 0, -1)
        elif kind == "zset":
            value = await client.zrange(key, 0, -1, withscores=True)
        elif kind == "hash":
            value = await client.hgetall(key)
        elif kind == "set":
            value = sorted(await client.smembers(key))
        else:
            value = None
        text = key.decode() if isinstance(key, bytes) else str(key)
        expires = await client.pttl(key) >= 0  # whether it has an expiry, not how long
        found[text.removeprefix(_prefix(name))] = (kind, value, expires)
    return found


# -- the limit ----------------------------------------------------------------------------


async def test_a_released_semaphore_is_freed_without_the_garbage_collector(
    r: redis.asyncio.Redis,
) -> None:
    """A semaphore made, held and released in a task of its own is freed by reference
    counting: its spec held a bound method of it (the limit mismatch's error), a cycle."""

    async def cycle() -> weakref.ref[RedisSemaphore]:
        semaphore = RedisSemaphore(r, "sem:freed", limit=2)
        async with semaphore:
            await asyncio.sleep(0)
        return weakref.ref(semaphore)

    assert await freed_by_reference_counting(cycle), "left to the collector"


async def test_limit_is_respected_and_reached(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis
) -> None:
    """limit=3, 12 tasks on two clients, 3 holdings each: never more than 3 inside, and 3
    inside together; every holding has its own fence."""
    name, limit, workers, rounds = "s:limit", 3, 12, 3
    sems = [RedisSemaphore(client, name, limit=limit, ttl=10) for client in (r, r2)]
    inside = most = 0
    fences: list[int] = []

    async def worker(index: int) -> None:
        nonlocal inside, most
        sem = sems[index % 2]
        mine: list[int] = []
        for round_ in range(rounds):
            async with sem:
                inside += 1
                most = max(most, inside)
                fence = sem.fencing_token
                assert fence is not None
                mine.append(fence)
                await asyncio.sleep(0.005 + 0.003 * ((index + round_) % 4))  # overlap
                inside -= 1
        assert mine == sorted(mine) and len(set(mine)) == rounds, mine
        fences.extend(mine)

    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(workers))), 30)
    assert most == limit
    assert len(fences) == len(set(fences)) == workers * rounds
    info = await sems[0].inspect()
    assert (info.name, info.limit, info.holders, info.queue_length) == (name, limit, 0, 0)
    assert info.fence == max(fences)
    assert await sems[1].available() == limit


async def test_counts_and_inspect(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    name = "s:counts"
    sems = [RedisSemaphore(r, name, limit=3, ttl=10) for _ in range(3)]
    assert await sems[0].available() == 3
    assert await sems[0].holders() == 0
    assert not await sems[0].locked()

    assert await sems[0].acquire()
    assert (await sems[1].available(), await sems[1].holders()) == (2, 1)
    assert not await sems[1].locked()
    assert await sems[1].acquire(blocking=False)
    assert await sems[2].acquire(timeout=1)
    assert (await sems[0].available(), await sems[0].holders()) == (0, 3)
    assert await sems[0].locked()
    fences = [sem.fencing_token or 0 for sem in sems]
    assert fences == sorted(set(fences)), fences  # strictly increasing (docs: fences)

    other = RedisSemaphore(r2, name, limit=3, ttl=10)
    assert await other.acquire(blocking=False) is False
    started = time.monotonic()
    assert await other.acquire(timeout=0.1) is False
    assert time.monotonic() - started < 0.1 + 1.0
    probe = QueueProbe(r2)
    waiting = await tasks.queued(probe, other.acquire())
    info = await other.inspect()
    assert (info.name, info.limit, info.holders, info.queue_length, info.fence) == (
        name,
        3,
        3,
        1,
        fences[-1],
    )
    await sems[1].release()
    assert await asyncio.wait_for(waiting, BOUND)  # the freed permit went to the waiter
    assert other.fencing_token is None  # it belongs to the task that acquired
    info = await other.inspect()
    assert (info.holders, info.queue_length) == (3, 0) and info.fence > fences[-1]
    assert await other.available() == 0
    await sems[0].release()
    await sems[2].release()
    assert (await other.available(), await other.holders()) == (2, 1)
    await other.release()  # adopts the holding of the finished task
    assert (await other.available(), await other.holders()) == (3, 0)
    assert not await other.locked()


async def test_fifo_and_no_barging(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """limit=2, both held; 5 waiters queued one after another get the cycling permit in
    queue order, and a holder that releases and re-acquires at once comes after all."""
    name = "s:fifo"
    first = RedisSemaphore(r, name, limit=2, ttl=10)
    second = RedisSemaphore(r, name, limit=2, ttl=10)
    assert await first.acquire() and await second.acquire()
    shared = RedisSemaphore(r2, name, limit=2, ttl=10)
    probe = QueueProbe(r2)
    order: list[tuple[int, int]] = []  # (index, fence) in the order they got in

    async def waiter(index: int) -> None:
        async with shared:
            fence = shared.fencing_token
            assert fence is not None
            order.append((index, fence))
            await asyncio.sleep(0.01)

    waiters = [await tasks.queued(probe, waiter(index)) for index in range(5)]
    assert (await first.inspect()).queue_length == 5
    await first.release()
    assert await first.acquire(timeout=BOUND * 2)  # must queue behind all five
    again = first.fencing_token
    await asyncio.wait_for(asyncio.gather(*waiters), BOUND)
    assert [index for index, _ in order] == list(range(5))
    granted = [fence for _, fence in order]
    assert granted == sorted(set(granted)) and again is not None and again > granted[-1]
    await first.release()
    await second.release()
    info = await first.inspect()
    assert (info.holders, info.queue_length, info.fence) == (0, 0, again)


async def test_several_permits_freed_at_once_wake_that_many(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """limit=4, all held; 6 waiters queued; 3 holders release together: exactly the 3
    first-queued waiters get in, the other 3 stay queued."""
    name = "s:several"
    holders_go = asyncio.Event()
    holding = asyncio.Semaphore(0)

    async def holder() -> None:
        async with RedisSemaphore(r, name, limit=4, ttl=10):
            holding.release()
            await holders_go.wait()

    holder_tasks = [tasks.start(holder()) for _ in range(3)]
    last = RedisSemaphore(r, name, limit=4, ttl=10)
    for _ in range(3):
        await asyncio.wait_for(holding.acquire(), BOUND)
    assert await last.acquire(blocking=False)

    shared = RedisSemaphore(r2, name, limit=4, ttl=10)
    probe = QueueProbe(r2)
    entered: list[int] = []
    changed = asyncio.Condition()
    leave = asyncio.Event()

    async def waiter(index: int) -> None:
        async with shared:
            async with changed:
                entered.append(index)
                changed.notify_all()
            await leave.wait()

    waiters = [await tasks.queued(probe, waiter(index)) for index in range(6)]
    assert (await last.inspect()).queue_length == 6
    holders_go.set()
    await asyncio.wait_for(asyncio.gather(*holder_tasks), BOUND)

    async def three_in() -> None:
        async with changed:
            await changed.wait_for(lambda: len(entered) >= 3)

    await asyncio.wait_for(three_in(), BOUND)
    info = await last.inspect()
    assert (info.holders, info.queue_length) == (4, 3), info
    assert sorted(entered) == [0, 1, 2]
    assert not any(task.done() for task in waiters)

    leave.set()
    await last.release()
    await asyncio.wait_for(asyncio.gather(*waiters), BOUND)
    assert sorted(entered) == list(range(6))
    info = await last.inspect()
    assert (info.holders, info.queue_length) == (0, 0) and info.fence > 0


async def test_timeout_from_the_constructor(r: redis.asyncio.Redis) -> None:
    name = "s:timeout"
    holder = RedisSemaphore(r, name, limit=1, ttl=10)
    assert await holder.acquire()
    first = holder.fencing_token or 0
    impatient = RedisSemaphore(r, name, limit=1, ttl=10, timeout=0.2)
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        async with impatient:
            pytest.fail("entered a semaphore whose only permit is held")
    assert 0.2 <= time.monotonic() - started < 0.2 + 1.0
    assert (await holder.inspect()).queue_length == 0  # the timed-out waiter withdrew
    await holder.release()
    async with impatient:
        assert (impatient.fencing_token or 0) > first


# -- two limits, and deliberate changes -------------------------------------------------


@pytest.mark.parametrize(("established", "other"), [(3, 5), (5, 3)])
async def test_limit_mismatch_changes_nothing(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks, established: int, other: int
) -> None:
    """With the name in use at limit `established` (all permits held, one waiter queued),
    a client asking for limit `other` gets LimitMismatch naming both, and not a key of the
    semaphore changes."""
    name = "s:mismatch"
    held = [RedisSemaphore(r, name, limit=established, ttl=30) for _ in range(established)]
    for sem in held:
        assert await sem.acquire(blocking=False)
    probe = QueueProbe(r2)
    queued_sem = RedisSemaphore(r2, name, limit=established, ttl=30)
    waiting = await tasks.queued(probe, queued_sem.acquire())
    before = await semaphore_keys(r, name)
    assert before, "the semaphore keeps nothing in Redis?"
    wrong = RedisSemaphore(r2, name, limit=other, ttl=30)
    for attempt in ("blocking", "non-blocking", "async-with"):
        with pytest.raises(LimitMismatch) as info:
            if attempt == "blocking":
                await asyncio.wait_for(wrong.acquire(timeout=1), BOUND)
            elif attempt == "non-blocking":
                await wrong.acquire(blocking=False)
            else:
                async with wrong:
                    pytest.fail("entered with a mismatched limit")
        message = str(info.value)
        assert re.search(rf"\b{established}\b", message), message
        assert re.search(rf"\b{other}\b", message), message
        assert isinstance(info.value, LockError) and isinstance(info.value, ValueError)
    assert wrong.statistics().held_here == 0
    assert await semaphore_keys(r, name) == before
    assert not waiting.done()
    await held[0].release()
    assert await asyncio.wait_for(waiting, BOUND)
    info_now = await held[1].inspect()
    assert (info_now.limit, info_now.holders, info_now.queue_length) == (
        established,
        established,
        0,
    )
    for sem in held[1:]:
        await sem.release()
    await queued_sem.release()  # adopts the holding of the finished task
    assert (await queued_sem.inspect()).holders == 0


async def test_raising_the_limit_wakes_that_many_waiters(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """limit 1 -> 3 while one permit is held and 3 wait: the first 2 queued get in without
    any release, the third stays queued."""
    name = "s:raise"
    holder = RedisSemaphore(r, name, limit=1, ttl=10)
    assert await holder.acquire()
    shared = RedisSemaphore(r2, name, limit=1, ttl=10)
    probe = QueueProbe(r2)
    entered: list[int] = []
    changed = asyncio.Condition()
    leave = asyncio.Event()

    async def waiter(index: int) -> None:
        async with shared:
            async with changed:
                entered.append(index)
                changed.notify_all()
            await leave.wait()

    waiters = [await tasks.queued(probe, waiter(index)) for index in range(3)]
    assert (await holder.inspect()).queue_length == 3
    await holder.set_limit(3)

    async def two_in() -> None:
        async with changed:
            await changed.wait_for(lambda: len(entered) >= 2)

    await asyncio.wait_for(two_in(), BOUND)
    info = await holder.inspect()
    assert (info.limit, info.holders, info.queue_length) == (3, 3, 1), info
    assert sorted(entered) == [0, 1]
    assert await holder.available() == 0
    assert await holder.locked()
    leave.set()
    await asyncio.wait_for(asyncio.gather(*waiters), BOUND)
    assert sorted(entered) == [0, 1, 2]
    await holder.release()
    assert (await holder.available(), await holder.holders()) == (3, 0)


async def test_lowering_the_limit_evicts_nobody(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """limit 3 -> 1 while 3 hold (ttl=1, so each is renewed during the test): none loses
    its permit; a waiter gets in only once the holders are down to 0."""
    name = "s:lower"
    held = [RedisSemaphore(r, name, limit=3, ttl=1) for _ in range(3)]
    for sem in held:
        assert await sem.acquire(blocking=False)
    await held[0].set_limit(1)
    assert (await held[0].inspect()).limit == 1

    waiter = RedisSemaphore(r2, name, limit=1, ttl=10)
    probe = QueueProbe(r2)
    waiting = await tasks.queued(probe, waiter.acquire())
    await asyncio.sleep(1.2)  # more than one lease: each was renewed at least twice
    assert not any(sem.lost.is_set() for sem in held)
    assert (await waiter.holders(), await waiter.available()) == (3, 0)
    assert await waiter.locked()
    before = (await waiter.inspect()).fence
    for remaining in (2, 1):
        await held[remaining].release()
        info = await waiter.inspect()
        assert (info.holders, info.queue_length) == (remaining, 1), info
        assert not waiting.done()
    await held[0].release()
    assert await asyncio.wait_for(waiting, BOUND)
    info = await waiter.inspect()
    assert (info.limit, info.holders, info.queue_length) == (1, 1, 0)
    assert info.fence > before  # the waiter's grant took a fence above every holder's
    await waiter.release()


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, ValueError),
        ({"limit": -1}, ValueError),
        ({"limit": 1.5}, TypeError),
        ({"limit": 3.0}, TypeError),
        ({"limit": "3"}, TypeError),
        ({"limit": True}, TypeError),
        ({"limit": None}, TypeError),
        ({"ttl": 0}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"name": ""}, ValueError),
        ({"name": "a{b"}, ValueError),
        ({"timeout": -1}, ValueError),
    ],
)
async def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], error: type) -> None:
    # A client for a port nothing listens on: any Redis call would fail differently.
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    args: dict[str, object] = {"name": "ok", "limit": 3}
    args.update(kwargs)
    try:
        with pytest.raises(error) as info:
            RedisSemaphore(client, **args)  # type: ignore[arg-type]
        assert str(info.value)
        assert context_for(client).commands_sent == 0
    finally:
        await client.aclose()


def test_limit_mismatch_is_a_lock_error_and_a_value_error() -> None:
    assert issubclass(LimitMismatch, LockError)
    assert issubclass(LimitMismatch, ValueError)


# -- lease loss -----------------------------------------------------------------------------


async def test_lost_permit_cancels_the_body_and_raises(r: redis.asyncio.Redis) -> None:
    """The holder's entry vanishes from the holders set: the body is cancelled within the
    ttl, LockLost is raised, and the permit is free again."""
    name, ttl = "s:lost", 1.0
    sem = RedisSemaphore(r, name, limit=2, ttl=ttl)
    holders_key = f"{_prefix(name)}holders"
    finished = False
    started = 0.0
    with pytest.raises(LockLost) as info:
        async with sem:
            members = await r.zrange(holders_key, 0, -1)
            assert len(members) == 1, members
            assert await r.zrem(holders_key, *members) == 1
            started = time.monotonic()
            await asyncio.sleep(10)
            finished = True
    assert not finished
    assert time.monotonic() - started < ttl + 0.5  # noticed within the ttl (renewal at ttl/3)
    assert info.value.name == name
    assert sem.statistics().held_here == 0
    assert (await sem.available(), await sem.holders()) == (2, 0)
    last = (await sem.inspect()).fence
    async with sem:
        assert (sem.fencing_token or 0) > last > 0


async def test_waiters_queued_before_set_limit_keep_waiting_and_leave_no_ghost(
    r: redis.asyncio.Redis, url: str
) -> None:
    other = redis.asyncio.Redis.from_url(url)
    try:
        holder = RedisSemaphore(r, "s:queued-set-limit", limit=1, ttl=1)
        assert await holder.acquire()
        waiters = RedisSemaphore(other, "s:queued-set-limit", limit=1, ttl=10)
        probe = QueueProbe(other)
        first = asyncio.create_task(waiters.acquire(timeout=5))
        await probe.wait_queued(1)
        second = asyncio.create_task(waiters.acquire(timeout=5))
        await probe.wait_queued(2)
        await holder.set_limit(2)  # lets the first waiter in; the second stays queued
        assert await asyncio.wait_for(first, 5) is True
        # The second re-checks (as on its timer, a keyspace event or a reconnect): it keeps
        # waiting under the stored limit, not refused with a stale entry left queued.
        context_for(other).waitqueue.recheck_all()
        await asyncio.sleep(0.3)  # one round trip for the re-check
        assert not second.done(), second
        info = await holder.inspect()
        assert (info.holders, info.queue_length) == (2, 1)
        await holder.release()
        assert await asyncio.wait_for(second, 5) is True
        info = await holder.inspect()
        assert (info.holders, info.queue_length) == (2, 0)
        # A new arrival with the old limit is refused, and leaves nothing queued.
        with pytest.raises(LimitMismatch):
            await RedisSemaphore(other, "s:queued-set-limit", limit=1).acquire()
        assert (await holder.inspect()).queue_length == 0
    finally:
        await other.aclose()
