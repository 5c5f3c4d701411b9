"""Hand-over: `detach()` a holding, pass its `LockHandle` on, `adopt()` it elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import random
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _servers import ServerProcess
from _web import ONE_SERVER, load_example
from _workers import Spawn
from conftest import freed_by_reference_counting

from aiolocks import (
    LockError,
    LockHandle,
    LockLost,
    LockNotOwned,
    LockReentry,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
)

Factory = Callable[..., Any]

FACTORIES: dict[str, Factory] = {
    "mutex": lambda client, name, **kw: RedisMutex(client, name, **kw),
    "semaphore": lambda client, name, **kw: RedisSemaphore(client, name, limit=1, **kw),
    "rwlock-read": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).read(),
    "rwlock-write": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).write(),
}
# What a holding of FACTORIES[kind] keeps out (a reader keeps writers out).
EXCLUDED: dict[str, Factory] = {
    **FACTORIES,
    "rwlock-read": lambda client, name, **kw: RedisReadWriteLock(client, name, **kw).write(),
}
ADOPTER = Path(__file__).resolve().parent / "workers" / "handle_adopter.py"
TTL = 0.5


async def _held_by(lock: Any) -> str | None:
    """The token(s) the server shows as holding `lock`'s name with a live lease (None: nobody)."""
    client, spec = lock._client, lock._spec
    if lock._handle_kind in ("semaphore", "rwlock-read"):
        seconds, micros = await client.time()
        now = seconds * 1000 + micros // 1000
        holders = spec.keys[0 if lock._handle_kind == "semaphore" else 1]
        tokens = await client.zrangebyscore(holders, now, "+inf")
    else:
        token = await client.get(spec.keys[0])
        tokens = [] if token is None else [token]
    return b",".join(tokens).decode() or None


async def _queued(lock: Any) -> int:
    queue = next(key for key in lock._spec.keys if key.endswith(b":queue"))
    return int(await lock._client.llen(queue))


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_a_detached_holding_is_adopted_renewed_and_released_elsewhere(
    clients: list[redis.asyncio.Redis], kind: str
) -> None:
    first = FACTORIES[kind](clients[0], "ho:basic", ttl=TTL)
    second = FACTORIES[kind](clients[1], "ho:basic", ttl=TTL)
    excluded = EXCLUDED[kind](clients[1], "ho:basic", ttl=TTL)
    assert await first.acquire()
    fence = first.fencing_token
    handle = first.detach()
    assert not first.held() and first.fencing_token is None
    with pytest.raises(LockNotOwned):
        await first.release()
    assert (handle.kind, handle.name, handle.fencing_token) == (kind, "ho:basic", fence)
    assert LockHandle.parse(str(handle)) == handle

    await second.adopt(LockHandle.parse(str(handle)))
    assert second.held() and second.fencing_token == fence
    await asyncio.sleep(4 * TTL)  # several leases long: renewed by the adopter
    assert not second.lost.is_set()
    assert await excluded.acquire(blocking=False) is False
    await second.release()
    assert await _held_by(second) is None
    assert await excluded.acquire(blocking=False) is True
    await excluded.release()


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_a_detached_instance_is_freed_without_the_garbage_collector(
    clients: list[redis.asyncio.Redis], kind: str
) -> None:
    """An instance whose holding was detached is freed by reference counting: the holding
    owned its own lease, each referring to the other, and detaching left the pair (with the
    instance and the task) for the garbage collector."""

    async def hand_over() -> weakref.ref[Any]:
        first = FACTORIES[kind](clients[0], "ho:freed", ttl=TTL)
        assert await first.acquire()
        handle = first.detach()
        second = FACTORIES[kind](clients[1], "ho:freed", ttl=TTL)
        await second.adopt(handle)
        await second.release()
        return weakref.ref(first)

    assert await freed_by_reference_counting(hand_over), "left to the collector"


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_a_handle_is_adopted_once(clients: list[redis.asyncio.Redis], kind: str) -> None:
    first = FACTORIES[kind](clients[0], "ho:twice", ttl=5)
    assert await first.acquire()
    handle = first.detach()
    adopters = [FACTORIES[kind](client, "ho:twice", ttl=5) for client in clients]
    outcomes = await asyncio.gather(
        *(adopter.adopt(handle) for adopter in adopters), return_exceptions=True
    )
    assert sum(outcome is None for outcome in outcomes) == 1, outcomes
    refused = next(outcome for outcome in outcomes if outcome is not None)
    assert isinstance(refused, LockLost) and "adopted already" in refused.reason
    winner = adopters[outcomes.index(None)]
    with pytest.raises(LockLost):  # and later too, from the same instance
        await FACTORIES[kind](clients[0], "ho:twice", ttl=5).adopt(handle)
    assert winner.statistics().held_here == 1  # held by the gathered task, now ended
    await winner.release()
    assert await _held_by(winner) is None


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "rwlock-write"])
async def test_adopting_an_ended_holding_raises_at_once_and_takes_nothing(
    clients: list[redis.asyncio.Redis], kind: str
) -> None:
    first = FACTORIES[kind](clients[0], "ho:ended", ttl=TTL)
    assert await first.acquire()
    handle = first.detach()
    await asyncio.sleep(TTL * 2)  # nothing renews it: the lease ends on the server
    adopter = FACTORIES[kind](clients[1], "ho:ended", ttl=5)
    with pytest.raises(LockLost, match="has ended"):
        await asyncio.wait_for(adopter.adopt(handle), 1.0)
    assert not adopter.held()
    assert await _held_by(adopter) is None  # the free lock was not taken anew
    assert await _queued(adopter) == 0  # nor queued for


