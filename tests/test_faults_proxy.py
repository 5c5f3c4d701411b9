"""Faults on the link between a client and the server, made by a loopback proxy
(`tests/_proxy.py`): a stall longer than the lease, connections dropped at exact points of
acquire / release / renewal, and random drops, stalls and latency during a contended run.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
from _faultreport import record
from _faults import KINDS, Contention, Kind, audit, close_client, leftovers, make_sides
from _history import HistoryLog
from _probes import QueueProbe
from _proxy import Proxy
from _servers import ServerProcess
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from aiolocks import LockLost, ServerUnavailable
from aiolocks._engine._leasedlock import LeasedLock
from aiolocks._leases._renewbatch import RENEW_BATCH

pytestmark = pytest.mark.faults


def _lock(client: redis.asyncio.Redis, kind: str, name: str, **options: Any) -> LeasedLock:
    """`kind` is a primitive, or "read"/"write" for a side of the RW lock; one permit for
    the semaphore, so that one holder excludes the other."""
    if kind in ("read", "write"):
        sides = make_sides(client, "rwlock", name, **options)
        return sides[0 if kind == "read" else 1].lock
    return make_sides(client, "semaphore" if kind == "semaphore" else "mutex", name, limit=1,
                      **options)[0].lock  # fmt: skip


def _family(kind: str) -> Kind:
    if kind in ("read", "write"):
        return "rwlock"
    return "semaphore" if kind == "semaphore" else "mutex"


async def _server_lease_end(direct: redis.asyncio.Redis, kind: str, name: str) -> int:
    """When the (single) holder's lease ends on the server, in server ms; -1 if it has none."""
    family = _family(kind)
    base = f"aiolocks:{family}:{{{name}}}:"
    if kind in ("mutex", "write"):
        key = base + ("owner" if kind == "mutex" else "writer")
        return int(await direct.execute_command("PEXPIRETIME", key))  # type: ignore[no-untyped-call]
    key = base + ("holders" if kind == "semaphore" else "readers")
    members = await direct.zrange(key, 0, -1, withscores=True)
    return int(members[0][1]) if len(members) == 1 else -1


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "read", "write"])
async def test_a_stall_past_the_lease_tells_the_holder_before_the_server_lease_ends(
    proxy: Proxy, direct: redis.asyncio.Redis, kind: str
) -> None:
    """The holder talks through the proxy (40 ms each way, a realistic link: it is also the
    margin by which a lease counted from the request's *sending* ends before the server's),
    a waiter on a direct connection. The proxy stalls for good: the holder's body must be
    cancelled and `LockLost` raised, with the loss reported while the server still held the
    lease; then the waiter gets in with a higher fence, and the holder's late clean-up does
    not disturb it."""
    ttl = 1.0
    name = f"stall-{kind}"
    proxied = redis.asyncio.Redis.from_url(proxy.url)
    try:
        lost_at: list[float] = []  # wall-clock ms (the server's TIME uses the same clock)
        lost = asyncio.Event()

        def on_lost(error: LockLost) -> None:
            lost_at.append(time.time() * 1000)
            lost.set()

        holder = _lock(proxied, kind, name, ttl=ttl, on_lost=on_lost)
        waiter = _lock(direct, "write" if kind == "read" else kind, name, ttl=ttl)
        proxy.latency = 0.04
        in_body = asyncio.Event()
        cancelled_at: list[float] = []
        fences: list[int] = []

        async def hold() -> None:
            async with holder:
                fences.append(holder.fencing_token or 0)
                in_body.set()
                try:
                    await asyncio.Event().wait()  # runs until the loss cancels it
                except asyncio.CancelledError:
                    cancelled_at.append(time.time() * 1000)
                    raise

        async def wait_in() -> int:
            assert await waiter.acquire(timeout=15)
            return waiter.fencing_token or 0

        holding = asyncio.create_task(hold())
        await asyncio.wait_for(in_body.wait(), 5)
        probe = QueueProbe(direct)
        waiting = asyncio.create_task(wait_in())
        await probe.wait_queued(1, 5)

        proxy.stall()
        await asyncio.wait_for(lost.wait(), 5 * ttl)
        lease_end = await _server_lease_end(direct, kind, name)
        loss_seen = time.monotonic()
        waiter_fence = await asyncio.wait_for(waiting, 5 * ttl)
        recovered = time.monotonic() - loss_seen
        proxy.resume()
        with pytest.raises(LockLost):
            await asyncio.wait_for(holding, 10)

        # Events in order: loss reported, body cancelled, both while the server still held
        # the lease; the waiter then got in, with a higher fence.
        assert lease_end > 0, "the server lease had already ended when the loss was seen"
        assert lost_at[0] < lease_end and cancelled_at[0] < lease_end, (
            lost_at,
            cancelled_at,
            lease_end,
        )
        assert waiter_fence > fences[0]
        # The holder's late clean-up (after resume) left the waiter's holding alone.
        assert waiter.held() is False  # held by the finished task `waiting`, adopted below
        await waiter.release()
        orphans = await leftovers(direct, _family(kind), name)
        assert orphans == {}
        record(
            "1 proxy: stall past the lease",
            trials=1,
            orphaned=len(orphans),
            recover=[recovered],
            note=f"{kind}: loss reported {lease_end - lost_at[0]:.0f} ms before the "
            f"server lease ended (ttl {ttl:g} s, 40 ms latency)",
        )
    finally:
        proxy.resume()
        await close_client(proxied)


