"""Carrying: a task that asks for a mutex while another task of the same client holds it is
queued by that holder's release (the same script call), not by a call of its own.

Shown here: the waiter makes no call of its own and gets the mutex from the release; several
carried waiters keep their arrival order behind a waiter of another client; one that is not
carried within CARRY_WAIT queues itself, so a later arrival of another client stays behind
it; a timeout, a cancellation while the carrying release is in flight, and a release whose
reply is lost all leave nothing behind and nobody stranded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from _probes import Deferrals, QueueProbe

from aiolocks import RedisMutex, _acquire
from aiolocks._context import ClientContext, context_for
from aiolocks._scripts import Script

Hook = Callable[[Script, tuple[Any, ...]], None]


class Calls:
    """Every script call of one client, as (script, args), with an optional hook run before
    each call is sent (and `lose`: the reply of the next carrying release is lost)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.context: ClientContext = context_for(client)
        self.made: list[tuple[Script, tuple[Any, ...]]] = []
        self.before: Hook | None = None
        self.lose = False
        inner = self.context.run

        async def run(
            script: Script,
            keys: tuple[bytes, ...],
            args: tuple[Any, ...],
            *,
            retry: bool = True,
            sent: Any = None,
        ) -> Any:
            self.made.append((script, args))
            if self.before is not None:
                self.before(script, args)
            reply = await inner(script, keys, args, retry=retry, sent=sent)
            if self.lose and "carry" in args:
                self.lose = False
                raise redis.exceptions.ConnectionError("reply lost (test)")
            return reply

        self.context.run = run  # type: ignore[method-assign]

    def queue_calls(self, mutex: RedisMutex) -> list[tuple[Any, ...]]:
        """Acquire calls in 'wait' mode (a first 'try' finds it busy before it parks)."""
        return [
            args
            for script, args in self.made
            if script is mutex._spec.acquire and args[1] == "wait"
        ]

    def releases_of(self, mutex: RedisMutex) -> list[tuple[Any, ...]]:
        return [args for script, args in self.made if script is mutex._spec.release]


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters wait to be carried for 10 s: these tests decide when the holder releases, and
    a loaded machine must not end the window first."""
    monkeypatch.setattr(_acquire, "CARRY_WAIT", 10.0)


async def test_a_waiter_behind_a_local_holder_is_queued_by_its_release(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(r, "carry:one", ttl=10)
    waiter = RedisMutex(r, "carry:one", ttl=10)
    assert await holder.acquire()
    first = holder.fencing_token
    calls = Calls(r)

    async def take() -> int | None:
        assert await waiter.acquire()
        return waiter.fencing_token

    waiting = asyncio.create_task(take())
    await deferrals.wait(1)
    assert not waiting.done()
    await holder.release()
    fence = await asyncio.wait_for(waiting, 5)
    assert calls.queue_calls(waiter) == []  # it did not queue itself
    (carrying,) = calls.releases_of(holder)
    assert carrying[2] == "carry" and len(carrying) == 4  # the release queued it
    assert first is not None and fence is not None and fence > first
    info = await waiter.inspect()
    assert info.owner is not None and info.queue_length == 0
    await waiter.release()
    assert (await waiter.inspect()).owner is None


async def test_carried_waiters_keep_their_order_behind_another_clients_waiter(
    clients: list[redis.asyncio.Redis], monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    here, there = clients
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(here, "carry:order", ttl=10)
    remote = RedisMutex(there, "carry:order", ttl=10)
    assert await holder.acquire()
    probe = QueueProbe(there)
    remote_waiting = asyncio.create_task(remote.acquire())
    await probe.wait_queued(1)
    calls = Calls(here)
    order: list[int] = []
    fences: list[int] = []

    async def local(index: int) -> None:
        mutex = RedisMutex(here, "carry:order", ttl=10, timeout=10)
        async with mutex:
            order.append(index)
            assert mutex.fencing_token is not None
            fences.append(mutex.fencing_token)

    locals_ = []
    for index in range(3):
        locals_.append(asyncio.create_task(local(index)))
        await deferrals.wait(index + 1)  # arrival order is the order they deferred in
    await holder.release()
    assert await asyncio.wait_for(remote_waiting, 5)  # the remote waiter was first
    assert (await remote.inspect()).queue_length == 3  # all three queued by that release
    assert order == []
    await remote.release()
    await asyncio.wait_for(asyncio.gather(*locals_), 10)
    assert order == [0, 1, 2]
    assert fences == sorted(fences) and len(set(fences)) == 3
    assert calls.queue_calls(holder) == []  # no task queued itself (one script for all)
    assert (await remote.inspect()).owner is None


async def test_a_waiter_not_carried_in_time_queues_itself(
    clients: list[redis.asyncio.Redis],
) -> None:
    """The holder keeps it far past CARRY_WAIT: the local waiter queues on its own, so a
    waiter of another client that comes later stays behind it (FIFO by arrival)."""
    here, there = clients
    holder = RedisMutex(here, "carry:late", ttl=10)
    local = RedisMutex(here, "carry:late", ttl=10)
    remote = RedisMutex(there, "carry:late", ttl=10)
    assert await holder.acquire()
    here_probe, there_probe = QueueProbe(here), QueueProbe(there)
    local_waiting = asyncio.create_task(local.acquire())
    await here_probe.wait_queued(1)  # it queued itself while the holder still holds
    remote_waiting = asyncio.create_task(remote.acquire())
    await there_probe.wait_queued(1)
    await holder.release()
    assert await asyncio.wait_for(local_waiting, 5)
    assert not remote_waiting.done()
    await local.release()
    assert await asyncio.wait_for(remote_waiting, 5)
    await remote.release()


async def test_a_timeout_while_waiting_to_be_carried_leaves_nothing(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(r, "carry:timeout", ttl=10)
    waiter = RedisMutex(r, "carry:timeout", ttl=10)
    assert await holder.acquire()
    calls = Calls(r)
    started = asyncio.get_running_loop().time()
    waiting = asyncio.create_task(waiter.acquire(timeout=0.2))
    await deferrals.wait(1)
    assert await asyncio.wait_for(waiting, 5) is False
    assert asyncio.get_running_loop().time() - started < 0.2 + 0.2
    assert calls.queue_calls(waiter) == []  # it never queued on the server
    await holder.release()
    (release,) = calls.releases_of(holder)
    assert "carry" not in release  # nothing left to carry
    info = await holder.inspect()
    assert info.owner is None and info.queue_length == 0


async def test_cancelled_while_the_carrying_release_is_in_flight(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    """The release grants the free mutex to the carried waiter, which is cancelled as the
    call goes out: its clean-up hands the mutex back, and nothing is left held or queued."""
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(r, "carry:cancel", ttl=10)
    waiter = RedisMutex(r, "carry:cancel", ttl=10)
    assert await holder.acquire()
    waiting = asyncio.create_task(waiter.acquire())
    await deferrals.wait(1)
    calls = Calls(r)

    def cancel_it(script: Script, args: tuple[Any, ...]) -> None:
        if "carry" in args:
            waiting.cancel()

    calls.before = cancel_it
    await holder.release()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    carrying, clean_up = calls.releases_of(holder)
    assert carrying[2] == "carry" and clean_up[0] == carrying[3]  # the waiter's own clean-up
    info = await holder.inspect()
    assert info.owner is None and info.queue_length == 0
    other = RedisMutex(r, "carry:cancel", ttl=10)
    assert await other.acquire(blocking=False)
    await other.release()


async def test_a_lost_reply_of_the_carrying_release_leaves_no_waiter_stranded(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    """The release ran (and granted the carried waiter) but its reply was lost: the holder's
    release is not reported as lost, and the waiter learns its grant by a re-check."""
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(r, "carry:lost-reply", ttl=10)
    waiter = RedisMutex(r, "carry:lost-reply", ttl=10)
    assert await holder.acquire()
    waiting = asyncio.create_task(waiter.acquire())
    await deferrals.wait(1)
    calls = Calls(r)
    calls.lose = True
    await holder.release()  # no LockLost: the retry finds it released, the lease was valid
    assert await asyncio.wait_for(waiting, 5)
    assert len(calls.queue_calls(waiter)) == 1  # the re-check, answered "granted"
    info = await waiter.inspect()
    assert info.queue_length == 0 and info.owner is not None
    await waiter.release()
    assert (await waiter.inspect()).owner is None


async def test_a_recheck_while_waiting_to_be_carried_queues_it_itself(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    """A re-check (a heartbeat that found it not queued, a reconnect) ends the wait to be
    carried: it queues with its own call, and the holder's release no longer carries it."""
    deferrals = Deferrals(monkeypatch)
    holder = RedisMutex(r, "carry:recheck", ttl=10)
    waiter = RedisMutex(r, "carry:recheck", ttl=10)
    assert await holder.acquire()
    probe = QueueProbe(r)
    waiting = asyncio.create_task(waiter.acquire())
    await deferrals.wait(1)
    calls = Calls(r)
    context_for(r).waitqueue.recheck_all(waiter._spec.channel)
    await probe.wait_queued(1)
    assert len(calls.queue_calls(waiter)) == 1
    await holder.release()
    (release,) = calls.releases_of(holder)
    assert "carry" not in release
    assert await asyncio.wait_for(waiting, 5)
    await waiter.release()
    info = await waiter.inspect()
    assert info.owner is None and info.queue_length == 0
