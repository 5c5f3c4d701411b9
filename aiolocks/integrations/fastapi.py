"""FastAPI: a dependency that holds a lock for the duration of a request, and one that
lets requests in within a rate limit (`request_limit`, answering 429 with `Retry-After`).

    order_lock = request_lock("orders:{order_id}")          # one lock per order id

    @app.post("/orders/{order_id}/charge")
    async def charge(order_id: int, lock: Annotated[HeldLock, Depends(order_lock)]):
        ...  # only one request per order id gets here at a time; lock.fencing_token

The lock is taken before the endpoint runs and released as soon as the endpoint returns,
before the response is sent, whatever scope `Depends(...)` is given: a lost lease, noticed
while the endpoint runs (which cancels it) or only at release, answers `lost_status` (500)
with a JSON body, like `LockLost` from `async with`; never a 2xx. A streamed body is sent
after the release: hold a lock across it inside the body's generator.

This module imports FastAPI: install the `fastapi` extra. (No `from __future__ import
annotations` here: FastAPI reads the dependency signatures at run time.)
"""

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from inspect import Parameter, Signature
from typing import Annotated, Any, TypeVar, Unpack

import redis.asyncio
from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from .._base._clients import ensure_async_client
from .._base._errors import LockError
from ._hold import (
    Answer,
    HeldLock,
    LockOptions,
    LockPolicy,
    NameTemplate,
    Refusal,
    TemplateMismatch,
    refusal_for,
)
from ._limit import LimitOptions, LimitPolicy, Permit

__all__ = [
    "HeldLock",
    "Permit",
    "TemplateMismatch",
    "lock_error_handlers",
    "request_limit",
    "request_lock",
]

T = TypeVar("T")

NameDependency = Callable[..., str] | Callable[..., Awaitable[str]]


def request_lock(
    name: str | NameDependency,
    *,
    client: redis.asyncio.Redis | None = None,
    state_key: str = "redis",
    **options: Unpack[LockOptions],
) -> Callable[..., Awaitable[HeldLock]]:
    """A FastAPI dependency (use it with `Depends`) that holds a lock for each request.

    - `name`: a template such as `"orders:{order_id}"` whose fields come from the route's
      path parameters, or from the query string for a field the route declares as a query
      parameter (as sent, before validation); a field that is neither raises
      `TemplateMismatch` (naming both) on the route's first request. Or any FastAPI
      dependency returning the name, which may take validated path, query or body
      parameters, or `request: Request`.
    - `ttl`: the lease in seconds (30), renewed in the background while the request runs.
    - `timeout`: 0 (the default) answers `busy_status` at once when the lock is held;
      a number of seconds waits that long first; None waits as long as it takes.
    - `busy_status`: 409 (Conflict, the default) or e.g. 423 (Locked), with the JSON body
      `{"detail": {"error": "lock_busy", "lock": NAME, "message": ...}}`.
    - `lost_status`: the 5xx answered, with `"error": "lock_lost"`, when the lease is lost
      during the request (the work may have overlapped another holder's). Redis
      unreachable: 503 with `"error": "lock_unavailable"`.
    - `limit`: None for a `RedisMutex`; N for a `RedisSemaphore` letting N requests in.
    - `prefix`: the key prefix, as for the primitives.
    - The Redis client: `client` if given, else the `state_key` entry of the lifespan
      state (`yield {"redis": client}` from the lifespan), else `app.state.<state_key>`.

    The dependency yields a `HeldLock` (name, fencing token, `lost` event, the lock).
    Arguments are checked here, when the app is built.
    """
    return _dependency(name, client, state_key, hold=LockPolicy(**options).hold)


def request_limit(
    name: str | NameDependency,
    *,
    rate: float | None = None,
    client: redis.asyncio.Redis | None = None,
    state_key: str = "redis",
    **options: Unpack[LimitOptions],
) -> Callable[..., Awaitable[Permit]]:
    """A FastAPI dependency (use it with `Depends`) that lets each request in only within a
    `RedisRateLimiter`'s limit: at most `rate` requests per `per` seconds for the name, at
    most `burst` at once (without `burst`: at most `rate` in any window of `per`), across
    every process.

    - `name`, `client`, `state_key`, `prefix`: as for `request_lock` (a template such as
      `"api:{user_id}"`, or a dependency returning the name).
    - `timeout`: 0 (the default) refuses at once when no slot is free now; a number of
      seconds waits for a slot up to that long first (a slot later than that is refused
      at once, reserving nothing); None waits for it whenever it comes.
    - `busy_status`: 429 (the default), with a `Retry-After` header (seconds until the slot,
      rounded up) and the JSON body `{"detail": {"error": "rate_limited", "lock": NAME,
      "message": ...}}`. Redis unreachable: 503 with `"error": "lock_unavailable"`.
    - `cost`: the permits each request takes (1).
    - `limits`: `[Limit(...), ...]` for several limits, or a function of the `Request`
      (sync or async) returning the request's `Limit`(s), e.g. by the tenant's plan, so
      free and paid tenants share one dependency. A name keeps one set of limits while
      live: put the tenant in the name; a request whose limits differ from its name's
      live ones is answered 500 with `"error": "limit_mismatch"`.

    The dependency yields a `Permit` (name, cost, the limiter). Arguments are checked here,
    when the app is built.
    """
    return _dependency(name, client, state_key, take=LimitPolicy(rate, **options).take)


