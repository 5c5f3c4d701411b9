"""Worker: many tasks take permits of one `RedisRateLimiter` as fast as it grants them.

    python ratelimit_user.py URL NAME RATE PER BURST WORKERS TASKS SECONDS

BURST `none` is the default (the window reading); a JSON list of [rate, per, burst] is
`limits=` (RATE and PER then unused).

Waits until all WORKERS have connected (a barrier on the server), then runs TASKS tasks
sharing one limiter for SECONDS: each loops `acquire(timeout=<time left>)`. For each grant
it records the slot the server gave (its reply's clock plus the delay, in server
microseconds, read from the script's reply) and the server's `TIME` read once the call
returned, and the server's clock when the reservation was made. Prints ``grants <json list
of [slot_us, used_us, reserved_us]>`` at the end (a reply under limits another process set
with `set_limits()`, status 2, is a grant as well).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
import time
from typing import Any

import redis.asyncio
from _lockworker import emit, run
from _primitiveworker import barrier

from aiolocks import Limit, RedisRateLimiter

_replies: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("replies")


def spy_on_replies() -> None:
    """Keep each reservation's reply in the calling task's list (the slot it was given)."""
    original = RedisRateLimiter._call

    async def call(self: RedisRateLimiter, context: Any, args: tuple[Any, ...]) -> list[Any]:
        reply = await original(self, context, args)
        _replies.get().append(reply)
        return reply

    RedisRateLimiter._call = call  # type: ignore[method-assign]


async def main(argv: list[str]) -> int:
    url, name = argv[0], argv[1]
    rate, per = float(argv[2]), float(argv[3])
    burst = None if argv[4] in ("none", "") or argv[4].startswith("[") else int(argv[4])
    limits = [Limit(*limit) for limit in json.loads(argv[4])] if argv[4].startswith("[") else None
    workers, tasks, seconds = int(argv[5]), int(argv[6]), float(argv[7])
    client = redis.asyncio.Redis.from_url(url)
    spy_on_replies()
    grants: list[tuple[int, int, int]] = []
    try:
        await barrier(client, f"test:{{{name}}}:barrier", workers, 20)
        if limits is None:
            limiter = RedisRateLimiter(client, name, rate=rate, per=per, burst=burst)
        else:
            limiter = RedisRateLimiter(client, name, limits=limits)
        end = time.monotonic() + seconds

        async def user() -> None:
            replies: list[Any] = []
            _replies.set(replies)
            while (left := end - time.monotonic()) > 0:
                if not await limiter.acquire(timeout=left):
                    return
                seconds_, micros = await client.time()
                status, delay, now = (replies[-1][at] for at in (0, 1, 4))
                assert int(status) in (1, 2), replies[-1]
                used = int(seconds_) * 1_000_000 + int(micros)
                grants.append((int(now) + int(delay), used, int(now)))

        await asyncio.gather(*(user() for _ in range(tasks)))
    finally:
        await client.aclose()
    emit("grants", json.dumps(grants))
    return 0


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), 60))
