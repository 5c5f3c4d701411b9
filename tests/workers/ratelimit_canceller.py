"""Worker: a cancellation storm on one `RedisRateLimiter` name.

    python ratelimit_canceller.py URL NAME RATE BURST WORKERS TASKS SECONDS SEED

Waits until all WORKERS have connected (a barrier on the server), then runs TASKS tasks for
SECONDS, each with a limiter instance of its own (so that its statistics say what became of
each of its reservations): each loops `acquire()` in a task of its own and, about half the
time, cancels it after 0-60 ms (often while it sleeps until its slot). For every
reservation the server made (status 1) it records its counter (the state's `seq`, unique
per name while the key lives), its task, its slot in server microseconds and what became
of it: `granted` (the slot used), `given` (cancelled, given back) or `lost` (cancelled, the
give-back's compare-and-set failed). Prints ``reservations <json list of
[seq, task, slot_us, outcome]>`` at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from typing import Any

import redis.asyncio
from _lockworker import emit, run
from _primitiveworker import barrier
from ratelimit_user import _replies, spy_on_replies  # one spy on the reservations

from aiolocks import RedisRateLimiter


async def main(argv: list[str]) -> int:
    url, name = argv[0], argv[1]
    rate, burst = float(argv[2]), int(argv[3])
    workers, tasks, seconds, seed = int(argv[4]), int(argv[5]), float(argv[6]), int(argv[7])
    rng = random.Random(seed * 1000 + os.getpid())
    client = redis.asyncio.Redis.from_url(url)
    spy_on_replies()
    records: list[tuple[int, str, int, str]] = []
    try:
        await barrier(client, f"test:{{{name}}}:barrier", workers, 20)
        end = time.monotonic() + seconds

        async def user(index: int) -> None:
            who = f"{os.getpid()}:{index}"
            limiter = RedisRateLimiter(client, name, rate=rate, burst=burst)
            replies: list[Any] = []
            _replies.set(replies)
            while time.monotonic() < end:
                seen = len(replies)
                stats = limiter.statistics()
                attempt = asyncio.create_task(limiter.acquire())
                if rng.random() < 0.5:
                    await asyncio.wait([attempt], timeout=rng.random() * 0.06)
                    attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await attempt
                reserved = [reply for reply in replies[seen:] if int(reply[0]) in (1, 2)]
                assert len(reserved) <= 1, reserved
                if not reserved:
                    continue  # cancelled before its call reached the server's reply
                reply = reserved[0]
                after = limiter.statistics()
                if after.given_back > stats.given_back:
                    outcome = "given"
                elif after.slots_lost > stats.slots_lost:
                    outcome = "lost"
                else:  # granted (a cancellation that came as it returned changes nothing)
                    outcome = "granted"
                slot = int(reply[4]) + int(reply[1])
                records.append((int(reply[3]), who, slot, outcome))

        await asyncio.gather(*(user(index) for index in range(tasks)))
    finally:
        await client.aclose()
    emit("reservations", json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), 60))
