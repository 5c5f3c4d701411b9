"""Worker: adopt a holding handed over as a `LockHandle` string, keep it, release it.

    python handle_adopter.py URL HANDLE TTL HOLD

Parses HANDLE (``str(handle)``), adopts it with an instance of its kind (ttl TTL) and prints
``adopted <fence>``, or ``refused <error class>`` if adopt() raised. Then keeps it for HOLD
seconds (renewed here), prints ``lost`` if its lease was lost meanwhile, releases it and
prints ``released``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from _lockworker import connect, emit, run

from aiolocks import LockError, LockHandle, RedisMutex, RedisReadWriteLock, RedisSemaphore


def lock_for(client: Any, handle: LockHandle, ttl: float) -> Any:
    if handle.kind == "mutex":
        return RedisMutex(client, handle.name, ttl=ttl)
    if handle.kind == "semaphore":
        return RedisSemaphore(client, handle.name, limit=1, ttl=ttl)
    rw = RedisReadWriteLock(client, handle.name, ttl=ttl)
    return rw.read() if handle.kind == "rwlock-read" else rw.write()


async def main(argv: list[str]) -> int:
    url, handle = argv[0], LockHandle.parse(argv[1])
    ttl, hold = float(argv[2]), float(argv[3])
    client = connect(url)
    try:
        lock = lock_for(client, handle, ttl)
        try:
            await lock.adopt(handle)
        except LockError as refused:
            emit("outcome", "refused", type(refused).__name__)
            return 0
        emit("outcome", "adopted", lock.fencing_token)
        await asyncio.sleep(hold)
        if lock.lost.is_set():
            emit("lost")
        await lock.release()
        emit("released")
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), 30))
