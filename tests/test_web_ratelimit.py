"""The web integrations' rate limits: FastAPI's `request_limit` and aiohttp's
`rate_limited` / `limit_middleware`, against a real server. A refused request gets 429 with
`Retry-After` and the JSON body the lock refusals use; with `timeout=` it waits first.

No `from __future__ import annotations` here: the FastAPI endpoints are defined inside the
tests and FastAPI resolves their annotations at run time.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
import pytest
import redis.asyncio
from _web import ONE_SERVER
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from asgi_lifespan import LifespanManager
from fastapi import Depends, FastAPI

from aiolocks import Limit, RedisRateLimiter
from aiolocks.integrations import aiohttp as aiohttp_limits
from aiolocks.integrations.fastapi import Permit, request_limit


@asynccontextmanager
async def fastapi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as c:
            yield c


def fastapi_app(limit: Any) -> FastAPI:
    app = FastAPI()

    @app.get("/users/{user_id}")
    async def work(user_id: int, permit: Annotated[Permit, Depends(limit)]) -> dict[str, Any]:
        return {"user": user_id, "limit": permit.name}

    return app


def _check_refusal(status: int, headers: Any, body: dict[str, Any], name: str) -> None:
    assert status == 429
    assert body["error"] == "rate_limited" and body["lock"] == name, body
    assert "per 1 s" in body["message"], body
    retry_after = int(headers["Retry-After"])
    assert 1 <= retry_after <= 1, headers  # the next slot is 500 ms away: rounded up to 1


@ONE_SERVER
async def test_fastapi_answers_429_with_retry_after(r: redis.asyncio.Redis) -> None:
    app = fastapi_app(request_limit("api:{user_id}", rate=2, burst=2, client=r))
    async with fastapi_client(app) as c:
        assert [(await c.get("/users/7")).status_code for _ in range(2)] == [200, 200]
        refused = await c.get("/users/7")
        _check_refusal(refused.status_code, refused.headers, refused.json()["detail"], "api:7")
        assert (await c.get("/users/8")).status_code == 200  # another user, another name
    info = await RedisRateLimiter(r, "api:7", rate=2, burst=2).inspect()
    assert info.available == 0  # the refusal reserved nothing: the two grants only


@ONE_SERVER
async def test_fastapi_waits_up_to_its_timeout(r: redis.asyncio.Redis, url: str) -> None:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        client = redis.asyncio.Redis.from_url(url)
        yield {"redis": client}
        await client.aclose()

    limit = request_limit("api:{user_id}", rate=5, burst=1, timeout=0.5)
    app = fastapi_app(limit)
    app.router.lifespan_context = lifespan
    async with fastapi_client(app) as c:
        assert (await c.get("/users/1")).status_code == 200
        started = time.monotonic()
        assert (await c.get("/users/1")).status_code == 200  # waited ~200 ms for its slot
        assert time.monotonic() - started >= 0.15
        # three more at once: 200, 400 and 600 ms away; the last is past the timeout
        answers = await asyncio.gather(*(c.get("/users/1") for _ in range(3)))
        codes = sorted(answer.status_code for answer in answers)
        assert codes == [200, 200, 429], codes


def test_fastapi_bad_arguments_fail_when_the_app_is_built() -> None:
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        request_limit("api", rate=0)
    with pytest.raises(ValueError, match=r"cost must be in 1\.\.2"):
        request_limit("api", rate=2, burst=2, cost=3)
    with pytest.raises(ValueError, match="busy_status must be an HTTP status"):
        request_limit("api", rate=2, busy_status=200)
    with pytest.raises(ValueError, match="lock name template"):
        request_limit("api:{user}}", rate=2)


async def _aiohttp_handler(request: web.Request) -> web.Response:
    permit = aiohttp_limits.permit(request)
    return web.json_response({"limit": permit.name, "cost": permit.cost})


@ONE_SERVER
async def test_aiohttp_answers_429_with_retry_after(r: redis.asyncio.Redis) -> None:
    app = web.Application()
    app[aiohttp_limits.REDIS] = r
    decorate = aiohttp_limits.rate_limited("api:{user_id}", rate=2, burst=2)
    app.router.add_get("/users/{user_id}", decorate(_aiohttp_handler))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        for _ in range(2):
            granted = await c.get("/users/7")
            assert granted.status == 200 and (await granted.json())["limit"] == "api:7"
        refused = await c.get("/users/7")
        _check_refusal(refused.status, refused.headers, await refused.json(), "api:7")


@ONE_SERVER
async def test_aiohttp_middleware_waits_up_to_its_timeout(r: redis.asyncio.Redis) -> None:
    def name(request: web.Request) -> str | None:
        return f"ip:{request.remote}" if request.path.startswith("/api") else None

    middleware = aiohttp_limits.limit_middleware(name, rate=5, burst=1, timeout=0.3, client=r)
    app = web.Application(middlewares=[middleware])
    app.router.add_get("/api/x", _aiohttp_handler)
    app.router.add_get("/health", _free)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        assert (await c.get("/api/x")).status == 200
        started = time.monotonic()
        assert (await c.get("/api/x")).status == 200  # waited for its slot
        assert time.monotonic() - started >= 0.15
        codes = sorted([(await answer).status for answer in [c.get("/api/x"), c.get("/api/x")]])
        assert codes == [200, 200]  # one after the other: each within 300 ms
        both = await asyncio.gather(c.get("/api/x"), c.get("/api/x"))
        assert sorted(answer.status for answer in both) == [200, 429]
        health = [(await c.get("/health")).status for _ in range(5)]
        assert health == [200] * 5  # not limited


async def _free(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


TWO_LIMITS = [Limit(10, per=1.0, burst=2), Limit(3, per=60.0, burst=3)]


def _check_minute_refusal(status: int, headers: Any, body: dict[str, Any]) -> None:
    """Refused by the minute's limit (3 taken): Retry-After is its ~20 s, not the 100 ms
    of the second's."""
    assert status == 429, body
    assert "10 requests per 1 s and 3 requests per 60 s" in body["message"], body
    assert 15 <= int(headers["Retry-After"]) <= 20, headers


