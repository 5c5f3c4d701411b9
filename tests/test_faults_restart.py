"""A server restart (stop, a short outage, start on the same port, empty: no persistence)
while a holder holds and waiters wait, on a private server from `server_factory`.

A non-persistent restart loses every lease and every fence counter (docs/security.md,
"Server restarts"). What the library owes is to say so rather than hang: the holder's body
is cancelled and `LockLost` raised; each waiter either recovers (acquires on the restarted
server) or gets `ServerUnavailable`, within a bound. The tests also measure how long the
old holder kept running after a new holder got in (the exclusion gap a restart opens, at
most about one renewal interval, ttl/3) and show fences still rising: a lost counter starts
again from the server clock in microseconds, above every fence handed out before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
from _faultreport import record
from _faults import close_client, leftovers
from _probes import QueueProbe
from _servers import KINDS, ServerKind, ServerProcess
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from aiolocks import (
    LockLost,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._engine._leasedlock import LeasedLock

pytestmark = pytest.mark.faults

TTL = 1.0
OUTAGE = 0.3  # seconds the server is down between stop and start


def _sides(client: redis.asyncio.Redis, kind: str, name: str) -> tuple[LeasedLock, LeasedLock]:
    """(the holder's side, a waiter's side) of `kind` named `name`."""
    if kind == "mutex":
        return RedisMutex(client, name, ttl=TTL), RedisMutex(client, name, ttl=TTL)
    if kind == "semaphore":
        sem = RedisSemaphore(client, name, limit=1, ttl=TTL)
        return sem, sem
    rw = RedisReadWriteLock(client, name, ttl=TTL)
    return rw.write(), rw.read()


@pytest.mark.parametrize("server_kind", KINDS)
@pytest.mark.parametrize("kind", ["mutex", "semaphore", "rwlock"])
async def test_restart_during_waits_tells_the_holder_and_frees_the_waiters(
    server_factory: Callable[..., ServerProcess], server_kind: ServerKind, kind: str
) -> None:
    server = server_factory(kind=server_kind, notify=True)
    name = f"restart-{kind}"
    # One client retries its commands through the outage; one retries nothing.
    patient = redis.asyncio.Redis.from_url(
        server.url, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.4), 8)
    )
    impatient = redis.asyncio.Redis.from_url(server.url)
    try:
        holder, _ = _sides(patient, kind, name)
        for _ in range(5):  # a few grants before the holding below
            assert await holder.acquire()
            await holder.release()

        in_body = asyncio.Event()
        marks: dict[str, float] = {}
        fences: dict[str, int] = {}

        async def hold() -> None:
            async with holder:
                fences["holder"] = holder.fencing_token or 0
                in_body.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    marks["holder cancelled"] = time.monotonic()
                    raise

        async def wait(client: redis.asyncio.Redis, label: str) -> str:
            _, side = _sides(client, kind, name)
            try:
                async with side:
                    marks.setdefault("first grant", time.monotonic())
                    fences[label] = side.fencing_token or 0
                    await asyncio.sleep(0.01)
            except ServerUnavailable:
                return "ServerUnavailable"
            return "recovered"

        holding = asyncio.create_task(hold())
        await asyncio.wait_for(in_body.wait(), 5)
        waiting: dict[str, asyncio.Task[str]] = {}
        waiters = ((patient, "patient-1"), (patient, "patient-2"), (impatient, "impatient"))
        for client, label in waiters:
            probe = QueueProbe(client, local=True)  # (patient-2: in patient-1's cohort)
            waiting[label] = asyncio.create_task(wait(client, label))
            await probe.wait_queued(len(probe.queued) + 1, 5)

        server.stop()
        await asyncio.sleep(OUTAGE)  # the outage the clients live through
        server.restart()  # same port, empty: leases, queues and fence counters are gone
        restarted = time.monotonic()

        with pytest.raises(LockLost):
            await asyncio.wait_for(holding, 10)
        outcomes = {label: await asyncio.wait_for(task, 20) for label, task in waiting.items()}
        recovered = [label for label, outcome in outcomes.items() if outcome == "recovered"]
        # The patient waiters outlast the outage; the impatient one may get a clear error.
        assert {"patient-1", "patient-2"} <= set(recovered), outcomes
        # The counter is gone, but its floor is the server clock: fences after the restart
        # are still above the old holder's (docs/architecture.md, "Fences and expiry").
        assert min(fences[label] for label in recovered) > fences["holder"], fences
        orphans = await leftovers(patient, kind, name)
        assert orphans == {}
        gap = marks["holder cancelled"] - marks["first grant"]
        record(
            "3 server restart during waits",
            trials=1,
            orphaned=len(orphans),
            recover=[marks["first grant"] - restarted],
            note=f"{kind} on {server_kind}: outcomes {outcomes}; fence {fences['holder']} -> "
            f"{min(fences[label] for label in recovered)}; old holder cancelled "
            f"{gap * 1000:+.0f} ms after the first new grant",
        )
    finally:
        for client in (patient, impatient):
            await close_client(client)


async def test_restart_with_no_waiters_still_tells_the_holder(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Nobody waits, so nothing else would notice: the renewal finds the lease gone."""
    server = server_factory(kind="valkey", notify=False)
    client = redis.asyncio.Redis.from_url(server.url)
    lost: list[Any] = []
    try:
        mutex = RedisMutex(client, "restart-alone", ttl=TTL, on_lost=lost.append)
        assert await mutex.acquire()
        server.restart()
        await asyncio.wait_for(mutex.lost.wait(), 3 * TTL)
        assert len(lost) == 1 and "deleted" in str(lost[0])
        with pytest.raises(LockLost):
            await mutex.release()
        record("3 server restart, holder alone", trials=1)
    finally:
        await close_client(client)
