"""A process of tests/test_sync_processes.py: threads (`sync`) or asyncio tasks (`async`)
taking aiolocks' primitives on one name, driven by commands on stdin, one per line:

    count N K        N contenders, K rounds each: mutex; GET counter, RPUSH log fence, SET
    acquire ID       one contender: strict-FIFO mutex once; RPUSH order "ID fence"
    semaphore N K L  N contenders, K rounds each, limit L: INCR inside, a count above L
                     goes on the `over` list
    rate N K         N contenders, K permits each (rate 50/s, burst 5): RPUSH permits
    quit

Each command's end is printed: `counted`, `done ID`, `held`, `rated`. Every Redis write of
the test's log happens inside the critical section, so the log's order is the holders'.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio

import aiolocks
import aiolocks.sync

NAME = "interop"


def emit(*fields: object) -> None:
    print(" ".join(str(field) for field in fields), flush=True)


def run_sync(url: str) -> None:
    client = redis.Redis.from_url(url)
    mutex = aiolocks.sync.RedisMutex(client, NAME)
    strict = aiolocks.sync.RedisMutex(client, NAME, local_handoff=0)
    limiter = aiolocks.sync.RedisRateLimiter(client, NAME, rate=50, burst=5)
    started: list[threading.Thread] = []

    def spawn(count: int, body: Callable[[], None], then: str) -> None:
        threads = [threading.Thread(target=body) for _ in range(count)]
        for thread in threads:
            thread.start()

        def join() -> None:
            for thread in threads:
                thread.join()
            emit(then)

        started.append(threading.Thread(target=join))
        started[-1].start()

    for line in sys.stdin:
        command, *args = line.split()
        if command == "count":
            n, k = int(args[0]), int(args[1])

            def counting(k: int = k) -> None:
                for _ in range(k):
                    with mutex:
                        value = int(client.get("counter") or 0)
                        client.rpush("log", mutex.fencing_token or 0)
                        client.set("counter", value + 1)

            spawn(n, counting, "counted")
        elif command == "acquire":
            ident = args[0]

            def once(ident: str = ident) -> None:
                with strict:
                    client.rpush("order", f"{ident} {strict.fencing_token}")
                emit("done", ident)

            threading.Thread(target=once).start()
        elif command == "semaphore":
            n, k, limit = (int(arg) for arg in args)
            semaphore = aiolocks.sync.RedisSemaphore(client, NAME, limit=limit)

            def holding(k: int = k, limit: int = limit, semaphore: Any = semaphore) -> None:
                for _ in range(k):
                    with semaphore:
                        if client.incr("inside") > limit:
                            client.rpush("over", 1)
                        client.decr("inside")

            spawn(n, holding, "held")
        elif command == "rate":
            n, k = int(args[0]), int(args[1])

            def rating(k: int = k) -> None:
                for _ in range(k):
                    with limiter:
                        client.rpush("permits", 1)

            spawn(n, rating, "rated")
        elif command == "quit":
            break
    for thread in started:
        thread.join()


async def run_async(url: str) -> None:
    client = redis.asyncio.Redis.from_url(url)
    mutex = aiolocks.RedisMutex(client, NAME)
    strict = aiolocks.RedisMutex(client, NAME, local_handoff=0)
    limiter = aiolocks.RedisRateLimiter(client, NAME, rate=50, burst=5)
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[Any]] = set()

    async def counting(k: int) -> None:
        for _ in range(k):
            async with mutex:
                value = int(await client.get("counter") or 0)
                await client.rpush("log", mutex.fencing_token or 0)
                await client.set("counter", value + 1)

    async def once(ident: str) -> None:
        async with strict:
            await client.rpush("order", f"{ident} {strict.fencing_token}")
        emit("done", ident)

    async def holding(k: int, limit: int, semaphore: aiolocks.RedisSemaphore) -> None:
        for _ in range(k):
            async with semaphore:
                if await client.incr("inside") > limit:
                    await client.rpush("over", 1)
                await client.decr("inside")

    async def rating(k: int) -> None:
        for _ in range(k):
            async with limiter:
                await client.rpush("permits", 1)

    async def together(then: str, *work: Any) -> None:
        await asyncio.gather(*work)
        emit(then)

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command, *args = line.split()
        if command == "count":
            n, k = int(args[0]), int(args[1])
            work = together("counted", *(counting(k) for _ in range(n)))
        elif command == "acquire":
            work = once(args[0])
        elif command == "semaphore":
            n, k, limit = (int(arg) for arg in args)
            semaphore = aiolocks.RedisSemaphore(client, NAME, limit=limit)
            work = together("held", *(holding(k, limit, semaphore) for _ in range(n)))
        elif command == "rate":
            n, k = int(args[0]), int(args[1])
            work = together("rated", *(rating(k) for _ in range(n)))
        else:
            break
        task = asyncio.ensure_future(work)
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    await client.aclose()


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    emit("ready")
    if mode == "sync":
        run_sync(url)
    else:
        asyncio.run(run_async(url))
