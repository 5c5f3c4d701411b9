"""RedisReadWriteLock on real servers: shared reads, exclusive writes, writer fairness,
batch admission of readers, reentry, lost reader leases, fencing across both sides.

Waiters are known to be queued on the server through `QueueProbe` (the reply of the
acquire script said so), never by polling Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import pytest
import redis.asyncio
from _probes import QueueProbe
from conftest import Tasks, freed_by_reference_counting

from aiolocks import LockLost, LockReentry, LockTimeout, ReadLock, RedisReadWriteLock
from aiolocks._engine._context import context_for

T = TypeVar("T")

BOUND = 5.0  # longest wait for something that should happen at once
SLACK = 0.25


@pytest.fixture
async def r2(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A second client on the same server (its own engine context)."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


@dataclass
class Room:
    """Who is inside, as the holders themselves report it; waits are event-driven."""

    entered: list[str] = field(default_factory=list)
    inside: set[str] = field(default_factory=set)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    leave: dict[str, asyncio.Event] = field(default_factory=dict)

    async def enter(self, label: str) -> None:
        async with self.changed:
            self.entered.append(label)
            self.inside.add(label)
            self.changed.notify_all()

    async def exit(self, label: str) -> None:
        async with self.changed:
            self.inside.discard(label)
            self.changed.notify_all()

    async def wait_inside(self, labels: set[str]) -> None:
        async def wait() -> None:
            async with self.changed:
                await self.changed.wait_for(lambda: labels <= self.inside)

        await asyncio.wait_for(wait(), BOUND)

    async def stay(self, label: str) -> None:
        """Enter, wait to be told to leave, leave (the caller holds the lock around it)."""
        event = self.leave.setdefault(label, asyncio.Event())
        await self.enter(label)
        await event.wait()
        await self.exit(label)

    def let_go(self, *labels: str) -> None:
        for label in labels:
            self.leave.setdefault(label, asyncio.Event()).set()


# -- basics -------------------------------------------------------------------------------


async def test_handles_are_cached_per_instance() -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)  # never called
    try:
        rw = RedisReadWriteLock(client, "catalog")
        assert rw.read() is rw.read()
        assert rw.write() is rw.write()
        assert rw.read() is not rw.write()  # type: ignore[comparison-overlap]
        other = RedisReadWriteLock(client, "catalog")
        assert other.read() is not rw.read()
        assert context_for(client).commands_sent == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"ttl": -1}, ValueError),
        ({"ttl": "30"}, TypeError),
        ({"name": ""}, ValueError),
        ({"name": "a}b"}, ValueError),
        ({"timeout": -1}, ValueError),
    ],
)
async def test_bad_arguments_fail_at_construction(kwargs: dict[str, object], error: type) -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    args: dict[str, object] = {"name": "ok"}
    args.update(kwargs)
    try:
        with pytest.raises(error):
            RedisReadWriteLock(client, **args)  # type: ignore[arg-type]
        assert context_for(client).commands_sent == 0
    finally:
        await client.aclose()


async def test_readers_overlap(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """6 readers on two clients are all inside at once; the server counts 6, no writer."""
    name = "rw:overlap"
    locks = [RedisReadWriteLock(client, name, ttl=10) for client in (r, r2)]
    room = Room()
    fences: list[int] = []

    async def reader(index: int) -> None:
        side = locks[index % 2].read()
        async with side:
            fence = side.fencing_token
            assert fence is not None
            fences.append(fence)
            await room.stay(f"R{index}")

    labels = {f"R{index}" for index in range(6)}
    readers = [tasks.start(reader(index)) for index in range(6)]
    await room.wait_inside(labels)
    info = await locks[0].inspect()
    assert (info.name, info.writer, info.readers, info.queue_length) == (name, None, 6, 0)
    assert info.fence == max(fences)
    room.let_go(*labels)
    await asyncio.wait_for(asyncio.gather(*readers), BOUND)
    assert len(set(fences)) == 6  # each reader its own fence
    info = await locks[1].inspect()
    assert (info.writer, info.readers, info.queue_length, info.fence) == (
        None, 0, 0, max(fences)
    )  # fmt: skip


async def test_writer_excludes_readers_and_writers(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis
) -> None:
    """30 tasks (a third writers) on two clients, 3 holdings each: a writer is never inside
    with anyone, readers are inside together, and fences order the holdings around each
    writer."""
    name = "rw:exclusive"
    rng = random.Random(7)
    locks = [RedisReadWriteLock(client, name, ttl=10) for client in (r, r2)]
    readers_in = writers_in = most_readers = 0
    violations: list[str] = []
    clock = 0
    # (kind, fence, entered at, left at) on a shared logical clock
    holdings: list[tuple[str, int, int, int]] = []

    async def user(index: int) -> None:
        nonlocal readers_in, writers_in, most_readers, clock
        kind = "write" if index % 3 == 0 else "read"
        rw = locks[index % 2]
        side = rw.write() if kind == "write" else rw.read()
        for _ in range(3):
            async with side:
                fence = side.fencing_token
                assert fence is not None
                clock += 1
                entered = clock
                if kind == "write":
                    if readers_in or writers_in:
                        violations.append(f"writer {index} with {readers_in}R {writers_in}W")
                    writers_in += 1
                else:
                    if writers_in:
                        violations.append(f"reader {index} with a writer")
                    readers_in += 1
                    most_readers = max(most_readers, readers_in)
                await asyncio.sleep(rng.uniform(0.001, 0.006))
                if kind == "write":
                    writers_in -= 1
                else:
                    readers_in -= 1
                clock += 1
                holdings.append((kind, fence, entered, clock))
            await asyncio.sleep(rng.uniform(0, 0.003))

    await asyncio.wait_for(asyncio.gather(*(user(index) for index in range(30))), 60)
    assert not violations, violations
    assert most_readers >= 2
    fences = [fence for _, fence, _, _ in holdings]
    assert len(holdings) == 90 and len(set(fences)) == 90
    for kind, fence, entered, left in holdings:
        if kind != "write":
            continue
        for _, other, other_entered, other_left in holdings:
            if other_left < entered:
                assert other < fence, "a holding before a writer has a larger fence"
            elif other_entered > left:
                assert other > fence, "a holding after a writer has a smaller fence"
    info = await locks[0].inspect()
    assert (info.writer, info.readers, info.queue_length, info.fence) == (None, 0, 0, max(fences))


# -- fairness --------------------------------------------------------------------------------


async def test_writer_is_not_starved_by_a_stream_of_readers(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """Readers arrive every 5 ms and hold 30 ms, so the read side is never empty. A writer
    that queues gets in after the readers already inside, while the stream goes on; every
    reader that arrived after the writer was queued gets in only after the writer."""
    name = "rw:stream"
    readers_rw = RedisReadWriteLock(r, name, ttl=10)
    writer_rw = RedisReadWriteLock(r2, name, ttl=10)
    probe = QueueProbe(r2)
    clock = 0
    writer_queued = False
    writer_entered_at: int | None = None  # on the logical clock
    late_readers: list[int] = []  # entry times of readers that arrived after the writer queued
    stop = asyncio.Event()
    readers_inside = 0
    writer_inside = False
    violations: list[str] = []

    async def reader() -> None:
        nonlocal clock, readers_inside
        arrived_late = writer_queued
        async with readers_rw.read():
            clock += 1
            if writer_inside:
                violations.append("reader inside with the writer")
            if arrived_late:
                late_readers.append(clock)
            readers_inside += 1
            await asyncio.sleep(0.03)
            readers_inside -= 1

    async def stream() -> None:
        readers: list[asyncio.Task[None]] = []
        while not stop.is_set():
            readers.append(tasks.start(reader()))
            await asyncio.sleep(0.005)
        await asyncio.wait_for(asyncio.gather(*readers), BOUND)

    async def writer() -> float:
        nonlocal clock, writer_entered_at, writer_inside
        async with writer_rw.write():
            clock += 1
            writer_entered_at = clock
            entered = time.monotonic()
            if readers_inside:
                violations.append(f"writer inside with {readers_inside} readers")
            writer_inside = True
            await asyncio.sleep(0.02)
            writer_inside = False
        return entered

    streaming = tasks.start(stream())
    await asyncio.sleep(0.1)  # the stream is flowing: readers overlap all the time
    assert not streaming.done()
    writing = tasks.start(writer())
    await probe.wait_queued(1, BOUND)
    queued_at = time.monotonic()
    writer_queued = True
    info = await writer_rw.inspect()
    assert info.writer is None and info.readers >= 1, info
    entered = await asyncio.wait_for(asyncio.shield(writing), 3.0)
    assert not stop.is_set() and not streaming.done()  # the stream was still going
    assert entered - queued_at < 1.0, f"writer waited {entered - queued_at:.3f}s"
    await asyncio.sleep(0.1)  # let some more readers through after the writer
    stop.set()
    await asyncio.wait_for(streaming, BOUND * 2)
    assert not violations, violations
    assert writer_entered_at is not None
    assert late_readers, "no reader arrived after the writer queued"
    assert min(late_readers) > writer_entered_at, (late_readers, writer_entered_at)
    info = await writer_rw.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 0, 0)


async def test_readers_queued_before_the_next_writer_enter_together(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """Queue R1 R2 R3 W2 R4 R5 behind a writer W1. W1 releases: R1-R3 get in together,
    W2, R4, R5 wait. R1-R3 release: W2 alone. W2 releases: R4 and R5 together."""
    name = "rw:batch"
    first = RedisReadWriteLock(r, name, ttl=10)
    rw = RedisReadWriteLock(r2, name, ttl=10)
    probe = QueueProbe(r2)
    room = Room()
    fences: dict[str, int] = {}

    async def user(label: str) -> None:
        side = rw.write() if label.startswith("W") else rw.read()
        async with side:
            fence = side.fencing_token
            assert fence is not None
            fences[label] = fence
            await room.stay(label)

    assert await first.write().acquire()
    order = ["R1", "R2", "R3", "W2", "R4", "R5"]
    users = {label: await tasks.queued(probe, user(label)) for label in order}
    info = await first.inspect()
    assert info.writer is not None and (info.readers, info.queue_length) == (0, 6), info
    assert not room.entered

    await first.write().release()
    await room.wait_inside({"R1", "R2", "R3"})
    info = await first.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 3, 3), info
    assert sorted(room.entered) == ["R1", "R2", "R3"]

    room.let_go("R1", "R2", "R3")
    await room.wait_inside({"W2"})
    info = await first.inspect()
    assert info.writer is not None and (info.readers, info.queue_length) == (0, 2), info
    assert room.inside == {"W2"}

    room.let_go("W2")
    await room.wait_inside({"R4", "R5"})
    info = await first.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 2, 0), info

    room.let_go("R4", "R5")
    await asyncio.wait_for(asyncio.gather(*users.values()), BOUND)
    assert sorted(room.entered[:3]) == ["R1", "R2", "R3"]
    assert room.entered[3] == "W2" and sorted(room.entered[4:]) == ["R4", "R5"]
    assert max(fences[label] for label in ("R1", "R2", "R3")) < fences["W2"]
    assert fences["W2"] < min(fences["R4"], fences["R5"])
    info = await first.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 0, 0)
    assert info.fence == max(fences.values())


async def test_a_released_read_write_lock_is_freed_without_the_garbage_collector(
    r: redis.asyncio.Redis,
) -> None:
    """A read-write lock made and used on both sides in a task of its own is freed by
    reference counting: each side referred to the lock, which refers to both."""

    async def cycle() -> weakref.ref[ReadLock]:
        rw = RedisReadWriteLock(r, "rw:freed")
        async with rw.read():
            await asyncio.sleep(0)
        async with rw.write():
            await asyncio.sleep(0)
        return weakref.ref(rw.read())  # (the lock itself has no weak references; it has the side)

    assert await freed_by_reference_counting(cycle), "left to the collector"


# -- reentry, timeouts ------------------------------------------------------------------------


@pytest.mark.parametrize("held", ["read", "write"])
async def test_the_other_side_by_the_same_task_is_reentry(
    r: redis.asyncio.Redis, held: str
) -> None:
    name = "rw:reentry"
    rw = RedisReadWriteLock(r, name, ttl=10)
    mine, other = (rw.read(), rw.write()) if held == "read" else (rw.write(), rw.read())
    del rw  # (the sides know each other without it, as `RedisReadWriteLock(...).read()`)
    async with mine:
        for attempt in (other, mine):
            started = time.monotonic()
            with pytest.raises(LockReentry), anyio.fail_after(BOUND):  # in this very task
                await attempt.acquire()
            assert time.monotonic() - started < 1.0  # at once, not after waiting
            with pytest.raises(LockReentry):
                await attempt.acquire(blocking=False)
        info = await mine.inspect()
        assert info.queue_length == 0 and info.fence == mine.fencing_token, info
        assert (info.readers, info.writer is not None) == (
            (1, False) if held == "read" else (0, True)
        )
        assert mine.statistics().held_here == 1 and other.statistics().held_here == 0
    info = await mine.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 0, 0)
    async with other:  # nothing was left behind: the other side is free
        assert (other.fencing_token or 0) > info.fence > 0


async def test_timeout_from_the_constructor(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis
) -> None:
    name = "rw:timeout"
    holder = RedisReadWriteLock(r, name, ttl=10)
    impatient = RedisReadWriteLock(r2, name, ttl=10, timeout=0.2)
    async with holder.read():
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            async with impatient.write():
                pytest.fail("a writer got in beside a reader")
        assert 0.2 <= time.monotonic() - started < 1.2
        async with impatient.read():  # readers share
            assert (await holder.inspect()).readers == 2
    async with holder.write():
        with pytest.raises(LockTimeout):
            async with impatient.read():
                pytest.fail("a reader got in beside a writer")
        assert (await holder.inspect()).queue_length == 0  # the timed-out reader withdrew
    info = await holder.inspect()
    assert (info.writer, info.readers, info.queue_length) == (None, 0, 0)


# -- leases ------------------------------------------------------------------------------------


async def test_lost_reader_lease_frees_the_writer(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """A reader's entry vanishes from the readers set (as when its lease ran out): the
    reader's body is cancelled with LockLost within the ttl, and a queued writer gets in
    within ttl + 0.25 s."""
    name, ttl = "rw:lost-reader", 1.0
    readers_key = f"aiolocks:rwlock:{{{name}}}:readers"
    rw = RedisReadWriteLock(r, name, ttl=ttl)
    writer_rw = RedisReadWriteLock(r2, name, ttl=10)
    probe = QueueProbe(r2)
    finished = False
    removed_at = 0.0
    writing: asyncio.Task[bool] | None = None
    with pytest.raises(LockLost) as info:
        async with rw.read():
            reader_fence = rw.read().fencing_token
            writing = await tasks.queued(probe, writer_rw.write().acquire(timeout=10))
            members = await r.zrange(readers_key, 0, -1)
            assert len(members) == 1, members
            assert await r.zrem(readers_key, *members) == 1
            removed_at = time.monotonic()
            await asyncio.sleep(10)
            finished = True
    assert not finished
    assert time.monotonic() - removed_at < ttl + 0.5
    assert info.value.name == name
    assert rw.read().statistics().held_here == 0
    assert writing is not None
    assert await asyncio.wait_for(writing, ttl + BOUND)
    waited = time.monotonic() - removed_at
    assert waited <= ttl + SLACK, f"writer waited {waited:.3f}s"
    state = await writer_rw.inspect()
    assert state.writer is not None and state.readers == 0
    assert reader_fence is not None and state.fence > reader_fence
    await writer_rw.write().release()  # adopts the holding of the finished task


# -- fencing --------------------------------------------------------------------------------


async def test_fences_increase_across_readers_and_writers(
    r: redis.asyncio.Redis, r2: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """Alternating phases (3 concurrent readers, then a writer), on two clients: every
    fence of a phase is larger than every fence of the phases before it."""
    name = "rw:fences"
    locks = [RedisReadWriteLock(client, name, ttl=10) for client in (r, r2)]
    phases: list[list[int]] = []
    for phase in range(6):
        room = Room()
        fences: list[int] = []

        async def reader(index: int, room: Room = room, fences: list[int] = fences) -> None:
            side = locks[index % 2].read()
            async with side:
                fence = side.fencing_token
                assert fence is not None
                fences.append(fence)
                await room.stay(f"R{index}")

        readers = [tasks.start(reader(index)) for index in range(3)]
        await room.wait_inside({"R0", "R1", "R2"})  # concurrent readers
        room.let_go("R0", "R1", "R2")
        await asyncio.wait_for(asyncio.gather(*readers), BOUND)
        phases.append(sorted(fences))
        writer = locks[phase % 2].write()
        async with writer:
            assert writer.fencing_token is not None
            phases.append([writer.fencing_token])
    every = [fence for phase in phases for fence in phase]
    assert every == sorted(every) and len(set(every)) == len(every) == 6 * 4
    for earlier, later in itertools.pairwise(phases):
        assert max(earlier) < min(later), phases
    assert (await locks[0].inspect()).fence == every[-1]
