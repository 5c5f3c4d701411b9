"""What wakes a parked waiter, and what does not: the engine's task wake-ups and timers.

A waiter's task runs when there is something for it to do: its grant, a re-check, its
deadline, or (the head of its lot only) the safety-net timer at the first lease end in the
way. Shown here: a promotion to head wakes nobody, and neither does a lease end that was
learned to be later meanwhile; the lot's timer still re-checks for the head only, at the
lease's real end, when it ends without a message; a waiter queued behind a local holder is
not woken by that holder's release (which grants another), and its timeout still holds.
Every mutex here is strict FIFO (`local_handoff=0`): these are the server queue's waiters;
the default's tasks of one process wait in the process instead (tests/test_local_handoff.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio
from _faults import close_client
from _probes import QueueProbe
from _servers import ServerProcess
from conftest import VARIANTS, ServerPool

from aiolocks import RedisMutex
from aiolocks._base._spec import Spec
from aiolocks._engine._acquire import AcquireReply, Status
from aiolocks._engine._context import context_for
from aiolocks._scripts import Script
from aiolocks._waiting._waitqueue import Waiter, Wake

PLAIN = [variant for variant in VARIANTS if variant.endswith("-plain")]
TIMER_BOUND = 0.3  # the lot's timer re-checks within this of the lease's end (loaded machine)


@pytest.fixture(params=PLAIN, ids=PLAIN)
def plain(request: pytest.FixtureRequest, server_pool: ServerPool) -> ServerProcess:
    """A server without keyspace notifications: a lease that ends sends no message."""
    variant: str = request.param
    return server_pool.get(variant)


@pytest.fixture
async def pair(plain: ServerProcess) -> Any:
    """A client for the waiters and an admin client (a holder that never renews), after
    FLUSHALL on a `plain` server."""
    here, admin = (redis.asyncio.Redis.from_url(plain.url) for _ in range(2))
    await admin.flushall()
    try:
        yield here, admin
    finally:
        for client in (here, admin):
            await close_client(client)


@dataclass
class Call:
    token: str
    sent: float  # monotonic
    status: int | None = None  # the acquire script's answer, once it came


class AcquireCalls:
    """Every call of `spec`'s acquire script by one client in 'wait' mode (a waiter's: a
    first 'try' that finds the lock busy is not counted), in the order sent."""

    def __init__(self, client: redis.asyncio.Redis, spec: Spec) -> None:
        self.made: list[Call] = []
        self.answered = asyncio.Event()  # set on each answer
        context = context_for(client)
        inner = context.run

        async def run(
            script: Script,
            keys: tuple[bytes, ...],
            args: tuple[Any, ...],
            *,
            retry: bool = True,
            sent: Any = None,
        ) -> Any:
            call = None
            if script is spec.acquire and args[1] == "wait":
                call = Call(str(args[0]).split(":", 1)[0], time.monotonic())
                self.made.append(call)
            reply = await inner(script, keys, args, retry=retry, sent=sent)
            if call is not None:
                call.status = AcquireReply.decode(reply).status.value
                self.answered.set()
            return reply

        context.run = run  # type: ignore[method-assign]

    def of(self, token: str) -> list[Call]:
        return [call for call in self.made if call.token == token]


async def crashed_holder(admin: redis.asyncio.Redis, spec: Spec, ttl_ms: int) -> float:
    """Make a holder of `spec` that never renews, with a lease of `ttl_ms` (re-armed if it
    holds already: the acquire script is idempotent); returns a moment (monotonic) its lease
    ends no earlier than."""
    context = context_for(admin)
    member = context.waitqueue.member("crashed0000", ttl_ms, "x")
    sent = time.monotonic()
    reply = await context.run(spec.acquire, spec.keys, (member, "try", spec.channel))
    assert AcquireReply.decode(reply).status is Status.GRANTED
    return sent + ttl_ms / 1000


@dataclass
class Queued:
    mutex: RedisMutex
    task: asyncio.Task[bool]
    waiter: Waiter


async def queue(client: redis.asyncio.Redis, name: str, probe: QueueProbe) -> Queued:
    """A waiter of `client` (ttl 30 s, timeout 20 s), once queued on the server."""
    mutex = RedisMutex(client, name, ttl=30, local_handoff=0)
    task = asyncio.create_task(mutex.acquire(timeout=20))
    await probe.wait_queued(len(probe.queued) + 1)
    return Queued(mutex, task, context_for(client).waitqueue._by_token[probe.queued[-1]])


async def free(mutex: RedisMutex) -> None:
    """Nobody holds or waits for `mutex`'s name on the server."""
    info = await mutex.inspect()
    assert info.owner is None and info.queue_length == 0


