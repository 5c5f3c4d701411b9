"""aiolocks.integrations.aiohttp: the decorator and the middleware, through aiohttp's test
client on 127.0.0.1 against a real server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio
from _probes import QueueProbe
from _web import ONE_SERVER, Gate, is_free, load_example
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import Tasks

from aiolocks import RedisMutex
from aiolocks.integrations.aiohttp import REDIS, held_lock, lock_middleware, locked
from aiolocks.testing import expire_leases

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def http(app: web.Application) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


class Finished:
    """An outer middleware: `done[path]` is set once the request is over, lock released."""

    def __init__(self) -> None:
        self.done: dict[str, asyncio.Event] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        done = self.done.setdefault(request.path, asyncio.Event())
        try:
            return await handler(request)
        finally:
            done.set()


def orders_app(
    gate: Gate, decorator: Callable[[Handler], Handler], **options: Any
) -> web.Application:
    app = web.Application(**options)

    async def work(request: web.Request) -> web.Response:
        order_id = int(request.match_info["order_id"])
        await gate.pass_through(order_id)
        held = held_lock(request)
        return web.json_response({"lock": held.name, "fence": held.fencing_token})

    app.router.add_post("/orders/{order_id}", decorator(work))
    return app


@ONE_SERVER
async def test_same_order_is_refused_while_other_orders_go_through(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    gate = Gate()
    app = orders_app(gate, locked("orders:{order_id}", client=r, busy_status=423))
    async with http(app) as client:
        first = tasks.start(client.post("/orders/1"))
        await gate.wait_entered(1)
        second = await client.post("/orders/1")
        assert second.status == 423
        body = await second.json()
        assert body["error"] == "lock_busy" and body["lock"] == "orders:1"

        other = tasks.start(client.post("/orders/2"))
        await gate.wait_entered(2)
        gate.opened[2].set()
        assert (await other).status == 200
        assert not first.done()
        gate.opened[1].set()
        response = await first
        assert response.status == 200 and (await response.json())["lock"] == "orders:1"
    assert await is_free(r, "orders:1") and await is_free(r, "orders:2")


@ONE_SERVER
async def test_a_waiting_request_goes_next(r: redis.asyncio.Redis, tasks: Tasks) -> None:
    gate = Gate()
    app = orders_app(gate, locked("orders:{order_id}", client=r, timeout=None))
    probe = QueueProbe(r, local=True)
    async with http(app) as client:
        first = tasks.start(client.post("/orders/7"))
        await gate.wait_entered(7)
        second = await tasks.queued(probe, client.post("/orders/7"))
        gate.opened[7].set()
        fences = [(await (await task).json())["fence"] for task in (first, second)]
    assert fences[0] < fences[1]
    assert await is_free(r, "orders:7")


@ONE_SERVER
async def test_a_lost_lease_cancels_the_handler_and_answers_500(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    gate = Gate()
    app = orders_app(gate, locked("orders:{order_id}", client=r, ttl=0.3))
    async with http(app) as client:
        request = tasks.start(client.post("/orders/5"))
        await gate.wait_entered(5)
        assert await expire_leases(RedisMutex(r, "orders:5")) == 1
        response = await asyncio.wait_for(request, 10)
        assert response.status == 500
        body = await response.json()
    assert body["error"] == "lock_lost" and body["lock"] == "orders:5"
    assert gate.cancelled == [5]
    assert await is_free(r, "orders:5")


@ONE_SERVER
async def test_a_client_that_goes_away_leaves_nothing_behind(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """The test server cancels the handler of a closed connection (handler_cancellation)."""
    gate = Gate()
    finished = Finished()
    lock = locked("orders:{order_id}", client=r, timeout=None)
    app = orders_app(gate, lock, middlewares=[finished.middleware])
    probe = QueueProbe(r, local=True)
    async with http(app) as client:
        holder = tasks.start(client.post("/orders/9"))
        await gate.wait_entered(9)
        waiter = await tasks.queued(probe, client.post("/orders/9"))
        for task in (waiter, holder):  # the client side closes the connection
            task.cancel()
        await asyncio.wait_for(finished.done["/orders/9"].wait(), 10)  # both are over
        await asyncio.gather(holder, waiter, return_exceptions=True)
    assert gate.cancelled == [9]  # the holder's handler was stopped
    assert await is_free(r, "orders:9")  # its lock released, the waiter withdrawn


@ONE_SERVER
async def test_the_middleware_and_the_app_key(
    r: redis.asyncio.Redis, tasks: Tasks, caplog: pytest.LogCaptureFixture
) -> None:
    gate = Gate()

    def tenant(request: web.Request) -> str | None:
        return request.headers.get("x-tenant") and f"tenants:{request.headers['x-tenant']}"

    app = orders_app(gate, lambda handler: handler, middlewares=[lock_middleware(tenant)])
    app[REDIS] = r
    async with http(app) as client:
        first = tasks.start(client.post("/orders/1", headers={"x-tenant": "acme"}))
        await gate.wait_entered(1)
        busy = await client.post("/orders/2", headers={"x-tenant": "acme"})
        assert (await busy.json())["lock"] == "tenants:acme"
        gate.opened[1].set()
        assert (await (await first).json())["lock"] == "tenants:acme"
        gate.opened[3].set()
        unlocked = await client.post("/orders/3")  # no tenant: no lock taken
        assert unlocked.status == 500  # so held_lock() in the handler raised
    assert await is_free(r, "tenants:acme")
    assert "holds no aiolocks lock" in caplog.text


@ONE_SERVER
async def test_names_from_the_query_string_and_bad_names(r: redis.asyncio.Redis) -> None:
    app = web.Application()

    @locked("reports:{kind}", client=r, query=("kind",))
    async def report(request: web.Request) -> web.Response:
        return web.Response(text=held_lock(request).name)

    app.router.add_get("/reports", report)
    async with http(app) as client:
        assert await (await client.get("/reports?kind=daily")).text() == "reports:daily"
        missing = await client.get("/reports")
        assert missing.status == 422 and (await missing.json())["error"] == "lock_name_incomplete"
        braces = await client.get("/reports", params={"kind": "{x}"})
        assert braces.status == 422 and (await braces.json())["error"] == "lock_name_invalid"


@ONE_SERVER
async def test_a_template_field_the_route_lacks_is_the_servers_error(
    r: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo (`{orderid}` on `/orders/{order_id}/charge`) is not a 422 blaming the API
    client, and `?orderid=999` does not choose the lock: the query string fills only the
    fields named in `query=`."""
    app = web.Application()

    @locked("orders:{orderid}", client=r)
    async def charge(request: web.Request) -> web.Response:
        return web.Response(text=held_lock(request).name)

    app.router.add_post("/orders/{order_id}/charge", charge)
    async with http(app) as client:
        for query in ("", "?orderid=999"):
            assert (await client.post(f"/orders/7/charge{query}")).status == 500
    assert "TemplateMismatch" in caplog.text
    assert "'orderid'" in caplog.text and "POST /orders/{order_id}/charge" in caplog.text
    assert "path parameter (order_id)" in caplog.text
    assert await is_free(r, "orders:999") and await is_free(r, "orders:7")


