"""Worker: a small service that is stopped while it holds locks and has tasks waiting.

    python exit_service.py URL PREFIX TTL HOW

Holds a `RedisMutex` (by `acquire()`, never released), a `RedisSemaphore` slot and a
`RedisMultiLock` (by `async with`, in tasks that never leave the block), and has one task
queued on the mutex in Redis (strict FIFO, `local_handoff=0`, so the queue entry is the
server's and its clean-up is what is checked; with the default it would wait in the
process); prints ``ready`` once the server has that waiter queued. Then, by HOW:

- ``return``: returns from `main()` as it is, the client never closed;
- ``close-return``: closes the client first (`await client.aclose()`), prints ``ended``
  and how each task holding or waiting ended (the engine stops using a closed client:
  ``LockLost LockLost ClientClosed``), then returns;
- ``wait``: waits for a signal; SIGINT (Ctrl-C) ends it through `asyncio.run()`;
- ``wait-term``: as ``wait``, and SIGTERM cancels the main task (the recipe of the docs).
- ``wait-term-as-int``: as ``wait``, and SIGTERM is Ctrl-C (docs/workers.md's one line).

Exits 0 after a return, 130 after Ctrl-C (or a SIGTERM made one), 143 after a handled
SIGTERM; an unhandled
SIGTERM kills it.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import redis.asyncio
from _lockworker import on_queued

from aiolocks import RedisMultiLock, RedisMutex, RedisSemaphore


async def hold_forever(lock: RedisSemaphore | RedisMultiLock, held: asyncio.Event) -> None:
    async with lock:
        held.set()
        await asyncio.Event().wait()


async def main(url: str, prefix: str, ttl: float, how: str) -> None:
    if how == "wait-term":
        main_task = asyncio.current_task()
        assert main_task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    if how == "wait-term-as-int":
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, signal.raise_signal, signal.SIGINT
        )
    client = redis.asyncio.Redis.from_url(url)
    queued = asyncio.Event()
    on_queued(client, lambda token: queued.set())
    mutex = RedisMutex(client, "exit:mutex", ttl=ttl, prefix=prefix, local_handoff=0)
    await mutex.acquire()
    slot, multi = asyncio.Event(), asyncio.Event()
    semaphore = RedisSemaphore(client, "exit:slots", limit=2, ttl=ttl, prefix=prefix)
    both = RedisMultiLock(client, ["exit:a", "exit:b"], ttl=ttl, prefix=prefix)
    holders = [
        asyncio.create_task(hold_forever(semaphore, slot)),
        asyncio.create_task(hold_forever(both, multi)),
        asyncio.create_task(
            RedisMutex(client, "exit:mutex", ttl=ttl, prefix=prefix, local_handoff=0).acquire()
        ),
    ]
    await asyncio.wait_for(asyncio.gather(slot.wait(), multi.wait(), queued.wait()), 10)
    print("ready", flush=True)
    if how == "close-return":
        await client.aclose()
        ended = await asyncio.wait_for(asyncio.gather(*holders, return_exceptions=True), 10)
        print("ended", *(type(outcome).__name__ for outcome in ended), flush=True)
    if how.startswith("wait"):
        await asyncio.gather(*holders)


if __name__ == "__main__":
    url, prefix, ttl, how = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    try:
        asyncio.run(main(url, prefix, ttl, how))
    except KeyboardInterrupt:
        sys.exit(130)
    except asyncio.CancelledError:
        sys.exit(143)