def untouched(waiter: Waiter) -> asyncio.Future[Wake]:
    """The future `waiter` sleeps on, checked to be pending."""
    future = waiter._future
    assert future is not None and not future.done()
    return future


async def test_a_promotion_to_head_wakes_no_one(clients: list[redis.asyncio.Redis]) -> None:
    """The head of a lot leaves (here: cancelled) while the holder's lease has long to run:
    the new head's task is not woken (before: woken only to re-arm the safety-net timer)."""
    here, there = clients
    holder = RedisMutex(there, "wakes:promotion", ttl=30, local_handoff=0)
    assert await holder.acquire()
    probe = QueueProbe(here)
    first, second, third = [await queue(here, "wakes:promotion", probe) for _ in range(3)]
    lot = first.waiter.lot
    assert lot.head() is first.waiter
    futures = [untouched(second.waiter), untouched(third.waiter)]
    first.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first.task
    assert lot.head() is second.waiter
    assert [untouched(second.waiter), untouched(third.waiter)] == futures  # nobody woke
    await holder.release()
    assert await asyncio.wait_for(second.task, 5)  # the new head is served first
    assert not third.task.done()
    await second.mutex.release()
    assert await asyncio.wait_for(third.task, 5)
    await third.mutex.release()
    await free(holder)


@pytest.mark.slow
async def test_a_lease_end_learned_later_wakes_no_one_at_the_old_end(pair: Any) -> None:
    """The holder's lease is cut to 0.8 s and a later waiter's call learns it: the lot's
    timer moves earlier. Then it is re-armed for 1.8 s and another call learns that: at the
    old end the timer re-arms itself and wakes nobody; the head re-checks once, at the real
    end (before: the head kept the end it had been told when it went to sleep, 30 s)."""
    here, admin = pair
    spec = RedisMutex(here, "wakes:later")._spec
    await crashed_holder(admin, spec, 30_000)
    probe = QueueProbe(here)
    calls = AcquireCalls(here, spec)
    first = await queue(here, "wakes:later", probe)  # told: 30 s left
    old_end = await crashed_holder(admin, spec, 800)
    second = await queue(here, "wakes:later", probe)  # told: 0.8 s left
    end = await crashed_holder(admin, spec, 1800)
    third = await queue(here, "wakes:later", probe)  # told: 1.8 s left
    assert time.monotonic() < old_end - 0.3, "too slow to set up before the old lease end"
    assert await asyncio.wait_for(first.task, 5)
    queued, recheck = calls.of(first.waiter.token)  # none at the old end
    assert queued.status == 0 and recheck.status == 1
    assert end <= recheck.sent < end + TIMER_BOUND
    for later in (second, third):  # their queue calls only, before the head's re-check
        assert sum(call.sent < recheck.sent for call in calls.of(later.waiter.token)) == 1
    for holder, waiting in ((first, second), (second, third)):
        await holder.mutex.release()
        assert await asyncio.wait_for(waiting.task, 5)
    await third.mutex.release()
    await free(third.mutex)


async def test_only_the_head_rechecks_at_a_silent_lease_end(pair: Any) -> None:
    """A holder's lease ends without a message (no keyspace notifications, no renewal). The
    first head left, and the end was cut shorter after the waiters went to sleep (a later
    waiter's call learned it): the new head alone re-checks, at that end, and gets it
    (before: the head kept the end it had been told when it went to sleep, 30 s)."""
    here, admin = pair
    spec = RedisMutex(here, "wakes:silent")._spec
    await crashed_holder(admin, spec, 30_000)
    probe = QueueProbe(here)
    calls = AcquireCalls(here, spec)
    first, second = [await queue(here, "wakes:silent", probe) for _ in range(2)]
    first.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first.task
    end = await crashed_holder(admin, spec, 800)
    third = await queue(here, "wakes:silent", probe)  # told: 0.8 s left
    assert time.monotonic() < end, "too slow to set up before the lease end"
    assert await asyncio.wait_for(second.task, 5)
    queued, recheck = calls.of(second.waiter.token)
    assert queued.status == 0 and recheck.status == 1
    assert end <= recheck.sent < end + TIMER_BOUND
    assert sum(call.sent < recheck.sent for call in calls.of(third.waiter.token)) == 1
    await second.mutex.release()
    assert await asyncio.wait_for(third.task, 5)
    await third.mutex.release()
    await free(third.mutex)


