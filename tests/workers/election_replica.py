"""Worker: one replica of `examples/singleton_scheduler.py`, its job runs logged.

    python election_replica.py URL REPLICA TTL PERIOD SECONDS

Runs the example's `lead_or_follow` for at most SECONDS. Each job run is logged on the
server (`_history.HistoryLog`, name "scheduler", kind ``x``, "fence" = term fence x 1000 +
run index in the term, so entries are unique and rise with the term) around the example's
own fenced write. Prints the example's lines (``elected REPLICA fence F``) and
``ran F N`` after each run.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import redis.asyncio
from _history import HistoryLog
from _lockworker import connect, emit, run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import singleton_scheduler


async def main(argv: list[str]) -> int:
    url, replica, ttl, period = argv[0], argv[1], float(argv[2]), float(argv[3])
    client = connect(url)
    log = HistoryLog(client, singleton_scheduler.ELECTION)
    runs: dict[int, int] = {}

    async def job(client: redis.asyncio.Redis, replica: str, fence: int) -> None:
        started = await log.start()
        await singleton_scheduler.nightly_report(client, replica, fence)
        await asyncio.sleep(0.02)  # the job's work: long enough to overlap if it could
        runs[fence] = runs.get(fence, 0) + 1
        await log.end("x", fence * 1000 + runs[fence], started, replica)
        emit("ran", fence, runs[fence])

    await singleton_scheduler.lead_or_follow(
        client, replica, job=job, ttl=ttl, period=period, say=lambda line: emit(line)
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[5])))
