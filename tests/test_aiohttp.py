"""aiolocks.integrations.aiohttp: the decorator and the middleware, through aiohttp's test
client on 127.0.0.1 against a real server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import redis.asyncio
from _probes import QueueProbe
from _web import ONE_SERVER, Gate, is_free, load_example, unreachable_client
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import Tasks

from aiolocks import RedisMutex, RedisRateLimiter, RedisSemaphore
from aiolocks.integrations.aiohttp import (
    REDIS,
    held_lock,
    lock_error_middleware,
    lock_middleware,
    locked,
)
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


@ONE_SERVER
@pytest.mark.parametrize("how", ["decorator", "middleware"])
async def test_a_loss_found_at_release_answers_500(
    r: redis.asyncio.Redis, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease ends between two renewals (a Redis restart, `aiolocks release --force`):
    only the release finds it, after the handler returned its 200; the client gets
    `lost_status`, never the 200, and the server logs no traceback."""
    app = web.Application()

    async def charge(request: web.Request) -> web.Response:
        held = held_lock(request)
        assert await expire_leases(RedisMutex(r, held.name)) == 1
        return web.json_response({"fence": held.fencing_token})

    name = "orders:{order_id}"
    if how == "decorator":
        app.router.add_post("/orders/{order_id}", locked(name, client=r, ttl=60)(charge))
    else:
        fill = lambda request: f"orders:{request.match_info['order_id']}"  # noqa: E731
        app.middlewares.append(lock_middleware(fill, client=r, ttl=60))
        app.router.add_post("/orders/{order_id}", charge)
    async with http(app) as client:
        response = await client.post("/orders/8")
        assert response.status == 500
        body = await response.json()
    assert body["error"] == "lock_lost" and body["lock"] == "orders:8"
    assert "Traceback" not in caplog.text
    assert await is_free(r, "orders:8")


@ONE_SERVER
@pytest.mark.parametrize("when", ["at release", "while streaming"])
async def test_a_loss_after_a_streamed_status_cuts_the_body_short(
    r: redis.asyncio.Redis, when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that streams its own response has sent its status when the loss is found:
    no second response is written into its body (which the client read as garbage); the
    connection is closed before the body's end, so the client sees an incomplete body."""
    app = web.Application()

    @locked("exports", client=r, ttl=60 if when == "at release" else 0.3)
    async def export(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"row 1\n")
        assert await expire_leases(RedisMutex(r, "exports")) == 1
        if when == "while streaming":
            await asyncio.wait_for(held_lock(request).lost.wait(), 10)
            await asyncio.sleep(10)  # cancelled at the loss
        return response

    app.router.add_get("/export", export)
    async with http(app) as client:
        response = await client.get("/export")
        assert response.status == 200  # sent before the loss was known
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert "lease on 'exports' was lost" in caplog.text and "Traceback" not in caplog.text
    assert await is_free(r, "exports")


@ONE_SERVER
async def test_lock_errors_inside_a_handler_answer_as_locked_and_rate_limited_do(
    r: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    down = unreachable_client()
    app = web.Application(middlewares=[lock_error_middleware])

    async def export(request: web.Request) -> web.Response:
        async with RedisSemaphore(down, "exports", limit=2):
            return web.Response(text="exported")

    async def held(request: web.Request) -> web.Response:
        async with RedisMutex(r, "held", timeout=0.05):
            return web.Response(text="done")

    async def limited(request: web.Request) -> web.Response:
        async with RedisRateLimiter(r, "api", rate=1, per=60, burst=1, timeout=0.05):
            return web.Response(text="let in")

    async def lost(request: web.Request) -> web.Response:
        async with RedisMutex(r, "lost", ttl=60) as mutex:
            assert await expire_leases(mutex) == 1
        return web.Response(text="unreachable")

    async def bug(request: web.Request) -> web.Response:
        await RedisMutex(r, "never-held").release()
        return web.Response(text="unreachable")

    for path, handler in [
        ("/exports", export),
        ("/held", held),
        ("/limited", limited),
        ("/lost", lost),
        ("/bug", bug),
    ]:
        app.router.add_post(path, handler)
    try:
        async with RedisMutex(r, "held"), http(app) as client:
            answers = {path: await client.post(path) for path in ("/exports", "/held")}
            assert (await client.post("/limited")).status == 200  # the one permit
            for path in ("/limited", "/lost", "/bug"):
                answers[path] = await client.post(path)
            bodies = {path: await answer.text() for path, answer in answers.items()}
    finally:
        await down.aclose()
    statuses = {path: answer.status for path, answer in answers.items()}
    assert statuses == {"/exports": 503, "/held": 409, "/limited": 429, "/lost": 500, "/bug": 500}
    errors = {path: json.loads(body)["error"] for path, body in bodies.items() if path != "/bug"}
    assert errors == {
        "/exports": "lock_unavailable",
        "/held": "lock_busy",
        "/limited": "rate_limited",
        "/lost": "lock_lost",
    }
    assert json.loads(bodies["/exports"])["lock"] == "exports"
    assert "Retry-After" not in answers["/held"].headers  # a holder may release any moment
    assert 55 <= int(answers["/limited"].headers["Retry-After"]) <= 60
    assert "LockNotOwned" in caplog.text  # a bug in the handler stays the server's 500
