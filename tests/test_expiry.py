"""No key left behind (issue 14): every key of a mutex, semaphore, RW lock and election has
an expiry, and a name nobody holds or waits for is gone within 2 x ttl + 1 s of its last
release, its fence counter within max(ttl + 1 s, 5 s) of its last grant (the design keeps
ttl + 1 s: docs/architecture.md, "Fences and expiry"); fences stay strictly increasing
across that expiry. The registry is data and stays.

Waiting is bounded and never polls: each test waits the computed window once (or a key's
own PTTL), then looks with one SCAN.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio
from _probes import QueueProbe
from _servers import ServerProcess, binary_path
from conftest import Tasks

from aiolocks import (
    LimitMismatch,
    LockTimeout,
    RedisElection,
    RedisMutex,
    RedisReadWriteLock,
    RedisRegistry,
    RedisSemaphore,
)
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import LeasedLock

TTL = 1.0
IDLE = 1.0  # IDLE_MS in _prelude.lua: keys outlive the last lease by this much
PROMISE = 2 * TTL + 1.0  # the documented bound after the last release
FENCE_KEEP = 5.0  # FENCE_KEEP_MS in _prelude.lua: a fence counter outlives its grant this long


@pytest.fixture
async def clients(url: str) -> AsyncIterator[Callable[[], redis.asyncio.Redis]]:
    """Makes more clients on the (flushed) server, each its own engine context."""
    made: list[redis.asyncio.Redis] = []

    def make() -> redis.asyncio.Redis:
        made.append(redis.asyncio.Redis.from_url(url))
        return made[-1]

    try:
        yield make
    finally:
        for client in made:
            await client.aclose()


async def lock_keys(r: redis.asyncio.Redis) -> dict[str, int]:
    """Every aiolocks key but the registry's, with its PTTL (ms; -1: no expiry)."""
    keys = [key async for key in r.scan_iter(match="aiolocks:*") if b":registry:" not in key]
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    return {key.decode(): int(pttl) for key, pttl in zip(keys, await pipe.execute(), strict=True)}


def side(kind: str, client: redis.asyncio.Redis, name: str, **options: Any) -> LeasedLock:
    """A lock of `kind` ("mutex", "semaphore", "read", "write") named `name`."""
    if kind == "mutex":
        return RedisMutex(client, name, **options)
    if kind == "semaphore":
        return RedisSemaphore(client, name, limit=1, **options)
    rw = RedisReadWriteLock(client, name, **options)
    return rw.read() if kind == "read" else rw.write()


KINDS = ("mutex", "semaphore", "read", "write")


async def released(lock: LeasedLock) -> None:
    assert await lock.acquire()
    await lock.release()


async def handed_on(holder: LeasedLock, waiter: LeasedLock, probe: QueueProbe) -> None:
    """`holder` holds, `waiter` queues from another client, gets it on release, releases."""

    async def wait_and_release() -> None:
        assert await waiter.acquire(timeout=10)
        await waiter.release()

    assert await holder.acquire()
    waiting = asyncio.create_task(wait_and_release())
    await probe.wait_queued(len(probe.queued) + 1)
    await holder.release()
    await asyncio.wait_for(waiting, 10)


async def timed_out(holder: LeasedLock, waiter: LeasedLock) -> None:
    """A waiter queued behind `holder` gives up on its timeout; then the holder releases."""
    assert await holder.acquire()
    assert await waiter.acquire(timeout=0.3) is False
    await holder.release()