@dataclass
class Behind:
    mutex: RedisMutex  # the local waiter's
    task: asyncio.Task[bool]
    waiter: Waiter
    future: asyncio.Future[Wake]  # what it slept on when the local holder released
    remote: RedisMutex  # held, by the waiter of another client the release granted
    calls: AcquireCalls  # of the local client, from before the waiter asked
    asked: float  # when the local waiter's acquire began (monotonic)


async def queued_behind(clients: list[redis.asyncio.Redis], name: str, timeout: float) -> Behind:
    """A local waiter (`timeout`) queued on the server behind a waiter of another client,
    while a task of its own client holds the mutex; that holder's release grants the other
    client's waiter."""
    here, there = clients
    holder, local, remote = (
        RedisMutex(client, name, ttl=30, local_handoff=0) for client in (here, here, there)
    )
    assert await holder.acquire()
    remote_probe = QueueProbe(there)
    remote_waiting = asyncio.create_task(remote.acquire(timeout=20))
    await remote_probe.wait_queued(1)
    probe = QueueProbe(here)
    calls = AcquireCalls(here, local._spec)
    asked = time.monotonic()
    waiting = asyncio.create_task(local.acquire(timeout=timeout))
    await probe.wait_queued(1)
    waiter = context_for(here).waitqueue._by_token[probe.queued[-1]]
    future = untouched(waiter)
    await holder.release()  # grants the remote waiter; the local one stays queued
    assert waiter.fence is None
    assert await asyncio.wait_for(remote_waiting, 5)
    assert (await remote.inspect()).queue_length == 1
    return Behind(local, waiting, waiter, future, remote, calls, asked)


async def test_a_waiter_behind_a_local_holder_is_not_woken_until_its_grant(
    clients: list[redis.asyncio.Redis],
) -> None:
    behind = await queued_behind(clients, "wakes:behind", 20)
    assert untouched(behind.waiter) is behind.future  # not woken by another's grant
    await behind.remote.release()  # grants the local waiter, by message
    assert await asyncio.wait_for(behind.task, 5)
    assert behind.future.result() is Wake.GRANTED  # the one wake of its task
    assert [call.status for call in behind.calls.made] == [0]  # its one call queued it
    await behind.mutex.release()
    await free(behind.mutex)


async def test_a_waiter_behind_a_local_holder_times_out_on_time_and_leaves_nothing(
    clients: list[redis.asyncio.Redis],
) -> None:
    behind = await queued_behind(clients, "wakes:behind-timeout", 1.0)
    assert untouched(behind.waiter) is behind.future
    assert await asyncio.wait_for(behind.task, 5) is False
    assert behind.future.result() is Wake.DEADLINE
    assert 1.0 <= time.monotonic() - behind.asked < 1.0 + TIMER_BOUND
    assert [call.status for call in behind.calls.made] == [0]
    info = await behind.remote.inspect()
    assert info.owner is not None and info.queue_length == 0  # withdrawn from the queue
    await behind.remote.release()
    await free(behind.remote)


async def test_a_waiter_behind_a_local_holder_told_to_recheck_calls_once(
    clients: list[redis.asyncio.Redis],
) -> None:
    """A re-check (a reconnect, a lost reply) while it waits: one call, which finds it
    queued, and it sleeps on until its grant."""
    behind = await queued_behind(clients, "wakes:behind-recheck", 20)
    behind.calls.answered.clear()
    context_for(clients[0]).waitqueue.recheck_all(behind.mutex._spec.channel)
    assert behind.future.result() is Wake.RECHECK
    await asyncio.wait_for(behind.calls.answered.wait(), 5)
    assert [call.status for call in behind.calls.made] == [0, 0]  # queued already
    assert not behind.task.done()
    await behind.remote.release()
    assert await asyncio.wait_for(behind.task, 5)
    assert [call.status for call in behind.calls.made] == [0, 0]
    await behind.mutex.release()
    await free(behind.mutex)
