"""The FastAPI app the benchmarks serve under uvicorn: a lock per order id, by each means.

    AIOLOCKS_BENCH_URL=redis://... uvicorn _fastapi_app:app --app-dir benchmarks --workers 2

`POST /MODE/{order}` holds the order's lock while its body runs: a 5 ms wait (the slow
call a lock per order protects) and a read-modify-write of the order's counter, so an
overlap shows as a lost update (`bench_fastapi.py` compares the counters with the 2xx
answers). The modes (`MODES`):

- `floor`: an in-process `asyncio.Lock` per order (a floor for one worker; no mutual
  exclusion across workers);
- `by-hand`: `async with RedisMutex(client, name)` in the endpoint, waiting;
- `by-hand-handoff`: the same with `local_handoff=16`;
- `by-hand-depends`: `by-hand` in an endpoint that also takes a trivial `async def`
  dependency: what FastAPI's `Depends` costs by itself, the floor for `wait`;
- `wait`: `request_lock(template, timeout=None)`;
- `refuse`: `request_lock(template)` (409 when the order is held);
- `by-hand-refuse`: `RedisMutex.acquire(blocking=False)` by hand, 409 when held;
- `redis-py`: redis-py's `Lock` with `blocking=False`, 409 when held.

`POST /slots/{slot}/add` is `bench_optimizations.py`'s request (a `request_lock` waiting,
the counter only). Each uvicorn worker applies the run's switch (`_switches.apply()`) when
it imports this module, if a run asks for one: only then are `_switches`' internals
imported, so the app also serves an older checkout's aiolocks (`bench_fastapi.py --base`),
which needs only the public API.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis.asyncio
from fastapi import Depends, FastAPI, HTTPException, Request

from aiolocks import RedisMutex
from aiolocks.integrations.fastapi import HeldLock, request_lock

FLIP_ENV = "AIOLOCKS_BENCH_FLIP"  # (`_switches.ENV`, read before importing it)
if os.environ.get(FLIP_ENV):
    from _switches import apply

    apply()
URL_ENV = "AIOLOCKS_BENCH_URL"
COUNTER = "bench:slot-counter:"
ORDER_COUNTER = "bench:order-counter:"  # + MODE:ORDER
BODY_S = 0.005
LOCAL_HANDOFF = 16
MODES = (
    "floor",
    "by-hand",
    "by-hand-handoff",
    "by-hand-depends",
    "wait",
    "refuse",
    "by-hand-refuse",
    "redis-py",
)


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    async with redis.asyncio.Redis.from_url(os.environ[URL_ENV]) as client:
        yield {"redis": client}


app = FastAPI(lifespan=lifespan)
slot_lock = request_lock("bench:slot:{slot}", timeout=None)


@app.post("/slots/{slot}/add")
async def add(
    slot: int, request: Request, lock: Annotated[HeldLock, Depends(slot_lock)]
) -> dict[str, int]:
    client: redis.asyncio.Redis = request.state.redis
    key = f"{COUNTER}{slot}"
    value = int(await client.get(key) or 0) + 1
    await client.set(key, value)
    return {"slot": slot, "value": value, "fence": lock.fencing_token}


async def body(client: redis.asyncio.Redis, mode: str, order: int) -> int:
    """What each request does under its order's lock; the order's new count."""
    await asyncio.sleep(BODY_S)
    key = f"{ORDER_COUNTER}{mode}:{order}"
    value = int(await client.get(key) or 0) + 1
    await client.set(key, value)
    return value


def busy(order: int) -> HTTPException:
    return HTTPException(409, detail={"error": "lock_busy", "order": order})


floor_locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)


@app.post("/floor/{order}")
async def floor(order: int, request: Request) -> int:
    async with floor_locks[order]:
        return await body(request.state.redis, "floor", order)


@app.post("/by-hand/{order}")
async def by_hand(order: int, request: Request) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand:{order}"):
        return await body(client, "by-hand", order)


@app.post("/by-hand-handoff/{order}")
async def by_hand_handoff(order: int, request: Request) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand-handoff:{order}", local_handoff=LOCAL_HANDOFF):
        return await body(client, "by-hand-handoff", order)


async def nothing() -> None:
    """A dependency that does nothing: FastAPI's own cost for one `Depends`."""


@app.post("/by-hand-depends/{order}")
async def by_hand_depends(
    order: int, request: Request, _: Annotated[None, Depends(nothing)]
) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand-depends:{order}"):
        return await body(client, "by-hand-depends", order)


wait_lock = request_lock("bench:wait:{order}", timeout=None)
refuse_lock = request_lock("bench:refuse:{order}")


@app.post("/wait/{order}")
async def wait(order: int, request: Request, _: Annotated[HeldLock, Depends(wait_lock)]) -> int:
    return await body(request.state.redis, "wait", order)


@app.post("/refuse/{order}")
async def refuse(order: int, request: Request, _: Annotated[HeldLock, Depends(refuse_lock)]) -> int:
    return await body(request.state.redis, "refuse", order)


@app.post("/by-hand-refuse/{order}")
async def by_hand_refuse(order: int, request: Request) -> int:
    client = request.state.redis
    lock = RedisMutex(client, f"bench:by-hand-refuse:{order}")
    if not await lock.acquire(blocking=False):
        raise busy(order)
    try:
        return await body(client, "by-hand-refuse", order)
    finally:
        await lock.release()


@app.post("/redis-py/{order}")
async def redis_py(order: int, request: Request) -> int:
    client: redis.asyncio.Redis = request.state.redis
    lock = client.lock(f"bench:redis-py:{order}", timeout=30, blocking=False)
    if not await lock.acquire():
        raise busy(order)
    try:
        return await body(client, "redis-py", order)
    finally:
        await lock.release()