def _dependency(
    name: str | NameDependency,
    client: redis.asyncio.Redis | None,
    state_key: str,
    *,
    hold: Callable[[Any, str, Request, Answer], AbstractAsyncContextManager[T]] | None = None,
    take: Callable[[Any, str, Request, Answer], Awaitable[T]] | None = None,
) -> Callable[..., Awaitable[T]]:
    """The dependency holding `hold(client, name, request)` around each request's
    endpoint, or awaiting `take(client, name, request)` before it (nothing to release)."""
    if client is not None:
        ensure_async_client(client)  # TypeError, naming what is accepted
    if not isinstance(state_key, str) or not state_key.isidentifier():
        raise ValueError(f"state_key must be an identifier, got {state_key!r}")
    request_parameter = Parameter("request", Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)
    name_of: Callable[[Request], str] | None = None
    if isinstance(name, str):
        name_of = _from_template(NameTemplate(name))
        parameters = [request_parameter]
    elif callable(name):
        name_parameter = Parameter(
            "lock_name", Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[str, Depends(name)]
        )
        parameters = [request_parameter, name_parameter]
    else:
        raise TypeError(f"name must be a str template or a callable, not {type(name).__name__}")

    # One plain dependency, one coroutine (no generator, no sub-dependency for a template's
    # name, no wrapper: each level costs every request). The holding goes on the exit
    # stack FastAPI keeps for scope-"function" dependencies, so whatever scope the user's
    # `Depends(...)` gives, it ends when the endpoint returns, before the response exists:
    # a loss found at release still answers `lost_status`. Its refusals, entering or at
    # the release, are raised as HTTPException (`_http`).
    async def held(request: Request, lock_name: str = "") -> T:
        if name_of is not None:
            lock_name = name_of(request)
        redis_client = client if client is not None else _client_of(request, state_key)
        if hold is None:
            assert take is not None
            return await take(redis_client, lock_name, request, _http)
        stack = request.scope.get("fastapi_function_astack")
        if stack is None:
            raise RuntimeError(
                "aiolocks' request dependencies need FastAPI 0.121 or later (its "
                "scope-'function' exit stack was not found in the request scope)"
            )
        holding = hold(redis_client, lock_name, request, _http)
        entered = await holding.__aenter__()
        stack.push_async_exit(holding)
        return entered

    # What FastAPI reads: `request`, and a name dependency's result as `lock_name` (a
    # template fills the name itself: no `lock_name` query parameter).
    held.__signature__ = Signature(parameters)  # type: ignore[attr-defined]
    return held


def _http(refusal: Refusal) -> Exception:
    return HTTPException(refusal.status, detail=refusal.body, headers=refusal.headers)


def _from_template(template: NameTemplate) -> Callable[[Request], str]:
    # Per route: the template's fields taken from the query string (those the route
    # declares as query parameters); checked on the route's first request.
    query_fields: dict[int, tuple[object, frozenset[str]]] = {}

    def lock_name(request: Request) -> str:
        route = request.scope.get("route")
        known = query_fields.get(id(route))
        if known is None or known[0] is not route:
            known = route, _query_fields(template, route)
            query_fields[id(route)] = known
        from_query: Mapping[str, str] = {}
        if known[1]:  # parsing the query string is a cost of its own
            query = request.query_params
            from_query = {field: query[field] for field in known[1] if field in query}
        try:
            return template.fill(request.scope.get("path_params", {}), from_query)
        except Refusal as refusal:
            raise _http(refusal) from None

    return lock_name


def _query_fields(template: NameTemplate, route: object) -> frozenset[str]:
    """The fields of `template` that `route` declares as query parameters; raises
    `TemplateMismatch` if a field is neither that nor a path parameter."""
    if not isinstance(route, APIRoute):  # not a FastAPI route: the path only
        return frozenset()
    query: set[str] = set()
    dependants = [route.dependant]
    while dependants:
        dependant = dependants.pop()
        query.update(field.alias for field in dependant.query_params)
        dependants.extend(dependant.dependencies)
    path = set(route.param_convertors)
    label = f"{' '.join(sorted(route.methods or ()))} {route.path}".strip()
    template.check(label, path, query)
    return frozenset(field for field in template.fields if field not in path)


def _client_of(request: Request, key: str) -> Any:
    # The lifespan state (what `request.state` wraps: read here without making its
    # State object), then app.state.
    found = request.scope.get("state", {}).get(key)
    if found is None:
        found = getattr(request.app.state, key, None)
    if found is not None:
        return found
    raise RuntimeError(
        f"aiolocks found no Redis client for the request lock: yield {{{key!r}: client}} "
        f"from the app's lifespan, set app.state.{key}, or pass client= to request_lock()"
    )


async def _answer_lock_error(request: Request, error: Exception) -> Response:
    refusal = refusal_for(error) if isinstance(error, LockError) else None
    if refusal is None:  # a bug in the endpoint (LockNotOwned...): the server's 500
        raise error
    return JSONResponse({"detail": refusal.body}, refusal.status, refusal.headers)


# aiolocks' errors raised by code inside an endpoint (a semaphore, a rate limiter, a lock
# used by hand), answered as `request_lock` and `request_limit` answer them:
# `ServerUnavailable` and `AccessDenied` 503 `lock_unavailable`, a rate limiter's
# `LockTimeout` 429 `rate_limited` with `Retry-After`, a lock's `LockTimeout` 409
# `lock_busy`, `LockLost` 500 `lock_lost`. `FastAPI(exception_handlers=lock_error_handlers)`.
lock_error_handlers: dict[
    int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]
] = {LockError: _answer_lock_error}