async def test_adopting_a_handle_of_another_lock_is_refused_before_any_call(
    clients: list[redis.asyncio.Redis],
) -> None:
    mutex = RedisMutex(clients[0], "ho:other", ttl=5)
    assert await mutex.acquire()
    handle = mutex.detach()
    wrong = [
        RedisMutex(clients[1], "ho:another-name", ttl=5),
        RedisSemaphore(clients[1], "ho:other", limit=1, ttl=5),
        RedisReadWriteLock(clients[1], "ho:other", ttl=5).write(),
        RedisMutex(clients[1], "ho:other", ttl=5, prefix="elsewhere"),
    ]
    for lock in wrong:
        with pytest.raises(LockError, match="the handle is of mutex 'ho:other'") as caught:
            await lock.adopt(handle)
        assert not isinstance(caught.value, LockLost)
        assert not lock.held()
    assert await _held_by(mutex) == handle.token  # untouched: still the detached holding
    with pytest.raises(TypeError):
        await mutex.adopt(str(handle))  # type: ignore[arg-type]
    rightful = RedisMutex(clients[1], "ho:other", ttl=5)
    await rightful.adopt(handle)
    with pytest.raises(LockReentry):
        await rightful.adopt(handle)
    await rightful.release()


async def test_detach_inside_async_with_leaves_it_held_for_the_adopter(
    clients: list[redis.asyncio.Redis],
) -> None:
    lock = RedisMutex(clients[0], "ho:with", ttl=5)
    async with lock:
        handle = lock.detach()
    # Leaving the block released nothing: the holding waits for its adopter.
    assert await _held_by(lock) == handle.token
    adopter = RedisMutex(clients[1], "ho:with", ttl=5)
    await adopter.adopt(handle)
    await adopter.release()
    assert not await adopter.locked()


async def test_detach_errors(clients: list[redis.asyncio.Redis]) -> None:
    lock = RedisMutex(clients[0], "ho:errors", ttl=5)
    with pytest.raises(LockNotOwned):
        lock.detach()


async def fence_of(mutex: RedisMutex) -> int | None:
    assert await mutex.acquire()
    return mutex.fencing_token


async def test_a_local_handoff_holding_is_handed_over(clients: list[redis.asyncio.Redis]) -> None:
    """A cohort's holding takes the cohort's lease with it: the adopter holds
    it with its fence, the process's other task waits for it through Redis, and gets it
    with a larger fence once the adopter releases."""
    cohort = RedisMutex(clients[0], "ho:cohort", ttl=5, local_handoff=4)
    assert await cohort.acquire()
    fence = cohort.fencing_token
    assert fence is not None
    second = RedisMutex(clients[0], "ho:cohort", ttl=5, local_handoff=4)
    other = asyncio.create_task(fence_of(second))
    await asyncio.sleep(0)
    handle = LockHandle.parse(str(cohort.detach()))
    assert not cohort.held() and handle.fencing_token == fence
    adopter = RedisMutex(clients[1], "ho:cohort", ttl=5)
    await adopter.adopt(handle)
    assert adopter.fencing_token == fence and not other.done()
    await adopter.release()
    second_fence = await asyncio.wait_for(other, 10)
    assert second_fence is not None and second_fence > fence
    await second.release()  # adopts the finished task's holding
    # A plain holding adopted by a cohort's instance is renewed and released as its own.
    plain = RedisMutex(clients[1], "ho:cohort", ttl=5, local_handoff=0)
    assert await plain.acquire()
    await cohort.adopt(plain.detach())
    assert cohort.held()
    await cohort.release()
    assert not await plain.locked()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "aiolocks-handle:1:mutex:aiolocks:x:" + "0" * 32,  # a field short
        "aiolocks-handle:2:mutex:aiolocks:x:" + "0" * 32 + ":1",
        "aiolocks-handle:1:barrier:aiolocks:x:" + "0" * 32 + ":1",
        "aiolocks-handle:1:mutex:aiolocks:x:" + "0" * 31 + ":1",
        "aiolocks-handle:1:mutex:aiolocks:x:" + "0" * 32 + ":-1",
        "aiolocks-handle:1:mutex:aiolocks:x:" + "0" * 32 + ":\u00b2",
        "aiolocks-handle:1:mutex:aiolocks:%7Bx:" + "0" * 32 + ":1",  # a '{' in the name
        "other:1:mutex:aiolocks:x:" + "0" * 32 + ":1",
    ],
)
def test_parse_refuses_what_is_not_a_handle(text: str) -> None:
    with pytest.raises(ValueError):
        LockHandle.parse(text)


