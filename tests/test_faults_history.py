"""Exclusion checked from the outside: holders log (kind, fence, start, end) on the server
inside their critical sections, and the log must show no overlap and rising fences.

The checker is shown to catch broken histories first (synthetic ones, and a real run with
no lock at all), so that "no violations" in the fault tests means something.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest
import redis.asyncio
from _faultreport import record
from _faults import KINDS, Contention, Kind, leftovers, make_sides
from _history import Entry, HistoryLog, check
from _servers import ServerProcess

pytestmark = pytest.mark.faults


def _entry(kind: str, fence: int, start: int, end: int, value: int = 0, seen: int = 0) -> Entry:
    return Entry(kind, fence, start, end, value, seen, 0, 0, "t")


@pytest.mark.parametrize(
    ("entries", "limit", "counter", "finding"),
    [
        ([_entry("x", 1, 1, 4), _entry("x", 2, 2, 3)], 1, None, "overlaps"),
        ([_entry("r", 1, 1, 4), _entry("x", 2, 2, 5)], 1, None, "overlaps"),
        ([_entry("x", 1, 1, 4), _entry("r", 2, 2, 5)], 1, None, "overlaps writer"),
        ([_entry("s", 1, 1, 9), _entry("s", 2, 2, 8), _entry("s", 3, 3, 7)], 2, None, "of 2"),
        ([_entry("x", 2, 1, 2), _entry("x", 1, 3, 4)], 1, None, "fence went back"),
        ([_entry("r", 2, 1, 2), _entry("x", 1, 3, 4)], 1, None, "fence went back"),
        ([_entry("x", 1, 1, 2), _entry("x", 1, 3, 4)], 1, None, "duplicate fences"),
        ([_entry("r", 1, 1, 4, value=0, seen=1)], 1, None, "changed under reader"),
        ([_entry("x", 1, 1, 2), _entry("x", 2, 3, 4)], 1, 1, "counter is 1 after 2"),
        ([_entry("x", 1, 3, 2)], 1, None, "ends before it starts"),
    ],
)
def test_the_checker_catches_broken_histories(
    entries: list[Entry], limit: int, counter: int | None, finding: str
) -> None:
    problems = check(entries, limit=limit, counter=counter)
    assert any(finding in problem for problem in problems), problems


def test_the_checker_accepts_sound_histories() -> None:
    sound = [
        _entry("x", 1, 1, 2),
        _entry("r", 3, 3, 6),  # readers overlap each other, granted out of order
        _entry("r", 2, 4, 5),
        _entry("x", 4, 7, 8),
        _entry("s", 5, 9, 12),
        _entry("s", 6, 10, 11),
    ]
    assert check(sound, limit=2) == []


async def test_a_run_without_the_lock_is_caught(r: redis.asyncio.Redis) -> None:
    log = HistoryLog(r, "no-lock")
    fences = iter(range(1, 10_000))

    async def unlocked(who: int) -> None:
        for _ in range(5):
            started = await log.start()
            await asyncio.sleep(0.001)
            await log.end("x", next(fences), started, who)

    await asyncio.gather(*(unlocked(i) for i in range(4)))
    problems = check(await log.entries(), counter=await log.counter())
    assert any("overlaps" in p for p in problems)
    assert any("counter is" in p for p in problems)  # lost updates too


# "mutex+local": the first client's mutex passes it among its tasks (local hand-off), the
# second's is strict FIFO, on the same name.
@pytest.mark.parametrize("variant", [*KINDS, "mutex+local"])
async def test_history_of_a_contended_run_is_sound(
    server: ServerProcess, r: redis.asyncio.Redis, variant: str
) -> None:
    """Two clients, eight tasks, every holding logged; 2 permits for the semaphore."""
    kind = cast(Kind, variant.split("+")[0])
    name = f"hist-{variant}"
    others = [redis.asyncio.Redis.from_url(server.url) for _ in range(2)]
    try:
        log = HistoryLog(r, name)
        run = Contention(iterations=15)
        workers = [
            (
                make_sides(client, kind, name, ttl=5, timeout=20, **_options(variant, i)),
                log.on(client),
                f"c{i}t{t}",
            )
            for i, client in enumerate(others)
            for t in range(4)
        ]
        started = time.monotonic()
        await run.run(workers)
        elapsed = time.monotonic() - started
        entries = await log.entries()
        problems = check(entries, limit=2, counter=await log.counter())
        orphans = await leftovers(r, kind, name)
        record(
            f"7 history check: contended {variant}",
            trials=len(entries),
            violations=len(problems),
            orphaned=len(orphans),
            note=f"{server.name}: {len(entries)} holdings in {elapsed:.2f} s",
        )
        assert problems == []
        assert len(entries) == run.completed == 8 * 15
        assert orphans == {}
    finally:
        for client in others:
            await client.aclose()


def _options(variant: str, client: int) -> dict[str, int]:
    return {"local_handoff": 3} if variant == "mutex+local" and client == 0 else {}
