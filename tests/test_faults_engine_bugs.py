"""The engine bugs of issue 24, each reproduced against real servers (a proxy that drops or
delays a link, a stalled event loop, `CLIENT PAUSE`), and the items found by reading it.

1. a grant believed after a later server answer said the token was not the holder;
2. a carried waiter queued by a release that answered {0} had no wake-up timer;
3. a cancelled carried waiter granted by a release that arrived after its clean-up;
4. `RedisMultiLock` keeping the mutex's bounds during a `CLIENT PAUSE`;
5. one failed `CONFIG GET` ending an acquisition the server had answered.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio
from _faultreport import record
from _faults import close_client
from _proxy import Proxy

from aiolocks import RedisMutex

pytestmark = pytest.mark.faults


# -- 5. one failed CONFIG GET ---------------------------------------------------------------


async def test_a_failed_config_get_does_not_end_a_queued_acquisition(
    proxy: Proxy, direct: redis.asyncio.Redis
) -> None:
    """The waiter's first try is answered (busy); the `CONFIG GET` its notifier sends before
    subscribing loses its connection. It waits on, as after a failed subscribe, and gets the
    lock when the holder releases. Before: `ServerUnavailable` at once."""
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        holder = RedisMutex(direct, "facts-lost", ttl=5)
        assert await holder.acquire()
        drop = proxy.drop_on(lambda data: b"notify-keyspace-events" in data, "request")
        waiter = RedisMutex(client, "facts-lost", ttl=5)
        waiting = asyncio.create_task(waiter.acquire(timeout=10))
        await asyncio.wait_for(drop.fired.wait(), 5)
        await asyncio.sleep(0.1)  # the waiter went on (or, before, failed)
        assert not waiting.done() or waiting.exception() is None, waiting.exception()
        released = time.monotonic()
        await holder.release()
        assert await asyncio.wait_for(waiting, 10)
        late = time.monotonic() - released
        await waiter.release()
        record("24.5 failed CONFIG GET", trials=1, recover=[late], note=f"granted {late:.3f} s")
    finally:
        await close_client(client)