@pytest.mark.parametrize(
    ("query", "error"), [(("day",), ValueError), ("kind", TypeError)], ids=["unknown", "str"]
)
def test_query_names_fields_of_the_template(query: Any, error: type) -> None:
    with pytest.raises(error, match="query"):
        locked("reports:{kind}", query=query)


async def test_no_client_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    app = web.Application()

    @locked("x")
    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/", handler)
    async with http(app) as client:
        response = await client.get("/")
    assert response.status == 500
    assert "no Redis client" in caplog.text and "app[REDIS]" in caplog.text


@ONE_SERVER
async def test_the_example_app(
    r: redis.asyncio.Redis, url: str, tasks: Tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example("aiohttp_orders")
    monkeypatch.setenv("REDIS_URL", url)
    gate = Gate()

    class GatedGateway(example.PaymentGateway):  # type: ignore[name-defined,misc]
        async def charge(self, order_id: int) -> int:
            await gate.pass_through(order_id)
            return 100 * order_id

    app = example.make_app()
    app[example.GATEWAY] = GatedGateway()
    async with http(app) as client:
        first = tasks.start(client.post("/orders/42/charge"))
        await gate.wait_entered(42)
        double_click = await client.post("/orders/42/charge")
        assert double_click.status == 409
        assert (await double_click.json())["error"] == "lock_busy"
        shipping = tasks.start(client.post("/orders/42/ship"))
        gate.opened[42].set()
        charged = await (await first).json()
        assert charged == {"order": 42, "amount": 4200, "fence": charged["fence"]}
        shipped = await (await shipping).json()
        assert shipped["order"] == 42 and shipped["fence"] > charged["fence"]
        again = await client.post("/orders/42/charge")
        assert await again.json() == {"error": "already_charged", "order": 42}
    assert await is_free(r, "orders:42")
