"""A Celery worker that charges orders under the same lock as the FastAPI service.

    pip install -e '.[examples]'
    REDIS_URL=redis://127.0.0.1:6379/0 python examples/fastapi_orders.py 8000 &
    cd examples && REDIS_URL=redis://127.0.0.1:6379/0 celery -A celery_orders worker

then, from Python (`cd examples`), a charge queued for the worker while the web app may be
charging the same order:

    >>> from celery_orders import charge
    >>> charge.delay(1001).get(timeout=30)
    {'order': 1001, 'outcome': 'charged', 'amount': 100100, 'fence': ...}

The task holds `aiolocks.sync.RedisMutex("orders:<id>")`: the very lock (same name, same
keys, same FIFO queue) that `examples/fastapi_orders.py` takes for each request on that
order, so a web request and a worker never charge one order at the same time, whichever
comes first. The charge is recorded with the holder's fencing token by the same script as
the web app's, so a holder that lost its lease while paused cannot overwrite a newer one.

Celery's default pool (prefork) forks its worker processes after importing this module:
`aiolocks.sync` starts its background loop afresh in each child on first use. Redis is the
broker and the result backend (`REDIS_URL`, default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from _orders import RECORD_CHARGE
from celery import Celery

from aiolocks.sync import RedisMutex

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LOCK_TTL = float(os.environ.get("ORDER_LOCK_TTL", "10"))  # seconds; renewed while it runs
LOCK_WAIT = 30.0  # a task waits this long for the order (a web request may hold it)
PAYMENT_SECONDS = float(os.environ.get("PAYMENT_SECONDS", "0.5"))  # the slow gateway

app = Celery("celery_orders", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)

# One client per worker process: redis-py's sync pool reconnects by itself after the fork.
client = redis.Redis.from_url(REDIS_URL)


def pay(order_id: int) -> int:
    """The payment gateway (a stand-in, as the web example's): slow, returns cents."""
    time.sleep(PAYMENT_SECONDS)
    return 100 * order_id


@app.task(name="orders.charge")  # type: ignore[untyped-decorator]
def charge(order_id: int) -> dict[str, Any]:
    """Charge `order_id` once, under the order's lock, recording the charge with the fence."""
    with RedisMutex(client, f"orders:{order_id}", ttl=LOCK_TTL, timeout=LOCK_WAIT) as lock:
        fence = lock.fencing_token
        key = f"order:{order_id}"
        if client.hexists(key, "amount"):
            return {"order": order_id, "outcome": "already_charged", "amount": 0, "fence": fence}
        amount = pay(order_id)
        if not client.eval(RECORD_CHARGE, 1, key, fence, amount):  # type: ignore[arg-type]
            return {"order": order_id, "outcome": "stale_fence", "amount": 0, "fence": fence}
    return {"order": order_id, "outcome": "charged", "amount": amount, "fence": fence}
