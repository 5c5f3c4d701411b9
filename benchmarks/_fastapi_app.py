"""The FastAPI app `bench_optimizations.py` serves under uvicorn: a mutex per request.

    AIOLOCKS_BENCH_URL=redis://... uvicorn _fastapi_app:app --app-dir benchmarks --workers 2

`POST /slots/{slot}/add` holds the `RedisMutex` "bench:slot:{slot}" (waiting for it, as
`request_lock(..., timeout=None)` does) while it reads and writes the slot's counter: the
read-modify-write a lock per order or per account protects. The load generator spreads
its requests over a few hot slots. Each uvicorn worker applies the run's switch
(`_switches.apply()`) when it imports this module.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis.asyncio
from _switches import apply
from fastapi import Depends, FastAPI, Request

from aiolocks.integrations.fastapi import HeldLock, request_lock

apply()
URL_ENV = "AIOLOCKS_BENCH_URL"
COUNTER = "bench:slot-counter:"


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
