"""aiohttp.web: hold a lock for the duration of a request, per handler or by middleware;
or let requests in within a rate limit (`rate_limited`, `limit_middleware`: 429 with
`Retry-After`).

    app[REDIS] = client                        # e.g. in a cleanup_ctx

    @routes.post("/orders/{order_id}/charge")
    @locked("orders:{order_id}")               # one request per order id at a time
    async def charge(request: web.Request) -> web.Response:
        lock = held_lock(request)              # lock.fencing_token for your storage
        ...

The lock is taken before the handler runs and released when it returns, before aiohttp
sends the returned response (a handler that streams a `StreamResponse` itself holds it
while streaming). A lost lease cancels the handler and answers `lost_status` (500) with a
JSON body. A cancelled handler (the client went away, with aiohttp's
`handler_cancellation` on) withdraws from the queue or releases the lock.

This module imports aiohttp: install the `aiohttp` extra.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Collection
from contextlib import AbstractAsyncContextManager
from typing import Any, Unpack, cast

import redis.asyncio
from aiohttp import web

from .._base._clients import AnyRedis, ensure_async_client
from .._base._errors import LockError
from ._hold import (
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
    "REDIS",
    "HeldLock",
    "Permit",
    "TemplateMismatch",
    "held_lock",
    "limit_middleware",
    "lock_error_middleware",
    "lock_middleware",
    "locked",
    "permit",
    "rate_limited",
]

log = logging.getLogger("aiolocks")

REDIS = web.AppKey("aiolocks_redis", redis.asyncio.Redis)
"""Where the integration finds the Redis client: `app[REDIS]` (parent apps included)."""

# aiohttp 3.14 warns about plain str keys in the request; older versions lack RequestKey.
_HELD: Any = (
    web.RequestKey("aiolocks_held", HeldLock) if hasattr(web, "RequestKey") else "aiolocks_held"
)
_PERMIT: Any = (
    web.RequestKey("aiolocks_permit", Permit) if hasattr(web, "RequestKey") else "aiolocks_permit"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NameFunction = Callable[[web.Request], str | Awaitable[str | None] | None]


class _Locker:
    """Runs a handler holding its request's lock (or permits: `hold`, stored in the request
    under `key`); what the decorators and middlewares share."""

    def __init__(
        self,
        name: str | NameFunction,
        client: AnyRedis | None,
        *,
        hold: Callable[[Any, str, web.Request], AbstractAsyncContextManager[object]] | None = None,
        take: Callable[[Any, str, web.Request], Awaitable[object]] | None = None,
        key: Any = _HELD,
        query: Collection[str] = (),
    ) -> None:
        if isinstance(name, str):
            name = _template_function(NameTemplate(name), query)
        elif query:
            raise TypeError("query= names fields of a str template; the name is a function")
        elif not callable(name):
            raise TypeError(f"name must be a str template or a callable, not {type(name).__name__}")
        if client is not None:
            ensure_async_client(client)
        self.name_of = name
        self.hold = hold
        self.take = take
        self.client = client
        self.key = key

    async def run(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            name = self.name_of(request)
            if inspect.isawaitable(name):
                name = await name
            if name is None:
                return await handler(request)
            client = self.client if self.client is not None else _client_of(request)
            if self.hold is None:  # permits: nothing to release after the handler
                assert self.take is not None
                request[self.key] = await self.take(client, name, request)
                return await handler(request)
            async with self.hold(client, name, request) as held:
                request[self.key] = held
                return await handler(request)
        except Refusal as refusal:
            return _answer(request, refusal)
        raise AssertionError("unreachable: a lease loss always ends in a Refusal")


def _answer(request: web.Request, refusal: Refusal) -> web.StreamResponse:
    """The refusal's JSON answer; or, when the handler streamed a response of its own and
    bytes of it went out (so its status too), the connection closed before the body's end:
    a second response written there would be read as the first one's body."""
    answer = web.json_response(refusal.body, status=refusal.status, headers=refusal.headers)
    if request.writer.output_size > 0:
        log.warning("aiolocks: %s; its response had started: connection closed", refusal)
        if request.transport is not None:
            request.transport.close()
        # aiohttp's writing of `answer` then meets the closed connection: no traceback.
    return answer


def locked(
    name: str | NameFunction,
    *,
    client: AnyRedis | None = None,
    query: Collection[str] = (),
    **options: Unpack[LockOptions],
) -> Callable[[Handler], Handler]:
    """Decorate a handler so that each request runs holding the lock `name`.

    `name` is a template such as `"orders:{order_id}"` whose fields come from the route's
    match info, or from the query string for the fields named in `query` (only those: a
    field that is neither raises `TemplateMismatch`, naming both, on the route's first
    request); or a function of the request returning the name (sync or async). The other
    options are those of `lock_middleware`.
    """
    return _decorator(_Locker(name, client, hold=LockPolicy(**options).hold, query=query))


def rate_limited(
    name: str | NameFunction,
    *,
    rate: float | None = None,
    client: AnyRedis | None = None,
    query: Collection[str] = (),
    **options: Unpack[LimitOptions],
) -> Callable[[Handler], Handler]:
    """Decorate a handler so that each request runs only within the rate limit `name`.

    `name` (and `query`) as for `locked`: a template or a function of the request. The
    other options are those of `limit_middleware`.
    """
    policy = LimitPolicy(rate, **options)
    return _decorator(_Locker(name, client, take=policy.take, key=_PERMIT, query=query))