@ONE_SERVER
async def test_fastapi_several_limits_retry_after_from_the_one_that_binds(
    r: redis.asyncio.Redis,
) -> None:
    app = fastapi_app(request_limit("api:{user_id}", limits=TWO_LIMITS, timeout=0.5, client=r))
    async with fastapi_client(app) as c:
        assert [(await c.get("/users/7")).status_code for _ in range(3)] == [200] * 3
        refused = await c.get("/users/7")
        _check_minute_refusal(refused.status_code, refused.headers, refused.json()["detail"])


@ONE_SERVER
async def test_aiohttp_several_limits_retry_after_from_the_one_that_binds(
    r: redis.asyncio.Redis,
) -> None:
    middleware = aiohttp_limits.limit_middleware(
        lambda request: "api", limits=TWO_LIMITS, timeout=0.5, client=r
    )
    app = web.Application(middlewares=[middleware])
    app.router.add_get("/api/x", _aiohttp_handler)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        assert [(await c.get("/api/x")).status for _ in range(3)] == [200] * 3
        refused = await c.get("/api/x")
        _check_minute_refusal(refused.status, refused.headers, await refused.json())


def test_several_limits_and_rate_fail_when_the_app_is_built() -> None:
    with pytest.raises(ValueError, match="or limits=, not both"):
        request_limit("api", rate=1, limits=TWO_LIMITS)
    with pytest.raises(ValueError, match="or limits=, not both"):
        aiohttp_limits.rate_limited("api", rate=1, limits=TWO_LIMITS)
    with pytest.raises(ValueError, match=r"cost must be in 1\.\.2"):
        request_limit("api", limits=TWO_LIMITS, cost=3)


# Per-request limits: the tenant's plan chooses the limit; the tenant is in the name.
PLANS = {"free": Limit(2, per=60.0, burst=2), "paid": Limit(4, per=60.0, burst=4)}


def _plan_of(tenants: dict[str, str]) -> Any:
    async def limits(request: Any) -> Limit:  # FastAPI's or aiohttp's request
        return PLANS[tenants[request.match_info["tenant"]]]

    def fastapi_limits(request: Any) -> Limit:  # sync, FastAPI's path_params
        return PLANS[tenants[request.path_params["tenant"]]]

    return limits, fastapi_limits