# -- connections dropped at exact points ----------------------------------------------------


def _match(sha: str, mode: bytes | None) -> Callable[[bytes], bool]:
    needle = sha.encode()
    return lambda data: needle in data and (mode is None or mode in data)


def _client(url: str, retry: str) -> redis.asyncio.Redis:
    """A client through `url`; `from_url` clients retry nothing unless given a policy."""
    if retry == "retries":
        policy = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), 3)
        return redis.asyncio.Redis.from_url(url, retry=policy)
    return redis.asyncio.Redis.from_url(url)


async def _hold_until(lock: LeasedLock, release: asyncio.Event, held: asyncio.Event) -> None:
    assert await lock.acquire(timeout=5)
    held.set()
    await release.wait()
    await lock.release()


async def _drop_case(
    proxy: Proxy, direct: redis.asyncio.Redis, kind: str, phase: str, point: str, retry: str
) -> tuple[list[str], float | None, str]:
    """One drop; returns (violations, recovery seconds, outcome)."""
    ttl = 0.6
    name = f"drop-{kind}-{phase}-{point}-{retry}"
    client = _client(proxy.url, retry)
    violations: list[str] = []
    recovered: float | None = None
    losses: list[LockLost] = []
    mine = _lock(client, kind, name, ttl=ttl, on_lost=losses.append)
    other = _lock(direct, "write" if kind == "read" else kind, name, ttl=ttl)
    spec = mine._spec
    try:
        if phase == "acquire":
            drop = proxy.drop_on(_match(spec.acquire.sha, None), point)
            try:
                got = await asyncio.wait_for(mine.acquire(timeout=5), 10)
                outcome = "acquired" if got else "timed out"
            except ServerUnavailable:
                got, outcome = False, "ServerUnavailable"
            recovered = time.monotonic()
            if got and await other.acquire(blocking=False):
                violations.append("another client got in while it held")
            if got:
                await mine.release()
        elif phase == "queued":
            assert await other.acquire(timeout=5)
            drop = proxy.drop_on(_match(spec.acquire.sha, b"wait"), point)
            waiting = asyncio.create_task(mine.acquire(timeout=5))
            await asyncio.wait_for(drop.fired.wait(), 5)
            await other.release()
            try:
                got = await asyncio.wait_for(waiting, 10)
                outcome = "acquired" if got else "timed out"
            except ServerUnavailable:
                got, outcome = False, "ServerUnavailable"
            recovered = time.monotonic()
            if got:
                if await other.acquire(blocking=False):
                    violations.append("another client got in while it held")
                await mine.release()
        elif phase == "release":
            assert await mine.acquire(timeout=5)
            probe = QueueProbe(direct)
            waiting = asyncio.create_task(other.acquire(timeout=5))
            await probe.wait_queued(1, 5)
            drop = proxy.drop_on(_match(spec.release.sha, None), point)
            try:
                await mine.release()  # in this task: it holds the lock
                outcome = "released"
            except LockLost as error:
                # Known and safe (a false alarm, never a missed loss): the client's own retry
                # re-ran a release whose reply was lost, out of the library's sight, and the
                # re-run found the lock handed on. Without a client retry the library retries
                # itself and tells the two apart by the lease's validity.
                if (point, retry) != ("reply", "retries"):
                    violations.append(f"a release that went through reported {error!r}")
                outcome = "LockLost"
            except ServerUnavailable:
                outcome = "ServerUnavailable"
            if mine.held():
                violations.append("still held here after release")
            if not await asyncio.wait_for(waiting, 10):
                violations.append("the waiter never got in")
            recovered = time.monotonic()
            await other.release()
        else:  # renew
            release, held = asyncio.Event(), asyncio.Event()
            holding = asyncio.create_task(_hold_until(mine, release, held))
            await asyncio.wait_for(held.wait(), 5)
            drop = proxy.drop_on(_match(RENEW_BATCH.sha, None), point)  # the keeper's batch
            await asyncio.wait_for(drop.fired.wait(), 5)
            await asyncio.sleep(ttl)  # the lease had ended by now unless renewed after the drop
            if await other.acquire(blocking=False):
                violations.append("another client got in: the renewal was lost")
                await other.release()
            outcome = "lost" if losses else "kept"
            if losses:
                violations.append(f"the lease was lost: {losses[0]}")
            release.set()
            await asyncio.wait_for(holding, 5)
        assert drop.at is not None, "the drop never happened"
        if recovered is not None:
            recovered -= drop.at
        orphans = await leftovers(direct, _family(kind), name)
        if orphans:
            violations.append(f"orphaned keys {orphans}")
        if not await other.acquire(blocking=False):
            violations.append("the lock is stuck afterwards")
        else:
            await other.release()
        return violations, recovered, outcome
    finally:
        proxy.disarm()
        await close_client(client)


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "write", "read"])
async def test_drops_mid_acquire_release_and_renewal_leave_one_holder_and_no_orphans(
    proxy: Proxy, direct: redis.asyncio.Redis, kind: str
) -> None:
    """Every phase x drop point x client retry policy: the connection carrying the script
    call is dropped before the server runs it ("request") or after, losing the reply
    ("reply"); through a client with a retry policy and through one without (the
    `from_url` default)."""
    results: list[tuple[str, list[str], float | None, str]] = []
    for phase in ("acquire", "queued", "release", "renew"):
        for point in ("request", "reply"):
            for retry in ("retries", "none"):
                violations, recovered, outcome = await _drop_case(
                    proxy, direct, kind, phase, point, retry
                )
                results.append((f"{phase}/{point}/{retry}", violations, recovered, outcome))
    problems = {case: v for case, v, _, _ in results if v}
    times = [t for _, _, t, _ in results if t is not None]
    outcomes: dict[str, int] = {}
    for _, _, _, outcome in results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    record(
        "1 proxy: drops mid acquire/release/renew",
        trials=len(results),
        violations=sum(len(v) for _, v, _, _ in results),
        recover=times,
        note=f"{kind}: outcomes {outcomes}",
    )
    assert problems == {}


