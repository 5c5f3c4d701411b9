"""A burst larger than the link carries at once queues and completes (issue 26, item 7):
the calls queued behind it count their leases from when they go out, and the releases
queued behind it keep their leases renewed until they are answered.

The link is held here (the client's auto-pipeline writes nothing) while the event loop
runs on, as it is behind a burst of 100,000 calls: what is measured is the work per
call and the outcome of each, never a duration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis.asyncio
from _probes import Renewals

from aiolocks import RedisMutex
from aiolocks._engine._context import context_for
from aiolocks._leases._keeper import Lease
from aiolocks._transport._runner import AUTOPIPELINE_ENV


@contextlib.contextmanager
def link_held(
    client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], None]]:
    """Hold `client`'s link: calls queue (in the auto-pipeline, or, with it off, for the
    in-flight limit), none is written, until the function given is called (or the block
    ends)."""
    context = context_for(client)
    pipeline = context.autopipe
    held = True
    if pipeline is not None:
        full = pipeline._full
        monkeypatch.setattr(pipeline, "_full", lambda: held or full())
    else:
        slots = asyncio.Semaphore(0)
        monkeypatch.setattr(context, "_slots", slots)

    def let_go() -> None:
        nonlocal held
        if not held:
            return
        held = False
        if pipeline is not None:
            pipeline._kick()
        else:
            for _ in range(64):
                slots.release()

    try:
        yield let_go
    finally:
        let_go()


def leases_of(locks: Sequence[RedisMutex]) -> list[Lease]:
    leases = [holding.lease for lock in locks for holding in lock._holdings.values()]
    return [lease for lease in leases if lease is not None]


@pytest.mark.parametrize("autopipelining", ["1", "0"], ids=["autopipe", "no-autopipe"])
async def test_acquisitions_queued_behind_a_burst_count_their_lease_from_when_they_go_out(
    client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, autopipelining: str
) -> None:
    """300 acquisitions queued for longer than half their ttl before they go out: one call
    each, and each lease has more than half its ttl left. Before, a lease counted from
    when its call was queued: each of these re-ran the acquire script to confirm its grant
    (600 calls), and behind a larger burst up to 3 times, which made the burst larger.
    With auto-pipelining off the calls queue for the in-flight limit instead."""
    monkeypatch.setenv(AUTOPIPELINE_ENV, autopipelining)
    ttl, count = 2.0, 300
    locks = [RedisMutex(client, f"burst:{i}", ttl=ttl) for i in range(count)]
    async with RedisMutex(client, "warm", ttl=ttl):  # scripts known, context made
        pass
    context = context_for(client)
    assert (context.autopipe is None) == (autopipelining == "0")
    with link_held(client, monkeypatch) as let_go:
        before = context.commands_sent
        acquiring = asyncio.gather(*(lock.acquire() for lock in locks))
        await asyncio.sleep(ttl * 0.6)  # queued, not written, for 0.6 ttl
        assert context.commands_sent == before
        let_go()
        assert all(await acquiring)
    assert context.commands_sent - before == count
    assert min(lease.remaining for lease in leases_of(locks)) > ttl / 2
    await asyncio.gather(*(lock.release() for lock in locks))


async def test_releases_queued_behind_a_burst_keep_their_leases_until_answered(
    client: redis.asyncio.Redis, renewals: Renewals, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 releases queued for four renewal periods (longer than the validity their leases
    had when the releases began): their leases are renewed meanwhile, and every release
    is answered "held", none lost. Before, a lease stopped being renewed when its release
    was queued, and a release unanswered at its lease's validity raised `LockLost` and
    went on in the background (at 100,000 mutexes, every release of the burst)."""
    ttl, count = 0.6, 200
    locks = [RedisMutex(client, f"burst:{i}", ttl=ttl) for i in range(count)]
    assert all(await asyncio.gather(*(lock.acquire() for lock in locks)))
    with link_held(client, monkeypatch) as let_go:
        renewed = renewals.count
        releasing: asyncio.Future[list[BaseException | None]] = asyncio.gather(
            *(lock.release() for lock in locks), return_exceptions=True
        )
        renewing: asyncio.Future[None] = asyncio.ensure_future(
            renewals.until(renewed + 4 * count, 30)
        )
        either: list[asyncio.Future[Any]] = [releasing, renewing]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        renewing.cancel()
        let_go()
        results = await releasing
    assert [repr(result) for result in results if result is not None] == []
    assert renewals.lost == 0
    assert renewals.count - renewed >= 4 * count
    assert not await client.exists(*(lock._spec.keys[0] for lock in locks))  # owner keys


async def test_a_burst_of_releases_waits_for_places_in_arrival_order(
    client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 releases at once with 8 places: 8 calls queue on the held link, the 32 others
    wait for a place (a future each, no call, timer or coroutine chain of their own:
    100,000 exits at once made so many objects that the collector's full collections
    stalled the loop past the leases' validity, and every lease was lost); let go, all
    are answered "held". Two of the waiting ones cancelled still release (in the
    background) and give no place away: none is left taken."""
    ttl, count, places = 5.0, 40, 8
    locks = [RedisMutex(client, f"burst:{i}", ttl=ttl) for i in range(count)]
    assert all(await asyncio.gather(*(lock.acquire() for lock in locks)))
    context = context_for(client)
    gate = context.releases
    assert gate.inside == 0
    monkeypatch.setattr(gate, "limit", places)
    pipeline = context.autopipe
    assert pipeline is not None
    with link_held(client, monkeypatch) as let_go:
        releasing = [asyncio.ensure_future(lock.release()) for lock in locks]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(pipeline._queue) == places
        assert (gate.inside, len(gate.waiting)) == (places, count - places)
        for task in releasing[20:22]:
            task.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(pipeline._queue) == places + 2  # their clean-ups, outside the gate
        let_go()
        results = await asyncio.gather(*releasing, return_exceptions=True)
    assert [type(r).__name__ for r in results[20:22]] == ["CancelledError"] * 2
    assert [repr(r) for r in results[:20] + results[22:] if r is not None] == []
    assert (gate.inside, len(gate.waiting)) == (0, 0)
    if context.cleanups:
        await asyncio.wait(context.cleanups, timeout=10)
    assert not await client.exists(*(lock._spec.keys[0] for lock in locks))  # owner keys
