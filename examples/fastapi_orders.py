"""An order service on FastAPI where no order is charged twice at once.

    pip install -e '.[examples]' && python examples/fastapi_orders.py [PORT]

(or `uvicorn --app-dir examples fastapi_orders:app`). It prints its own URL and its Redis
server's, with the `aiolocks` command that shows the locks there, and what to try, from
another terminal:

    curl -X POST 127.0.0.1:8000/orders/1001/charge   # 200, with the lock's fence
    curl -X POST 127.0.0.1:8000/orders/1001/charge   # 409 already_charged: the record
    # a double-click: two requests at once for an order not charged yet
    for i in 1 2; do curl -s -X POST 127.0.0.1:8000/orders/1002/charge & done; wait
    # one 200, and one 409 lock_busy: the lock turned it away while the first ran
    curl -X POST 127.0.0.1:8000/orders/xyz/charge    # 422, one error: not a number

Each request to an order's endpoints holds the `RedisMutex` "orders:<id>", through
`aiolocks.integrations.fastapi.request_lock`, named from the validated order id: a request
whose id is not a number (`POST /orders/xyz/charge`) is answered 422 before any lock is
taken, and leaves nothing in Redis.

- `POST /orders/{order_id}/charge` answers 409 at once while another request holds the
  order (a double-click must not charge twice), and records the charge with the
  request's fencing token;
- `POST /orders/{order_id}/ship` waits up to `SHIP_WAIT` seconds for the order, then 423.

The Redis client lives in the lifespan state: `REDIS_URL`, or an embedded Valkey started
with the app and stopped after it.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import redis.asyncio as redis
import uvicorn
from _orders import PaymentGateway, charge_order, redis_client, serving
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from aiolocks.integrations.fastapi import HeldLock, request_lock

CHARGE_TTL = 10.0  # seconds; renewed in the background while the request runs
SHIP_WAIT = 2.0  # seconds a shipping request waits for the order before answering 423


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    async with redis_client() as client:
        yield {"redis": client}  # request_lock() finds the client here


def gateway() -> PaymentGateway:
    return PaymentGateway()


def client_of(request: Request) -> redis.Redis:
    client: redis.Redis = request.state.redis  # the lifespan state
    return client


def order_lock_name(order_id: int) -> str:
    """The lock of one order. FastAPI validates `order_id` before calling this, so an
    invalid id takes no lock (a template such as "orders:{order_id}" would use it raw)."""
    return f"orders:{order_id}"


app = FastAPI(title="orders", lifespan=lifespan)


@app.exception_handler(RequestValidationError)
async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422, each error once: a bad order id fails both where the endpoint and
    where the lock's name declare `order_id`, and FastAPI would list it twice."""
    errors: list[Any] = []
    for error in jsonable_encoder(exc.errors()):
        if error not in errors:
            errors.append(error)
    return JSONResponse({"detail": errors}, status_code=422)


charge_lock = request_lock(order_lock_name, ttl=CHARGE_TTL)  # busy: 409 at once
ship_lock = request_lock(order_lock_name, timeout=SHIP_WAIT, busy_status=423)


@app.post("/orders/{order_id}/charge")
async def charge(
    order_id: int,
    lock: Annotated[HeldLock, Depends(charge_lock)],
    payments: Annotated[PaymentGateway, Depends(gateway)],
    client: Annotated[redis.Redis, Depends(client_of)],
) -> dict[str, int]:
    outcome, amount = await charge_order(client, payments, order_id, lock.fencing_token)
    if outcome != "charged":
        raise HTTPException(409, detail={"error": outcome, "order": order_id})
    return {"order": order_id, "amount": amount, "fence": lock.fencing_token}


@app.post("/orders/{order_id}/ship")
async def ship(order_id: int, lock: Annotated[HeldLock, Depends(ship_lock)]) -> dict[str, int]:
    return {"order": order_id, "fence": lock.fencing_token}


class AnnouncedServer(uvicorn.Server):
    """uvicorn's server, saying where the app is once it listens."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            serving(f"http://{self.config.host}:{self.config.port}")


if __name__ == "__main__":
    port = int(sys.argv[1]) if sys.argv[1:] else 8000
    # uvicorn shuts down gracefully on Ctrl-C (and SIGTERM), then raises the signal again:
    # Ctrl-C comes back as a KeyboardInterrupt once everything is closed, ending quietly here.
    with contextlib.suppress(KeyboardInterrupt):
        AnnouncedServer(uvicorn.Config(app, host="127.0.0.1", port=port)).run()