@ONE_SERVER
async def test_fastapi_limits_per_request_by_the_tenants_plan(r: redis.asyncio.Redis) -> None:
    tenants = {"acme": "free", "bigco": "paid"}
    _, limits = _plan_of(tenants)
    app = FastAPI()

    @app.get("/t/{tenant}")
    async def work(
        tenant: str,
        permit: Annotated[
            Permit, Depends(request_limit("tenant:{tenant}", limits=limits, client=r))
        ],
    ) -> dict[str, Any]:
        return {"limit": permit.name, "rate": permit.limiter.limits[0].rate}

    async with fastapi_client(app) as c:
        acme = [(await c.get("/t/acme")).status_code for _ in range(3)]
        bigco = [(await c.get("/t/bigco")).status_code for _ in range(5)]
        assert acme == [200, 200, 429] and bigco == [200] * 4 + [429]
        assert (
            (await c.get("/t/acme"))
            .json()["detail"]["message"]
            .startswith("'tenant:acme' allows 2 requests per 60 s")
        )
        tenants["acme"] = "paid"  # the plan changed while the name is live: the answer is clear
        mismatch = await c.get("/t/acme")
        assert mismatch.status_code == 500, mismatch.text
        body = mismatch.json()["detail"]
        assert body["error"] == "limit_mismatch" and body["lock"] == "tenant:acme", body
    assert (
        await RedisRateLimiter(r, "tenant:acme", limits=[PLANS["free"]]).inspect()
    ).available == 0


@ONE_SERVER
async def test_aiohttp_limits_per_request_by_the_tenants_plan(r: redis.asyncio.Redis) -> None:
    tenants = {"acme": "free", "bigco": "paid"}
    limits, _ = _plan_of(tenants)
    app = web.Application()
    decorate = aiohttp_limits.rate_limited("tenant:{tenant}", limits=limits, client=r)
    app.router.add_get("/t/{tenant}", decorate(_aiohttp_handler))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        acme = [(await c.get("/t/acme")).status for _ in range(3)]
        bigco = [(await c.get("/t/bigco")).status for _ in range(5)]
        assert acme == [200, 200, 429] and bigco == [200] * 4 + [429]
        tenants["bigco"] = "free"
        mismatch = await c.get("/t/bigco")
        body = await mismatch.json()
        assert mismatch.status == 500 and body["error"] == "limit_mismatch", body
        assert "tenant:bigco" in body["message"], body


def test_per_request_limits_and_rate_fail_when_the_app_is_built() -> None:
    with pytest.raises(ValueError, match="or limits=, not both"):
        request_limit("api", rate=1, limits=lambda request: PLANS["free"])
    with pytest.raises(ValueError, match="or limits=, not both"):
        aiohttp_limits.limit_middleware(lambda request: "api", burst=2, limits=lambda r: [])


@ONE_SERVER
async def test_fastapi_reuses_one_limiter_per_name_and_still_limits(
    r: redis.asyncio.Redis,
) -> None:
    """Issue 44: `request_limit` built a `RedisRateLimiter` per request (1.49x a route with
    no limit). One is built per name (and limits) and reused; the limit holds as before, and
    one that adopted limits stored by `set_limits()` is replaced by a new one, as a limiter
    made per request would be."""
    app = FastAPI()

    @app.get("/users/{user_id}")
    async def work(
        user_id: int,
        permit: Annotated[
            Permit, Depends(request_limit("reuse:{user_id}", rate=3, burst=3, client=r))
        ],
    ) -> dict[str, Any]:
        limiter = permit.limiter
        return {"id": id(limiter), "rate": limiter.rate, "adopted": limiter._stamp != 0}

    async with fastapi_client(app) as c:
        seven = [await c.get("/users/7") for _ in range(4)]
        assert [answer.status_code for answer in seven] == [200, 200, 200, 429]
        assert len({answer.json()["id"] for answer in seven[:3]}) == 1  # one limiter for 7
        eight = (await c.get("/users/8")).json()
        assert eight["id"] != seven[0].json()["id"]  # another name, another limiter
        await RedisRateLimiter(r, "reuse:8", rate=3, burst=3).set_limits(rate=100, burst=100)
        adopting = (await c.get("/users/8")).json()
        assert adopting["id"] == eight["id"] and adopting["rate"] == 100 and adopting["adopted"]
        after = (await c.get("/users/8")).json()
        assert after["id"] != eight["id"] and after["rate"] == 100  # a new one, adopting anew


@ONE_SERVER
@pytest.mark.parametrize("name", ["", "a}b", "x" * 1025])
async def test_fastapi_a_name_the_limiter_rejects_answers_422_and_touches_nothing(
    r: redis.asyncio.Redis, name: str
) -> None:
    """The name is checked once, by the limiter made for it: what it refuses is the API
    client's 422 `lock_name_invalid`, and Redis is not written."""
    app = FastAPI()

    def chosen() -> str:
        return name

    limit = request_limit(chosen, rate=5, client=r)

    @app.post("/work")
    async def work(permit: Annotated[Permit, Depends(limit)]) -> None:
        raise AssertionError("not reached")

    async with fastapi_client(app) as client:
        response = await client.post("/work")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail["error"] == "lock_name_invalid" and detail["lock"] == name
    assert await r.dbsize() == 0