def _decorator(locker: _Locker) -> Callable[[Handler], Handler]:
    def decorate(handler: Handler) -> Handler:
        async def locked_handler(request: web.Request) -> web.StreamResponse:
            return await locker.run(request, handler)

        locked_handler.__name__ = getattr(handler, "__name__", "locked_handler")
        locked_handler.__doc__ = handler.__doc__
        return locked_handler

    return decorate


def lock_middleware(
    name: NameFunction,
    *,
    client: AnyRedis | None = None,
    **options: Unpack[LockOptions],
) -> Any:
    """A middleware holding the lock `name(request)` around each request (none if it
    returns None).

    - `ttl`: the lease in seconds (30), renewed in the background while the request runs.
    - `timeout`: 0 (the default) answers `busy_status` at once when the lock is held; a
      number of seconds waits that long first; None waits as long as it takes.
    - `busy_status`: 409 (the default) or e.g. 423, with the JSON body
      `{"error": "lock_busy", "lock": NAME, "message": ...}`; a lost lease answers
      `lost_status` (a 5xx) with `"error": "lock_lost"`; Redis unreachable, 503.
    - `limit`: None for a `RedisMutex`; N for a `RedisSemaphore` letting N requests in.
    - `prefix`: the key prefix, as for the primitives.
    - The client: `client` if given, else `app[REDIS]`.
    """
    return _middleware(_Locker(name, client, hold=LockPolicy(**options).hold))


def limit_middleware(
    name: NameFunction,
    *,
    rate: float | None = None,
    client: AnyRedis | None = None,
    **options: Unpack[LimitOptions],
) -> Any:
    """A middleware letting each request in only within the rate limit `name(request)`
    (none if it returns None): a `RedisRateLimiter` of `rate` requests per `per` seconds,
    at most `burst` at once (without `burst`: at most `rate` in any window of `per`),
    across every process.

    - `timeout`: 0 (the default) refuses at once when no slot is free now; a number of
      seconds waits up to that long for a slot first; None waits for it whenever it comes.
    - `busy_status`: 429 (the default), with a `Retry-After` header (seconds until the
      slot, rounded up) and the JSON body `{"error": "rate_limited", "lock": NAME,
      "message": ...}`; Redis unreachable, 503.
    - `cost`: permits each request takes (1); `prefix`: the key prefix.
    - `limits`: a function of the request (sync or async) returning the request's
      `Limit`(s), e.g. by the tenant's plan, instead of `rate`. A name keeps one set of
      limits while live: put the tenant in the name; a request whose limits differ from
      its name's live ones is answered 500 `"limit_mismatch"`.
    - The client: `client` if given, else `app[REDIS]`.
    """
    return _middleware(_Locker(name, client, take=LimitPolicy(rate, **options).take, key=_PERMIT))


def _middleware(locker: _Locker) -> Any:
    @web.middleware
    async def aiolocks_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await locker.run(request, handler)

    return aiolocks_middleware


@web.middleware
async def lock_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer aiolocks' errors raised by code inside a handler (a semaphore, a rate limiter,
    a lock used by hand) as `locked` and `rate_limited` answer theirs, with the same JSON
    bodies: `ServerUnavailable` and `AccessDenied` 503 `lock_unavailable`, a
    `RedisRateLimiter`'s `LockTimeout` 429 `rate_limited` with `Retry-After`, a lock's
    `LockTimeout` 409 `lock_busy`, `LockLost` 500 `lock_lost`; the others (`LockNotOwned`...)
    are bugs in the handler and stay the server's 500.
    `web.Application(middlewares=[lock_error_middleware])`."""
    try:
        return await handler(request)
    except LockError as error:
        refusal = refusal_for(error)
        if refusal is None:
            raise
        return _answer(request, refusal)


def held_lock(request: web.Request) -> HeldLock:
    """The lock the request holds (name, fencing token, `lost` event, the primitive)."""
    try:
        return cast(HeldLock, request[_HELD])
    except KeyError:
        raise LookupError("this request holds no aiolocks lock (no @locked/middleware)") from None


def permit(request: web.Request) -> Permit:
    """The permits the request was granted (name, cost, the limiter)."""
    try:
        return cast(Permit, request[_PERMIT])
    except KeyError:
        raise LookupError(
            "this request took no aiolocks permit (no @rate_limited/limit_middleware)"
        ) from None


def _template_function(template: NameTemplate, query: Collection[str]) -> NameFunction:
    if isinstance(query, str):
        raise TypeError("query must be a collection of field names, such as ('day',)")
    asked = frozenset(query)
    if not asked <= set(template.fields):
        unknown = ", ".join(sorted(asked - set(template.fields)))
        raise ValueError(f"query names {unknown}, not a field of {template.template!r}")
    checked: dict[int, object] = {}  # id(route) -> the route, checked on its first request

    def fill(request: web.Request) -> str:
        route = request.match_info.route
        if checked.get(id(route)) is not route:
            resource = route.resource
            label = f"{route.method} {resource.canonical if resource else route.name}"
            template.check(label, request.match_info.keys(), asked)
            checked[id(route)] = route
        from_query: dict[str, str] = {}
        if asked:  # parsing the query string is a cost of its own
            from_query = {field: request.query[field] for field in asked if field in request.query}
        return template.fill(request.match_info, from_query)

    return fill


def _client_of(request: web.Request) -> redis.asyncio.Redis:
    try:
        return request.config_dict[REDIS]
    except KeyError:
        raise RuntimeError(
            "aiolocks found no Redis client for the request lock: set app[REDIS] "
            "(from aiolocks.integrations.aiohttp import REDIS) or pass client="
        ) from None