async def cancelled(holder: LeasedLock, waiter: LeasedLock, probe: QueueProbe) -> None:
    """A waiter queued behind `holder` is cancelled; then the holder releases."""
    assert await holder.acquire()
    waiting = asyncio.create_task(waiter.acquire())
    await probe.wait_queued(len(probe.queued) + 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await holder.release()


async def cohort(client: redis.asyncio.Redis, other: LeasedLock, probe: QueueProbe) -> None:
    """Local hand-offs among 4 tasks of one process (local_handoff=2), with a remote waiter queued:
    the lease goes back and forth between the cohort and the global queue."""
    mutex = RedisMutex(client, "e:cohort", ttl=TTL, local_handoff=2)

    async def hold() -> None:
        async with mutex:
            await asyncio.sleep(0.01)

    assert await mutex.acquire()
    tasks = [asyncio.create_task(hold()) for _ in range(4)]
    remote = asyncio.create_task(released(other))
    await probe.wait_queued(len(probe.queued) + 1)
    await mutex.release()
    await asyncio.wait_for(asyncio.gather(*tasks, remote), 10)


async def abandoned(lock: LeasedLock) -> None:
    """A holder whose process stops renewing (as if it died): its lease just runs out."""
    assert await lock.acquire()
    holding = lock._current()
    assert holding is not None and holding.lease is not None
    context_for(lock._client).keeper.drop(holding.lease)


async def campaigned(election: RedisElection) -> None:
    """Elected (nobody leads), proclaims, resigns by leaving the block."""
    async with election.campaign("a") as term:
        await term.proclaim("b")


async def elected_on(leader: RedisElection, candidate: RedisElection, probe: QueueProbe) -> None:
    """`candidate` queues (another client) behind `leader`, is elected when it resigns."""

    async def run() -> None:
        async with candidate.campaign("next", timeout=10):
            pass

    async with leader.campaign("first"):
        waiting = asyncio.create_task(run())
        await probe.wait_queued(len(probe.queued) + 1)
    await asyncio.wait_for(waiting, 10)


async def campaign_timed_out(leader: RedisElection, candidate: RedisElection) -> None:
    async with leader.campaign("first"):
        with pytest.raises(LockTimeout):
            async with candidate.campaign("late", timeout=0.3):
                pass


async def campaign_cancelled(
    leader: RedisElection, candidate: RedisElection, probe: QueueProbe
) -> None:
    async def run() -> None:
        async with candidate.campaign("cancelled"):
            pass

    async with leader.campaign("first"):
        waiting = asyncio.create_task(run())
        await probe.wait_queued(len(probe.queued) + 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


def election_scenarios(
    r: redis.asyncio.Redis, clients: Callable[[], redis.asyncio.Redis]
) -> list[Awaitable[None]]:
    """An election through every path: campaign/proclaim/resign, elected on a resignation,
    a campaign timed out, one cancelled while queued, a leader whose process died."""

    def pair(path: str) -> tuple[RedisElection, RedisElection, QueueProbe]:
        other = clients()
        name = f"e:election:{path}"
        leader, candidate = (RedisElection(client, name, ttl=TTL) for client in (r, other))
        return leader, candidate, QueueProbe(other)

    leader, candidate, probe = pair("handoff")
    handoff = elected_on(leader, candidate, probe)
    leader, candidate, _ = pair("timeout")
    timeout = campaign_timed_out(leader, candidate)
    leader, candidate, probe = pair("cancel")
    cancel = campaign_cancelled(leader, candidate, probe)
    crashed = RedisElection(clients(), "e:election:abandoned", ttl=TTL)._probe
    resigned = campaigned(RedisElection(r, "e:election:release", ttl=TTL))
    return [handoff, timeout, cancel, resigned, abandoned(crashed)]


@pytest.mark.slow
async def test_nothing_is_left_after_the_idle_window(
    r: redis.asyncio.Redis, clients: Callable[[], redis.asyncio.Redis]
) -> None:
    """Every kind, every path (release, hand-off, timeout, cancellation, a local hand-off
    cohort, an abandoned lease; an election's the same ways), all at once: right after,
    every key left has an expiry within ttl + 1 s; after 2 x ttl + 1 s nothing is left but
    the registry."""
    registry = RedisRegistry(r, "e:users")
    assert await registry.register("alice") == 1

    def pair(kind: str, path: str) -> tuple[LeasedLock, LeasedLock, QueueProbe]:
        """A holder of `kind` and a waiter (of the other side, for a RW lock) on another
        client, with a probe of that client's queue entries."""
        other = clients()
        name = f"e:{kind}:{path}"
        waiter_kind = {"read": "write", "write": "read"}.get(kind, kind)
        return (
            side(kind, r, name, ttl=TTL),
            side(waiter_kind, other, name, ttl=TTL),
            QueueProbe(other),
        )

    scenarios: list[Awaitable[None]] = []
    for kind in KINDS:
        holder, waiter, probe = pair(kind, "handoff")
        scenarios.append(handed_on(holder, waiter, probe))
        holder, waiter, _ = pair(kind, "timeout")
        scenarios.append(timed_out(holder, waiter))
        holder, waiter, probe = pair(kind, "cancel")
        scenarios.append(cancelled(holder, waiter, probe))
        scenarios.append(released(side(kind, r, f"e:{kind}:release", ttl=TTL)))
        scenarios.append(abandoned(side(kind, clients(), f"e:{kind}:abandoned", ttl=TTL)))
    remote = clients()
    scenarios.append(cohort(r, RedisMutex(remote, "e:cohort", ttl=TTL), QueueProbe(remote)))
    scenarios.extend(election_scenarios(r, clients))
    await asyncio.wait_for(asyncio.gather(*scenarios), 20)
    finished = time.monotonic()

    left = await lock_keys(r)
    assert any(key.endswith(":fence") for key in left), left  # there was something to expire
    assert any(key.startswith("aiolocks:election:") for key in left), left

    # Every key has an expiry, at most ttl + 1 s away, a fence counter's at most
    # max(ttl + 1 s, FENCE_KEEP) (ms, with 100 ms for the HLC margin).
    def bound(key: str) -> float:
        keep = max(TTL + IDLE, FENCE_KEEP) if key.endswith(":fence") else TTL + IDLE
        return keep * 1000 + 100

    assert all(0 < pttl <= bound(key) for key, pttl in left.items()), left

    await asyncio.sleep(max(0.0, finished + max(PROMISE, FENCE_KEEP) - time.monotonic()))
    assert await lock_keys(r) == {}
    assert await registry.id_of("alice") == 1  # the registry is data: it stays
    assert all(
        pttl == -1 for pttl in [await r.pttl(key) async for key in r.scan_iter("aiolocks:*")]
    )


async def test_fences_keep_rising_after_the_keys_expired(r: redis.asyncio.Redis) -> None:
    """For each kind and a cohort: fences before the keys expired are all below the next
    one after; a fence is the server clock in microseconds (bumped when needed)."""
    ttl = 0.2
    kinds: dict[str, Callable[[], LeasedLock]] = {
        kind: functools.partial(side, kind, r, f"f:{kind}", ttl=ttl) for kind in KINDS
    }
    kinds["cohort"] = functools.partial(RedisMutex, r, "f:cohort", ttl=ttl, local_handoff=8)

    async def fences_of(make: Callable[[], LeasedLock]) -> list[int]:
        lock, fences = make(), []

        async def hold() -> None:
            async with lock:
                fences.append(lock.fencing_token or 0)

        await asyncio.gather(*(hold() for _ in range(5)))
        return fences

    async def terms() -> list[int]:
        """Five terms of an election, each candidate queued behind the one before."""
        election, fences = RedisElection(r, "f:election", ttl=ttl), []

        async def lead() -> None:
            async with election.campaign("x") as term:
                fences.append(term.fencing_token)

        await asyncio.gather(*(lead() for _ in range(5)))
        return fences

    async def fences_by_kind() -> dict[str, list[int]]:
        found = {kind: await fences_of(make) for kind, make in kinds.items()}
        found["election"] = await terms()
        return found

    before = await fences_by_kind()
    seconds, micros = await r.time()
    clock_us = int(seconds) * 1_000_000 + int(micros)
    for kind, fences in before.items():
        assert len(set(fences)) == 5, (kind, fences)
        assert all(0 < clock_us - fence < 10_000_000 for fence in fences), (kind, fences)
    left = await lock_keys(r)
    assert left and all(pttl > 0 for pttl in left.values()), left
    await asyncio.sleep(max(left.values()) / 1000 + 0.05)  # the longest expiry, once
    assert await lock_keys(r) == {}

    after = await fences_by_kind()
    for kind in before:
        assert min(after[kind]) > max(before[kind]), (kind, before[kind], after[kind])


@pytest.mark.parametrize("server", ["valkey-notify"], indirect=True)
async def test_a_cohort_ahead_of_the_clock_keeps_its_fence_key_longer(
    r: redis.asyncio.Redis,
) -> None:
    """Blocks of 10,001 fences reserved faster than one fence per microsecond run the
    counter ahead of the server clock: its key lives until the clock has passed it, so the
    next fence after expiry is still above every fence handed out."""
    ttl = 0.2
    mutex = RedisMutex(r, "ahead", ttl=ttl, local_handoff=10_000)
    fence_key = mutex._spec.keys[3]
    for _ in range(100):  # uncontended: each acquisition is a grant from Redis
        await released(mutex)
    last = int(await r.get(fence_key) or 0)
    seconds, micros = await r.time()
    ahead_ms = (last - (int(seconds) * 1_000_000 + int(micros))) / 1000
    assert ahead_ms > 200, ahead_ms  # 100 blocks of 10 ms, in well under a second
    pttl = await r.pttl(fence_key)
    assert pttl >= ttl * 1000 + IDLE * 1000 + ahead_ms - 50, (pttl, ahead_ms)
    await asyncio.sleep(pttl / 1000 + 0.05)
    assert await r.exists(fence_key) == 0
    assert await mutex.acquire()
    assert (mutex.fencing_token or 0) > last
    await mutex.release()


@pytest.mark.slow
async def test_the_semaphore_limit_lives_with_its_users_and_expires_with_them(
    r: redis.asyncio.Redis, clients: Callable[[], redis.asyncio.Redis], tasks: Tasks
) -> None:
    """Renewals and heartbeats keep the stored limit (and the queue) past ttl + 1 s while
    anyone holds or waits, so two live users who disagree still get `LimitMismatch`; once
    nobody uses the name, the limit expires with the rest and a new limit is taken."""
    ttl = 0.3
    other = clients()
    holder = RedisSemaphore(r, "lim", limit=1, ttl=ttl)
    waiter = RedisSemaphore(other, "lim", limit=1, ttl=ttl)
    assert await holder.acquire()
    probe = QueueProbe(other)
    waiting = await tasks.queued(probe, waiter.acquire())
    await asyncio.sleep(ttl + IDLE + 0.3)  # past what a grant or an enqueue alone keeps
    info = await holder.inspect()
    assert (info.limit, info.holders, info.queue_length) == (1, 1, 1), info
    with pytest.raises(LimitMismatch):
        await RedisSemaphore(clients(), "lim", limit=3, ttl=ttl).acquire(blocking=False)
    await holder.release()
    assert await asyncio.wait_for(waiting, 5)
    await waiter.release()
    finished = time.monotonic()
    assert 0 < await r.pttl(holder._spec.keys[5]) <= (ttl + IDLE) * 1000
    await asyncio.sleep(max(0.0, finished + 2 * ttl + IDLE - time.monotonic()))
    assert set(await lock_keys(r)) <= {"aiolocks:semaphore:{lim}:fence"}  # (FENCE_KEEP)
    assert (await holder.inspect()).limit is None
    wider = RedisSemaphore(clients(), "lim", limit=3, ttl=ttl)
    assert await wider.acquire(blocking=False)  # nobody live disagrees any more
    assert (await wider.inspect()).limit == 3
    await wider.release()


async def test_candidates_values_live_as_long_as_they_wait(
    r: redis.asyncio.Redis, clients: Callable[[], redis.asyncio.Redis], tasks: Tasks
) -> None:
    """A candidate queued past what its enqueue alone keeps (its ttl + 1 s) still has its
    value when elected: its heartbeats keep the candidates hash with the queue (the leader's
    lease is long, so nothing else re-writes it meanwhile); nothing is left but the fence."""
    ttl = 0.3
    other = clients()
    leader = RedisElection(r, "cand", ttl=5)
    candidate = RedisElection(other, "cand", ttl=ttl)

    async def wait_then_lead() -> tuple[str, int]:
        async with candidate.campaign("patient") as term:
            info = await candidate.leader()
            assert info is not None
            return info.value, term.fencing_token

    async with leader.campaign("first") as first:
        waiting = await tasks.queued(QueueProbe(other), wait_then_lead())
        await asyncio.sleep(ttl + IDLE + 0.3)  # past what an enqueue alone keeps
        info = await leader.inspect()
        assert (info.value, info.candidates) == ("first", 1), info
        assert 0 < await r.pttl("aiolocks:election:{cand}:candidates") <= (ttl + IDLE) * 1000
    value, fence = await asyncio.wait_for(waiting, 5)
    assert (value, fence > first.fencing_token) == ("patient", True)
    left = await lock_keys(r)
    assert set(left) == {"aiolocks:election:{cand}:fence"}, left
    assert 0 < left["aiolocks:election:{cand}:fence"] <= (5 + IDLE) * 1000 + 100, left


@pytest.mark.slow
async def test_fences_rise_across_a_restart_with_persistence(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """AOF on: after a restart the fence keys are back with their expiry, and every kind's
    next fence is above the ones before the restart."""
    kind = "redis" if binary_path("redis") else "valkey"
    server = server_factory(
        kind=kind, extra_args=["--appendonly", "yes", "--appendfsync", "always"]
    )
    before: dict[str, int] = {}
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        for name in KINDS:
            lock = side(name, client, f"p:{name}", ttl=5)
            async with lock:
                before[name] = lock.fencing_token or 0
    finally:
        await client.aclose()
    server.restart(keep_dir=True)
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        left = await lock_keys(client)  # fence counters (and the semaphore's limit) only
        fences = {f"aiolocks:{_kind(name)}:{{p:{name}}}:fence" for name in KINDS}
        assert set(left) == fences | {"aiolocks:semaphore:{p:semaphore}:limit"}, left
        assert all(0 < pttl <= 6_000 for pttl in left.values()), left  # expiring still
        for name in KINDS:
            lock = side(name, client, f"p:{name}", ttl=5)
            async with lock:
                assert (lock.fencing_token or 0) > before[name], name
    finally:
        await client.aclose()


def _kind(name: str) -> str:
    return "rwlock" if name in ("read", "write") else name


async def test_an_adopted_holding_keeps_its_keys_as_long_as_its_new_lease(
    r: redis.asyncio.Redis, clients: Callable[[], redis.asyncio.Redis]
) -> None:
    """`adopt()` with a longer ttl keeps every key of the lease (fence counter, fences,
    limit) as long as the adopter's lease, as a renewal does: the expiries set by the short
    first grant would otherwise end before it."""
    other = clients()
    for kind in KINDS:
        first = side(kind, r, f"a:{kind}", ttl=0.3)
        second = side(kind, other, f"a:{kind}", ttl=5)
        assert await first.acquire()
        await second.adopt(first.detach())
        left = await lock_keys(r)
        kept = {key: ms for key, ms in left.items() if not key.endswith((":owner", ":writer"))}
        assert kept and all(5_000 < ms <= 6_000 for ms in kept.values()), (kind, left)
        await second.release()
        assert all(0 < pttl <= 6_000 for pttl in (await lock_keys(r)).values())
        await r.flushall()
