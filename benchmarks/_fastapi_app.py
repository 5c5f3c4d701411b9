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
the counter only).

Each mode is its own FastAPI app of one route, and `app` picks it by the path's first part
(one dict lookup): in one app, Starlette tries the routes in order, so a mode declared later
would pay a failed match for each route before it (about 1 µs each, 1% of a request here,
measured: `/wait/` came sixth, `/floor/` second), a cost of the benchmark's layout, not of
the lock. The lifespan (the Redis client every mode shares, in `request.state`) runs once.

Each uvicorn worker applies the run's switch (`_switches.apply()`) when it imports this
module, if a run asks for one: only then are `_switches`' internals imported, so the app
also serves an older checkout's aiolocks (`bench_fastapi.py --base`), which needs only the
public API.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import redis.asyncio
from fastapi import Depends, FastAPI, HTTPException, Request

from aiolocks import RedisMutex
from aiolocks.integrations.fastapi import HeldLock, request_lock

FLIP_ENV = "AIOLOCKS_BENCH_FLIP"  # (`_switches.ENV`, read before importing it)
if os.environ.get(FLIP_ENV):
    from _switches import apply

    apply()
F = TypeVar("F", bound=Callable[..., Any])
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


# The app uvicorn runs the lifespan on (no routes: an unknown path is its 404).
_lifespan_app = FastAPI(lifespan=lifespan)
_apps: dict[str, FastAPI] = {}


def route(mode: str, path: str = "/{order}") -> Callable[[F], F]:
    """`@app.post` for `mode`'s own app: `POST /<mode><path>`."""
    return _apps.setdefault(mode, FastAPI()).post(f"/{mode}{path}")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The ASGI app: the lifespan once, each request to its mode's app."""
    if scope["type"] == "lifespan":
        await _lifespan_app(scope, receive, send)
        return
    await _apps.get(scope["path"].split("/", 2)[1], _lifespan_app)(scope, receive, send)


slot_lock = request_lock("bench:slot:{slot}", timeout=None)


@route("slots", "/{slot}/add")
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


@route("floor")
async def floor(order: int, request: Request) -> int:
    async with floor_locks[order]:
        return await body(request.state.redis, "floor", order)


@route("by-hand")
async def by_hand(order: int, request: Request) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand:{order}"):
        return await body(client, "by-hand", order)


@route("by-hand-handoff")
async def by_hand_handoff(order: int, request: Request) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand-handoff:{order}", local_handoff=LOCAL_HANDOFF):
        return await body(client, "by-hand-handoff", order)


async def nothing() -> None:
    """A dependency that does nothing: FastAPI's own cost for one `Depends`."""


@route("by-hand-depends")
async def by_hand_depends(
    order: int, request: Request, _: Annotated[None, Depends(nothing)]
) -> int:
    client = request.state.redis
    async with RedisMutex(client, f"bench:by-hand-depends:{order}"):
        return await body(client, "by-hand-depends", order)


wait_lock = request_lock("bench:wait:{order}", timeout=None)
refuse_lock = request_lock("bench:refuse:{order}")


@route("wait")
async def wait(order: int, request: Request, _: Annotated[HeldLock, Depends(wait_lock)]) -> int:
    return await body(request.state.redis, "wait", order)


@route("refuse")
async def refuse(order: int, request: Request, _: Annotated[HeldLock, Depends(refuse_lock)]) -> int:
    return await body(request.state.redis, "refuse", order)


@route("by-hand-refuse")
async def by_hand_refuse(order: int, request: Request) -> int:
    client = request.state.redis
    lock = RedisMutex(client, f"bench:by-hand-refuse:{order}")
    if not await lock.acquire(blocking=False):
        raise busy(order)
    try:
        return await body(client, "by-hand-refuse", order)
    finally:
        await lock.release()


@route("redis-py")
async def redis_py(order: int, request: Request) -> int:
    client: redis.asyncio.Redis = request.state.redis
    lock = client.lock(f"bench:redis-py:{order}", timeout=30, blocking=False)
    if not await lock.acquire():
        raise busy(order)
    try:
        return await body(client, "redis-py", order)
    finally:
        await lock.release()
