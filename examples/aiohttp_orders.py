"""An order service on aiohttp where no order is charged twice at once.

    pip install -e '.[examples]' && python examples/aiohttp_orders.py [PORT]
    curl -X POST 127.0.0.1:8080/orders/1001/charge   # 200; again: 409 already_charged
    # a double-click: two requests at once for an order not charged yet
    for i in 1 2; do curl -s -X POST 127.0.0.1:8080/orders/1002/charge & done; wait
    # one 200, and one 409 lock_busy: the lock turned it away while the first ran

The same service as `fastapi_orders.py`, through `aiolocks.integrations.aiohttp`: each
request to an order's endpoints holds the `RedisMutex` "orders:<id>";
`POST /orders/{order_id}/charge` answers 409 at once while another request holds the
order, `POST /orders/{order_id}/ship` waits up to `SHIP_WAIT` seconds, then 423. The
client is `app[REDIS]`, on `REDIS_URL` or an embedded Valkey started with the app; both
URLs are printed at the start, with the `aiolocks` command that shows the locks.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

from _orders import PaymentGateway, charge_order, redis_client, serving
from aiohttp import web

from aiolocks.integrations.aiohttp import REDIS, held_lock, locked

CHARGE_TTL = 10.0  # seconds; renewed in the background while the request runs
SHIP_WAIT = 2.0  # seconds a shipping request waits for the order before answering 423

GATEWAY = web.AppKey("gateway", PaymentGateway)
routes = web.RouteTableDef()


@routes.post("/orders/{order_id:\\d+}/charge")
@locked("orders:{order_id}", ttl=CHARGE_TTL)  # busy: 409 at once
async def charge(request: web.Request) -> web.Response:
    order_id = int(request.match_info["order_id"])
    lock = held_lock(request)
    payments = request.app[GATEWAY]
    outcome, amount = await charge_order(request.app[REDIS], payments, order_id, lock.fencing_token)
    if outcome != "charged":
        return web.json_response({"error": outcome, "order": order_id}, status=409)
    return web.json_response({"order": order_id, "amount": amount, "fence": lock.fencing_token})


@routes.post("/orders/{order_id:\\d+}/ship")
@locked("orders:{order_id}", timeout=SHIP_WAIT, busy_status=423)
async def ship(request: web.Request) -> web.Response:
    order_id = int(request.match_info["order_id"])
    return web.json_response({"order": order_id, "fence": held_lock(request).fencing_token})


async def redis_context(app: web.Application) -> AsyncIterator[None]:
    async with redis_client() as client:
        app[REDIS] = client  # where @locked finds the client
        yield


def make_app() -> web.Application:
    app = web.Application()
    app[GATEWAY] = PaymentGateway()
    app.cleanup_ctx.append(redis_context)
    app.add_routes(routes)
    return app


if __name__ == "__main__":
    port = int(sys.argv[1]) if sys.argv[1:] else 8080
    # aiohttp calls `print` once it listens.
    web.run_app(
        make_app(), host="127.0.0.1", port=port, print=lambda _: serving(f"http://127.0.0.1:{port}")
    )
