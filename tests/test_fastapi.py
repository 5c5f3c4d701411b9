"""aiolocks.integrations.fastapi: one lock per order id, driven through httpx's ASGI
transport with concurrent requests against a real server.

No `from __future__ import annotations` here: the endpoints are defined inside the tests
and FastAPI resolves their annotations at run time.
"""

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
import pytest
import redis.asyncio
from _probes import QueueProbe
from _web import ONE_SERVER, Gate, is_free, load_example, unreachable_client
from asgi_lifespan import LifespanManager
from conftest import Tasks
from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from aiolocks import LockNotOwned, RedisMutex, RedisRateLimiter, RedisSemaphore
from aiolocks.integrations.fastapi import (
    HeldLock,
    TemplateMismatch,
    lock_error_handlers,
    request_lock,
)
from aiolocks.testing import expire_leases


@asynccontextmanager
async def http(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client calling `app` in-process, with its lifespan run around it."""
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://orders.test") as c:
            yield c


def orders_app(gate: Gate, lock: Callable[..., Any], **app_options: Any) -> FastAPI:
    """POST /orders/{order_id}: holds `lock` and waits at the gate for its order id."""
    app = FastAPI(**app_options)

    @app.post("/orders/{order_id}")
    async def work(order_id: int, held: Annotated[HeldLock, Depends(lock)]) -> dict[str, Any]:
        await gate.pass_through(order_id)
        return {"order": order_id, "lock": held.name, "fence": held.fencing_token}

    return app


@ONE_SERVER
@pytest.mark.parametrize("busy_status", [409, 423])
async def test_same_order_is_refused_while_other_orders_go_through(
    r: redis.asyncio.Redis, tasks: Tasks, busy_status: int
) -> None:
    gate = Gate()
    app = orders_app(gate, request_lock("orders:{order_id}", client=r, busy_status=busy_status))
    async with http(app) as client:
        first = tasks.start(client.post("/orders/1"))
        await gate.wait_entered(1)

        second = await client.post("/orders/1")
        assert second.status_code == busy_status
        detail = second.json()["detail"]
        assert detail["error"] == "lock_busy" and detail["lock"] == "orders:1"
        assert "orders:1" in detail["message"]

        other = tasks.start(client.post("/orders/2"))  # a different order: not held up
        await gate.wait_entered(2)
        gate.opened[2].set()
        assert (await other).status_code == 200
        assert not first.done()

        gate.opened[1].set()
        done = await first
        assert done.status_code == 200 and done.json()["lock"] == "orders:1"
    assert await is_free(r, "orders:1") and await is_free(r, "orders:2")


@ONE_SERVER
async def test_the_busy_answer_does_not_guess_who_holds_the_lock(r: redis.asyncio.Redis) -> None:
    # The holder is a script, not a request: the message says only what aiolocks knows.
    app = orders_app(Gate(), request_lock("orders:{order_id}", client=r))
    async with RedisMutex(r, "orders:13"), http(app) as client:
        busy = await client.post("/orders/13")
    assert busy.status_code == 409
    assert busy.json()["detail"]["message"] == "'orders:13' is held elsewhere; not acquired"


@ONE_SERVER
async def test_a_waiting_request_goes_next_in_order(r: redis.asyncio.Redis, tasks: Tasks) -> None:
    gate = Gate()
    app = orders_app(gate, request_lock("orders:{order_id}", client=r, timeout=None))
    probe = QueueProbe(r, local=True)
    async with http(app) as client:
        first = tasks.start(client.post("/orders/7"))
        await gate.wait_entered(7)
        second = await tasks.queued(probe, client.post("/orders/7"))
        assert not second.done()  # queued behind the first
        gate.opened[7].set()
        responses = [await first, await second]
    assert [response.status_code for response in responses] == [200, 200]
    fences = [response.json()["fence"] for response in responses]
    assert fences[0] < fences[1]
    assert await is_free(r, "orders:7")


@ONE_SERVER
async def test_a_request_that_waits_too_long_gets_the_busy_answer(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    gate = Gate()
    lock = request_lock("orders:{order_id}", client=r, timeout=0.2, busy_status=423)
    async with http(orders_app(gate, lock)) as client:
        first = tasks.start(client.post("/orders/3"))
        await gate.wait_entered(3)
        late = await client.post("/orders/3")
        assert late.status_code == 423
        assert late.json()["detail"]["error"] == "lock_busy"
        assert "0.2 s" in late.json()["detail"]["message"]
        gate.opened[3].set()
        assert (await first).status_code == 200
    assert await is_free(r, "orders:3")


@ONE_SERVER
async def test_a_lost_lease_cancels_the_handler_and_answers_500(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    gate = Gate()
    app = orders_app(gate, request_lock("orders:{order_id}", client=r, ttl=0.3))
    async with http(app) as client:
        request = tasks.start(client.post("/orders/5"))
        await gate.wait_entered(5)
        assert await expire_leases(RedisMutex(r, "orders:5")) == 1
        response = await asyncio.wait_for(request, 10)  # renewal notices within ttl/3
    assert response.status_code == 500
    detail = response.json()["detail"]
    assert detail["error"] == "lock_lost" and detail["lock"] == "orders:5"
    assert "overlapped" in detail["message"]
    assert gate.cancelled == [5]  # the handler was stopped, not left running
    assert await is_free(r, "orders:5")


@ONE_SERVER
@pytest.mark.parametrize("asked_before", [True, False])
async def test_held_lock_lost_is_one_event_set_at_a_loss(
    r: redis.asyncio.Redis, tasks: Tasks, asked_before: bool
) -> None:
    """`HeldLock.lost` is made when first asked for (most requests never ask): asked for
    while the request runs, or only after the loss, it is set, and the same event each
    time."""
    app = FastAPI()
    lock = request_lock("orders:{order_id}", client=r, ttl=0.3)
    entered = asyncio.Event()
    seen: list[tuple[HeldLock, asyncio.Event | None]] = []

    @app.post("/orders/{order_id}")
    async def charge(order_id: int, held: Annotated[HeldLock, Depends(lock)]) -> None:
        event = held.lost if asked_before else None
        assert event is None or not event.is_set()
        seen.append((held, event))
        entered.set()
        await asyncio.Event().wait()  # until the loss cancels it

    async with http(app) as client:
        request = tasks.start(client.post("/orders/6"))
        await asyncio.wait_for(entered.wait(), 10)
        assert await expire_leases(RedisMutex(r, "orders:6")) == 1
        response = await asyncio.wait_for(request, 10)  # renewal notices within ttl/3
    assert response.status_code == 500
    [(held, event)] = seen
    assert held.lost.is_set() and held.lost is held.lost
    assert event is None or event is held.lost


@ONE_SERVER
@pytest.mark.parametrize("name", ["", "a}b", "x" * 1025])
@pytest.mark.parametrize("limit", [None, 2])
async def test_a_name_the_lock_rejects_answers_422_and_touches_nothing(
    r: redis.asyncio.Redis, name: str, limit: int | None
) -> None:
    """A name from a name dependency is checked once, by the lock made for it: what the
    lock refuses is the API client's 422 `lock_name_invalid`, and Redis is not written."""
    app = FastAPI()

    def chosen() -> str:
        return name

    @app.post("/work")
    async def work(held: Annotated[HeldLock, Depends(request_lock(chosen, limit=limit))]) -> None:
        raise AssertionError("not reached")

    app.state.redis = r
    async with http(app) as client:
        response = await client.post("/work")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail["error"] == "lock_name_invalid" and detail["lock"] == name
    assert "name" in detail["message"]
    assert await r.dbsize() == 0


@ONE_SERVER
async def test_cancelled_requests_leave_nothing_behind(
    r: redis.asyncio.Redis, tasks: Tasks
) -> None:
    """A client that goes away (its request task cancelled), holding or waiting."""
    gate = Gate()
    app = orders_app(gate, request_lock("orders:{order_id}", client=r, timeout=None))
    probe = QueueProbe(r, local=True)
    async with http(app) as client:
        holder = tasks.start(client.post("/orders/9"))
        await gate.wait_entered(9)
        waiter = await tasks.queued(probe, client.post("/orders/9"))
        waiter.cancel()
        holder.cancel()
        for task in (waiter, holder):
            with pytest.raises(asyncio.CancelledError):
                await task
    assert gate.cancelled == [9]
    assert await is_free(r, "orders:9")


@ONE_SERVER
async def test_the_client_comes_from_the_lifespan_state_or_app_state(
    r: redis.asyncio.Redis, url: str
) -> None:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        client = redis.asyncio.Redis.from_url(url)
        yield {"redis": client}
        await client.aclose()

    gate = Gate()
    gate.opened[1].set()
    async with http(orders_app(gate, request_lock("a:{order_id}"), lifespan=lifespan)) as c:
        assert (await c.post("/orders/1")).json()["lock"] == "a:1"

    app = orders_app(gate, request_lock("b:{order_id}", state_key="locks"))
    app.state.locks = r
    async with http(app) as c:
        assert (await c.post("/orders/1")).json()["lock"] == "b:1"
    assert (await RedisMutex(r, "b:1").inspect()).fence > 0  # it was this server

    async with http(orders_app(gate, request_lock("c:{order_id}"))) as c:
        with pytest.raises(RuntimeError, match=r"no Redis client.*lifespan.*app\.state\.redis"):
            await c.post("/orders/1")


@ONE_SERVER
async def test_names_from_the_query_string_a_body_or_a_callable(r: redis.asyncio.Redis) -> None:
    class Order(BaseModel):
        customer: str
        amount: int

    def by_customer(order: Order) -> str:
        return f"customers:{order.customer}"

    async def by_header(request: Request) -> str:
        return f"tenants:{request.headers['x-tenant']}"

    app = FastAPI()
    query_lock = request_lock("reports:{kind}", client=r)
    body_lock = request_lock(by_customer, client=r)
    header_lock = request_lock(by_header, client=r)

    @app.get("/reports")
    async def report(kind: str, held: Annotated[HeldLock, Depends(query_lock)]) -> str:
        return held.name

    @app.post("/orders")
    async def order(order: Order, held: Annotated[HeldLock, Depends(body_lock)]) -> str:
        return f"{held.name} {order.amount}"

    @app.get("/tenant")
    async def tenant(held: Annotated[HeldLock, Depends(header_lock)]) -> str:
        return held.name

    async with http(app) as client:
        assert (await client.get("/reports?kind=daily")).json() == "reports:daily"
        missing = await client.get("/reports")
        assert missing.status_code == 422
        placed = await client.post("/orders", json={"customer": "ada", "amount": 3})
        assert placed.json() == "customers:ada 3"
        tenant_response = await client.get("/tenant", headers={"x-tenant": "acme"})
        assert tenant_response.json() == "tenants:acme"
        braces = await client.get("/reports", params={"kind": "{x}"})
        assert braces.status_code == 422
        assert braces.json()["detail"]["error"] == "lock_name_invalid"


@ONE_SERVER
async def test_a_template_field_the_route_lacks_is_the_servers_error(
    r: redis.asyncio.Redis,
) -> None:
    """A typo (`{orderid}` on `/orders/{order_id}/charge`): not a 422 blaming the API
    client, and a client's `?orderid=999` does not choose the lock."""
    app = FastAPI()
    typo = request_lock("orders:{orderid}", client=r)

    @app.post("/orders/{order_id}/charge")
    async def charge(order_id: int, held: Annotated[HeldLock, Depends(typo)]) -> str:
        return held.name

    async with http(app) as client:
        for query in ("", "?orderid=999"):
            with pytest.raises(TemplateMismatch) as raised:
                await client.post(f"/orders/7/charge{query}")
            message = str(raised.value)
            assert "'orderid'" in message and "POST /orders/{order_id}/charge" in message
            assert "path parameter (order_id)" in message
            assert "declared query parameter (none)" in message
    assert await is_free(r, "orders:999") and await is_free(r, "orders:7")


@ONE_SERVER
async def test_the_query_string_fills_only_declared_query_parameters(
    r: redis.asyncio.Redis,
) -> None:
    app = FastAPI()
    lock = request_lock("reports:{kind}:{day}", client=r)

    @app.get("/reports/{kind}")
    async def declared(kind: str, day: str, held: Annotated[HeldLock, Depends(lock)]) -> str:
        return held.name

    @app.get("/other/{kind}")
    async def undeclared(kind: str, held: Annotated[HeldLock, Depends(lock)]) -> str:
        return held.name

    async with http(app) as client:
        answer = await client.get("/reports/daily", params={"day": "mon", "kind": "x"})
        assert answer.json() == "reports:daily:mon"  # the path wins over the query string
        with pytest.raises(TemplateMismatch, match=r"'day'.*GET /other/\{kind\}"):
            await client.get("/other/daily", params={"day": "mon"})


@ONE_SERVER
async def test_a_semaphore_lets_limit_requests_in(r: redis.asyncio.Redis, tasks: Tasks) -> None:
    gate = Gate()
    app = orders_app(gate, request_lock("exports", client=r, limit=2))
    async with http(app) as client:
        running = [tasks.start(client.post(f"/orders/{i}")) for i in (1, 2)]
        for i in (1, 2):
            await gate.wait_entered(i)
        third = await client.post("/orders/3")
        assert third.status_code == 409 and third.json()["detail"]["lock"] == "exports"
        message = third.json()["detail"]["message"]
        assert message == "'exports' has all 2 of its slots held; not acquired"
        for i in (1, 2):
            gate.opened[i].set()
        assert [(await task).status_code for task in running] == [200, 200]
    assert (await RedisSemaphore(r, "exports", limit=2).inspect()).holders == 0


@ONE_SERVER
@pytest.mark.parametrize("scope", [None, "request", "function"])
async def test_a_loss_found_at_release_answers_500_whatever_the_scope(
    r: redis.asyncio.Redis, scope: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lease ends between two renewals (a Redis restart, `aiolocks release --force`):
    only the release finds it. With FastAPI's default scope "request" the dependency's
    exit used to run after a 200 had been sent, with a traceback in the server's log."""
    app = FastAPI()
    lock = request_lock("orders:{order_id}", client=r, ttl=60)  # no renewal in the test
    depends = Depends(lock) if scope is None else Depends(lock, scope=scope)

    @app.post("/orders/{order_id}")
    async def charge(order_id: int, held: Annotated[HeldLock, depends]) -> int:
        assert await expire_leases(RedisMutex(r, held.name)) == 1
        return held.fencing_token

    async with http(app) as client:
        response = await client.post("/orders/8")
    assert response.status_code == 500
    assert response.json()["detail"]["error"] == "lock_lost"
    assert "Traceback" not in capsys.readouterr().err
    assert await is_free(r, "orders:8")


@ONE_SERVER
@pytest.mark.parametrize("scope", [None, "request", "function"])
async def test_the_lock_is_released_before_the_response_whatever_the_scope(
    r: redis.asyncio.Redis, scope: Any
) -> None:
    """A streamed body runs after the release (so a loss can still change the status);
    a lock held inside the body's generator covers the body."""
    app = FastAPI()
    lock = request_lock("stream", client=r)
    depends = Depends(lock) if scope is None else Depends(lock, scope=scope)

    @app.get("/stream")
    async def stream(held: Annotated[HeldLock, depends]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            yield f"{await RedisMutex(r, 'stream').locked()}"
            async with RedisMutex(r, "stream-body"):
                yield f" {await RedisMutex(r, 'stream-body').locked()}"

        return StreamingResponse(body())

    async with http(app) as client:
        assert (await client.get("/stream")).text == "False True"
    assert await is_free(r, "stream") and await is_free(r, "stream-body")


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"ttl": 0}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"limit": 0}, ValueError),
        ({"busy_status": 200}, ValueError),
        ({"lost_status": 409}, ValueError),  # a lost lease is the server's failure: 5xx
        ({"busy_status": "409"}, TypeError),
        ({"client": "redis://localhost"}, TypeError),
        ({"state_key": "not a name"}, ValueError),
    ],
)
def test_bad_arguments_fail_when_the_app_is_built(options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        request_lock("orders:{order_id}", **options)


@pytest.mark.parametrize("template", ["", "orders:{}", "orders:{id!r}", "orders:{{id}}", "o:{"])
def test_bad_templates_fail_when_the_app_is_built(template: str) -> None:
    with pytest.raises(ValueError, match="lock name template"):
        request_lock(template)


class GatedGateway:
    """The example's payment gateway, held at the gate until the test opens it."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def charge(self, order_id: int) -> int:
        await self.gate.pass_through(order_id)
        return 100 * order_id


@ONE_SERVER
async def test_the_example_app(
    r: redis.asyncio.Redis, url: str, tasks: Tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = load_example("fastapi_orders")
    monkeypatch.setenv("REDIS_URL", url)
    gate = Gate()
    example.app.dependency_overrides[example.gateway] = lambda: GatedGateway(gate)
    async with http(example.app) as client:
        first = tasks.start(client.post("/orders/42/charge"))
        await gate.wait_entered(42)
        double_click = await client.post("/orders/42/charge")
        assert double_click.status_code == 409
        assert double_click.json()["detail"]["error"] == "lock_busy"
        shipping = tasks.start(client.post("/orders/42/ship"))  # waits up to SHIP_WAIT
        gate.opened[42].set()
        charged = await first
        assert charged.status_code == 200
        fence = charged.json()["fence"]
        assert charged.json() == {"order": 42, "amount": 4200, "fence": fence}
        shipped = (await shipping).json()
        assert shipped["order"] == 42 and shipped["fence"] > fence
        again = await client.post("/orders/42/charge")  # later: the record says no
        assert again.json()["detail"] == {"error": "already_charged", "order": 42}
    assert await r.hgetall("order:42") == {b"fence": str(fence).encode(), b"amount": b"4200"}
    assert await is_free(r, "orders:42")


@ONE_SERVER
async def test_the_example_app_takes_no_lock_for_an_invalid_order_id(
    r: redis.asyncio.Redis, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`POST /orders/xyz/charge` fails validation (422) and leaves nothing in Redis: the
    lock is named from the validated id, so no lock is taken for it (issue 14)."""
    example = load_example("fastapi_orders")
    monkeypatch.setenv("REDIS_URL", url)
    async with http(example.app) as client:
        for path in ("/orders/xyz/charge", "/orders/xyz/ship"):
            assert (await client.post(path)).status_code == 422
    assert [key async for key in r.scan_iter("aiolocks:*")] == []


async def test_the_example_app_starts_its_own_server(monkeypatch: pytest.MonkeyPatch) -> None:
    example = load_example("fastapi_orders")
    monkeypatch.delenv("REDIS_URL", raising=False)
    async with http(example.app) as client:
        shipped = (await client.post("/orders/1/ship")).json()
        assert shipped["order"] == 1 and shipped["fence"] > 0


def test_import_aiolocks_needs_no_web_framework() -> None:
    """The integrations are imported only when asked for, so the core installs alone."""
    code = (
        "import sys, aiolocks, aiolocks.integrations\n"
        "print(sorted({'fastapi', 'aiohttp', 'starlette', 'pytest'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


async def test_an_unreachable_redis_answers_503() -> None:
    client = unreachable_client()
    try:
        gate = Gate()
        async with http(orders_app(gate, request_lock("orders:{order_id}", client=client))) as c:
            response = await c.post("/orders/1")
    finally:
        await client.aclose()
    assert response.status_code == 503
    assert response.json()["detail"]["error"] == "lock_unavailable"
    assert not gate.entered[1].is_set()


@ONE_SERVER
async def test_lock_errors_inside_an_endpoint_answer_as_request_lock_and_limit_do(
    r: redis.asyncio.Redis,
) -> None:
    down = unreachable_client()
    app = FastAPI(exception_handlers=lock_error_handlers)

    @app.post("/exports")
    async def export() -> str:
        async with RedisSemaphore(down, "exports", limit=2):
            return "exported"

    @app.post("/held")
    async def held() -> str:
        async with RedisMutex(r, "held", timeout=0.05):
            return "done"

    @app.post("/bug")
    async def bug() -> str:
        await RedisMutex(r, "never-held").release()
        return "unreachable"

    @app.post("/limited")
    async def limited() -> str:
        async with RedisRateLimiter(r, "api", rate=1, per=60, burst=1, timeout=0.05):
            return "let in"

    try:
        async with RedisMutex(r, "held"), http(app) as client:
            unavailable = await client.post("/exports")
            busy = await client.post("/held")
            assert (await client.post("/limited")).status_code == 200  # the one permit
            rate_limited = await client.post("/limited")
            with pytest.raises(LockNotOwned):  # a bug in the endpoint stays the server's 500
                await client.post("/bug")
    finally:
        await down.aclose()
    assert unavailable.status_code == 503
    assert unavailable.json()["detail"]["error"] == "lock_unavailable"
    assert unavailable.json()["detail"]["lock"] == "exports"
    assert busy.status_code == 409 and busy.json()["detail"]["error"] == "lock_busy"
    assert "retry-after" not in busy.headers  # a holder may release any moment
    # a rate limiter's timeout: no slot for ~60 s, said as a 429 with when to come back
    assert rate_limited.status_code == 429, rate_limited.text
    assert rate_limited.json()["detail"]["error"] == "rate_limited"
    assert rate_limited.json()["detail"]["lock"] == "api"
    assert 55 <= int(rate_limited.headers["retry-after"]) <= 60


def test_the_loop_ends_at_once_after_an_unreachable_redis_answered_503() -> None:
    """The request's acquire could not reach Redis, so its clean-up goes on retrying in the
    background; when the loop ends (`asyncio.run()` cancels it), it stops at once, even when
    the cancellation meets the call and comes out of redis-py as a connection error. Before,
    the loop's end waited out the clean-up's whole bound (max(5 s, ttl): 29 s here)."""

    async def program() -> int:
        client = unreachable_client()
        try:
            app = orders_app(Gate(), request_lock("orders:{order_id}", client=client))
            async with http(app) as c:
                response = await c.post("/orders/1")
        finally:
            await client.aclose()
        return response.status_code

    started = time.monotonic()
    assert asyncio.run(program()) == 503
    took = time.monotonic() - started
    assert took < 5.0, f"the loop's end waited {took:.1f} s for a cancelled clean-up"
