"""The server commands of a mutex's free path and hand-off, counted on a real redis-server.

Counted (never timed) from `INFO commandstats`, inner script commands included, so a change
that adds a command to the free path, the queueing call or the hand-off fails here; one that
removes one updates the figures (and docs/architecture.md's table of them). Issue 32.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from _faults import close_client
from _probes import QueueProbe
from _servers import ServerProcess
from conftest import client_from_url

from aiolocks import RedisMutex

# One uncontended `async with`: acquire (EXISTS owner queue, GET fence, TIME, SET owner,
# SET fence) and release (GET owner, LINDEX queue, DEL owner), two EVALSHA.
FREE_CYCLE = {"evalsha": 2, "exists": 1, "get": 2, "lindex": 1, "time": 1, "set": 2, "del": 1}
# A waiter's one call while the name is held by another and nobody else waits (already
# subscribed): EXISTS owner queue (1: the owner alone, so no queue to read), GET owner, GET
# fence, TIME, ZADD + RPUSH (queued), PTTL + 2 PEXPIRE (the queue keys' expiry), PTTL owner
# (the safety-net timer), and, the holder being a default mutex (a local hand-off cohort),
# SPUBLISH of its token on the "queued" channel its cohort listens to (issue 45).
QUEUE_CALL = {
    "evalsha": 1,
    "exists": 1,
    "get": 2,
    "time": 1,
    "zadd": 1,
    "rpush": 1,
    "pttl": 2,
    "pexpire": 2,
    "spublish": 1,
}
# The holder's release handing the name to a waiter of another client: GET owner, LINDEX
# queue, ZSCORE of the head (alive?), GET fence, TIME, LPOP, ZREM, SET owner, SET fence,
# SPUBLISH; the waiter is woken by the message and makes no call.
HANDOFF = {
    "evalsha": 1,
    "get": 2,
    "lindex": 1,
    "zscore": 1,
    "time": 1,
    "lpop": 1,
    "zrem": 1,
    "set": 2,
    "spublish": 1,
}

_NOT_COUNTED = frozenset({"info"})


async def commandstats(admin: redis.asyncio.Redis) -> Counter[str]:
    stats: dict[str, Any] = await admin.info("commandstats")
    return Counter(
        {
            key.removeprefix("cmdstat_"): int(value["calls"])
            for key, value in stats.items()
            if key.startswith("cmdstat_") and key.removeprefix("cmdstat_") not in _NOT_COUNTED
        }
    )


async def counted(admin: redis.asyncio.Redis, act: Callable[[], Any]) -> dict[str, int]:
    """The commands the server ran while `act()` ran (INFO itself left out)."""
    before = await commandstats(admin)
    await act()
    after = await commandstats(admin)
    return dict(+(after - before))


@pytest.fixture
async def redis_server(
    server_factory: Callable[..., ServerProcess],
) -> AsyncIterator[ServerProcess]:
    """A private redis-server, notifications off: nothing else runs commands on it."""
    yield server_factory(kind="redis", notify=False)


@pytest.fixture
async def clients(redis_server: ServerProcess) -> AsyncIterator[list[redis.asyncio.Redis]]:
    made = [client_from_url(redis_server.url) for _ in range(3)]
    try:
        yield made
    finally:
        for client in made:
            await close_client(client)


async def test_the_free_path_runs_ten_commands(clients: list[redis.asyncio.Redis]) -> None:
    client, admin = clients[0], clients[2]
    mutex = RedisMutex(client, "free")

    async def cycles(n: int) -> None:
        for _ in range(n):
            async with mutex:
                pass

    await cycles(2)  # the scripts loaded (NOSCRIPT, EVAL) and the connection made
    assert await counted(admin, lambda: cycles(10)) == {
        name: 10 * calls for name, calls in FREE_CYCLE.items()
    }


async def test_a_queueing_call_and_a_hand_off_across_clients(
    clients: list[redis.asyncio.Redis],
) -> None:
    holder_client, waiter_client, admin = clients
    probe = QueueProbe(waiter_client)
    holder = RedisMutex(holder_client, "handed")
    waiter = RedisMutex(waiter_client, "handed")

    async def one_round() -> dict[str, int]:
        """The holder holds, the waiter queues; the queueing call and the release counted
        (the waiter's client is subscribed from the warm-up round on)."""
        assert await holder.acquire()
        queued = len(probe.queued)
        task: asyncio.Task[bool] | None = None

        async def queue() -> None:
            nonlocal task
            task = asyncio.create_task(waiter.acquire(timeout=10))
            await probe.wait_queued(queued + 1, 10)

        queueing = await counted(admin, queue)
        assert task is not None

        async def hand_off() -> None:
            await holder.release()
            assert task is not None
            assert await asyncio.wait_for(task, 10)

        handing = await counted(admin, hand_off)
        await waiter.release()
        return {**{f"queue {k}": v for k, v in queueing.items()}, **handing}

    await one_round()  # scripts loaded, the waiter's client subscribed
    figures = await one_round()
    assert figures == {**{f"queue {k}": v for k, v in QUEUE_CALL.items()}, **HANDOFF}