def test_handle_round_trips_any_name_and_hides_its_token() -> None:
    handle = LockHandle("rwlock-read", "a:b%c é/ ", "ab" * 16, 2**62, prefix="my:app")
    text = str(handle)
    assert text.count(":") == 6
    assert LockHandle.parse(text) == handle
    assert handle.token not in repr(handle)


async def test_a_cancelled_adopt_leaves_no_orphan(clients: list[redis.asyncio.Redis]) -> None:
    """Adopts cancelled at random moments: the name is held by the handed-over token (the
    script never ran; the handle still works), or by the adopter (it finished), or by
    nobody (the clean-up gave the new token's holding back): never by an unknown token."""
    rng = random.Random(17)
    holder = RedisMutex(clients[0], "ho:storm", ttl=5)
    adopter = RedisMutex(clients[1], "ho:storm", ttl=5)
    outcomes = {"untouched": 0, "adopted": 0, "given back": 0}
    for _ in range(60):
        if await _held_by(holder) is None:
            assert await holder.acquire(timeout=5)
            handle = holder.detach()
        task = asyncio.create_task(adopter.adopt(handle))
        for _ in range(rng.randrange(8)):  # cancelled before, during or after its call
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        owner = await _held_by(holder)
        if adopter._holdings:
            outcomes["adopted"] += 1
            assert owner == next(iter(adopter._holdings.values())).token
            await adopter.release()  # the holding of a task that has ended
        elif owner is None:
            outcomes["given back"] += 1
        else:
            assert owner == handle.token, (owner, handle.token)
            outcomes["untouched"] += 1
    assert outcomes["untouched"] and (outcomes["adopted"] or outcomes["given back"]), outcomes


@pytest.mark.slow
async def test_a_handle_passed_through_a_subprocess(
    valkey_notify: ServerProcess, clients: list[redis.asyncio.Redis], spawn: Spawn
) -> None:
    lock = RedisMutex(clients[0], "ho:process", ttl=10)  # the gap: two processes start
    assert await lock.acquire()
    fence = lock.fencing_token
    text = str(lock.detach())
    adopters = [await spawn(ADOPTER, valkey_notify.url, text, TTL, 4 * TTL) for _ in range(2)]
    firsts = [line[1:] for line in await asyncio.gather(*(w.expect("outcome") for w in adopters))]
    assert sorted(firsts) == [["adopted", str(fence)], ["refused", "LockLost"]], firsts
    other = RedisMutex(clients[1], "ho:process", ttl=TTL)
    assert await other.acquire(blocking=False) is False  # held (and renewed) over there
    assert await other.acquire(timeout=10) is True  # released by the worker
    await other.release()
    for worker in adopters:
        assert await worker.finish() == 0, worker.stderr
    winner = adopters[[line[0] for line in firsts].index("adopted")]
    assert "lost" not in [line.split()[0] for line in winner.lines]
    assert winner.lines[-1] == "released"


@ONE_SERVER
async def test_the_job_queue_example(r: redis.asyncio.Redis, url: str) -> None:
    example = load_example("handover_queue")
    report = await example.run(url, jobs=15, consumers=4)
    assert report.ok, report.summary()
    assert sorted(report.builds) == list(range(1, 16))  # every report built
    builds = sum(map(len, report.builds.values()))
    assert builds + report.refused == 30  # each asked twice: built, or refused as running
    for fences in report.builds.values():
        assert fences == sorted(set(fences))