# -- random drops, stalls and latency during a contended run --------------------------------


async def test_random_drops_stalls_and_latency_during_a_contended_run(
    proxy: Proxy, direct: redis.asyncio.Redis, valkey_notify: ServerProcess
) -> None:
    rng = random.Random(4242)
    proxied = [redis.asyncio.Redis.from_url(proxy.url) for _ in range(2)]
    faults = {"drop": 0, "stall": 0, "latency": 0}
    fault_times: list[float] = []
    try:
        logs = {kind: HistoryLog(direct, f"chaos-{kind}") for kind in KINDS}
        run = Contention(iterations=12, hold=0.01, seed=11)
        workers = [
            (
                make_sides(
                    client, kind, f"chaos-{kind}", ttl=1, timeout=30, **_cohort_options(kind, index)
                ),
                logs[kind].on(client),
                f"{kind}:{index}:{task}",
            )
            for kind in KINDS
            for index, client in enumerate([*proxied, direct])
            for task in range(2)
        ]

        async def chaos() -> None:
            while True:
                await asyncio.sleep(rng.uniform(0.02, 0.1))
                roll = rng.random()
                fault_times.append(time.monotonic())
                if roll < 0.5:
                    faults["drop"] += 1
                    proxy.drop_all()
                elif roll < 0.8:
                    faults["stall"] += 1
                    proxy.stall()
                    await asyncio.sleep(rng.uniform(0.01, 0.1))  # well below the 1 s lease
                    proxy.resume()
                else:
                    faults["latency"] += 1
                    proxy.latency = rng.choice([0.0, 0.002, 0.005])

        started = time.monotonic()
        await run.run(workers, chaos)
        elapsed = time.monotonic() - started
        proxy.resume()
        proxy.latency = 0.0
        found = await audit(direct, {kind: f"chaos-{kind}" for kind in KINDS})
        gaps = _recovery(fault_times, [at for _, at in run.grants])
        record(
            "1 proxy: random drops/stalls/latency",
            trials=sum(faults.values()),
            violations=len(found.problems),
            orphaned=found.orphaned,
            recover=gaps,
            note=f"faults {faults} in {elapsed:.1f} s; {run.completed} holdings; lost "
            f"{run.lost}, unavailable {run.unavailable}, timeouts {run.timeouts}",
        )
        assert found.problems == []
        assert run.completed == len(workers) * run.iterations
    finally:
        for client in proxied:
            await close_client(client)


def _cohort_options(kind: Kind, index: int) -> dict[str, int]:
    """The first proxied client's mutex passes it among its tasks (local hand-off), beside
    strict-FIFO holders of the same name on the other clients."""
    return {"local_handoff": 2} if kind == "mutex" and index == 0 else {}


def _recovery(faults: list[float], grants: list[float]) -> list[float]:
    """For each fault, the time until the next grant anywhere (monotonic seconds)."""
    grants = sorted(grants)
    gaps = []
    for at in faults:
        later = [g for g in grants if g >= at]
        if later:
            gaps.append(later[0] - at)
    return gaps
