"""The outside view of exclusion: every holder logs its critical section on the server, and
`check` finds overlapping holdings, fence inversions and lost updates in that log.

Inside its critical section a holder calls `HistoryLog.start()` first and `end()` last. Both
are one Lua script each, so the marks are placed in the server's own execution order: a
sequence number from `INCR` on one key orders every mark against every other mark and
against the lock scripts themselves (the server runs one script at a time). A holding's
`[start, end]` therefore lies inside the span the server considered it held, and two
holdings the lock kept apart can never overlap in sequence numbers. This clock is immune
to wall-clock steps and to the holders' process clocks; the server's `TIME` is logged
beside it only to measure durations (recovery times), never to order.

Kinds: ``x`` exclusive (mutex, writer, semaphore with one permit) reads a counter at
``start`` and writes it plus one at ``end`` (a non-atomic increment: an overlap loses an
update); ``r`` a reader (reads only; the counter must not change under it); ``s`` a
permit of a semaphore with several (at most ``limit`` at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio

__all__ = ["Entry", "HistoryLog", "Started", "check"]

_START = """
local seq = redis.call('INCR', KEYS[1])
local value = redis.call('GET', KEYS[2]) or '0'
local t = redis.call('TIME')
return {seq, value, t[1] .. string.format('%06d', tonumber(t[2]))}
"""

# Idempotent per fence: a retried call (reply lost on a killed connection) logs once.
_END = """
if redis.call('HSETNX', KEYS[4], ARGV[2], 1) == 0 then
  return 0
end
local seq = redis.call('INCR', KEYS[1])
local seen = redis.call('GET', KEYS[2]) or '0'
if ARGV[1] == 'x' then
  redis.call('SET', KEYS[2], tonumber(ARGV[4]) + 1)
end
local t = redis.call('TIME')
local now_us = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('RPUSH', KEYS[3], table.concat(
  {ARGV[1], ARGV[2], ARGV[3], seq, ARGV[4], seen, ARGV[5], now_us, ARGV[6]}, ' '))
return seq
"""


@dataclass(frozen=True, slots=True)
class Started:
    """What `HistoryLog.start` saw: its sequence number, the counter, server time (µs)."""

    seq: int
    value: int
    at_us: int


@dataclass(frozen=True, slots=True)
class Entry:
    """One completed holding, as logged by its holder."""

    kind: str
    fence: int
    start: int  # sequence numbers
    end: int
    value_in: int  # the counter at start
    value_out: int  # the counter just before end wrote it
    start_us: int  # server time, for durations only
    end_us: int
    who: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class HistoryLog:
    """The log of one lock name: keys ``hist:{NAME}:*`` (outside the aiolocks prefix)."""

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self.client = client
        tag = f"hist:{{{name}}}"
        self.keys = (f"{tag}:seq", f"{tag}:counter", f"{tag}:log", f"{tag}:done")

    def on(self, client: redis.asyncio.Redis) -> HistoryLog:
        """The same log, written through another client."""
        log = HistoryLog.__new__(HistoryLog)
        log.client, log.keys = client, self.keys
        return log

    async def start(self) -> Started:
        seq, value, at = await self.client.eval(_START, 2, *self.keys[:2])
        return Started(int(seq), int(value), int(at))

    async def end(self, kind: str, fence: int, started: Started, who: object) -> None:
        args = (kind, fence, started.seq, started.value, started.at_us, str(who))
        await self.client.eval(_END, 4, *self.keys, *args)

    async def entries(self) -> list[Entry]:
        lines = await self.client.lrange(self.keys[2], 0, -1)
        found = []
        for line in lines:
            kind, fence, start, end, value_in, value_out, start_us, end_us, who = _text(line).split(
                " "
            )
            found.append(
                Entry(
                    kind,
                    int(fence),
                    int(start),
                    int(end),
                    int(value_in),
                    int(value_out),
                    int(start_us),
                    int(end_us),
                    who,
                )
            )
        return found

    async def counter(self) -> int:
        return int(await self.client.get(self.keys[1]) or 0)

    async def clear(self) -> None:
        await self.client.delete(*self.keys)


def check(entries: Iterable[Entry], *, limit: int = 1, counter: int | None = None) -> list[str]:
    """Every way `entries` break exclusion; empty when the history is sound.

    - no ``x`` holding overlaps any other; no ``r`` overlaps an ``x``; at most `limit`
      ``s`` holdings at once;
    - fences are unique, and a holding that ended before an exclusive one started (or an
      exclusive one that ended before any other started) has the smaller fence;
    - a reader saw the counter unchanged; `counter` (if given) equals the number of
      exclusive holdings (no lost update).
    """
    entries = list(entries)
    problems: list[str] = []
    fences = [entry.fence for entry in entries]
    if len(set(fences)) != len(fences):
        twice = sorted(f for f in set(fences) if fences.count(f) > 1)
        problems.append(f"duplicate fences: {twice}")
    events: list[tuple[int, int, Entry]] = []
    for entry in entries:
        if entry.end <= entry.start:
            problems.append(f"holding ends before it starts: {entry}")
            continue
        events.append((entry.start, 1, entry))
        events.append((entry.end, 0, entry))
    events.sort(key=lambda event: (event[0], event[1]))
    active: dict[str, list[Entry]] = {"x": [], "r": [], "s": []}
    max_ended = 0  # highest fence of any holding that has ended
    max_ended_x = 0  # highest fence of an exclusive holding that has ended
    for _, is_start, entry in events:
        if not is_start:
            active[entry.kind].remove(entry)
            max_ended = max(max_ended, entry.fence)
            if entry.kind == "x":
                max_ended_x = max(max_ended_x, entry.fence)
            continue
        others = [e for group in active.values() for e in group]
        if entry.kind == "x" and others:
            problems.append(f"{entry} overlaps {others}")
        elif entry.kind == "r" and active["x"]:
            problems.append(f"reader {entry} overlaps writer {active['x']}")
        elif entry.kind == "s" and len(active["s"]) >= limit:
            problems.append(f"{entry} is holding number {len(active['s']) + 1} of {limit}")
        floor = max_ended if entry.kind == "x" else max_ended_x
        if entry.fence <= floor:
            problems.append(f"fence went back: {entry} started after fence {floor} ended")
        active[entry.kind].append(entry)
    for entry in entries:
        if entry.kind == "r" and entry.value_in != entry.value_out:
            problems.append(f"the counter changed under reader {entry}")
    if counter is not None:
        exclusive = sum(1 for entry in entries if entry.kind == "x")
        if counter != exclusive:
            problems.append(f"counter is {counter} after {exclusive} exclusive holdings")
    return problems
