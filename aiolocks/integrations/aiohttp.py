"""aiohttp.web: hold a lock for the duration of a request, per handler or by middleware.

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
from collections.abc import Awaitable, Callable
from typing import Any, Unpack, cast

import redis.asyncio
from aiohttp import web

from .._base._clients import AnyRedis, ensure_async_client
from ._hold import HeldLock, LockOptions, LockPolicy, NameTemplate, Refusal

__all__ = ["REDIS", "HeldLock", "held_lock", "lock_middleware", "locked"]

REDIS = web.AppKey("aiolocks_redis", redis.asyncio.Redis)
"""Where the integration finds the Redis client: `app[REDIS]` (parent apps included)."""

# aiohttp 3.14 warns about plain str keys in the request; older versions lack RequestKey.
_HELD: Any = (
    web.RequestKey("aiolocks_held", HeldLock) if hasattr(web, "RequestKey") else "aiolocks_held"
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NameFunction = Callable[[web.Request], str | Awaitable[str | None] | None]


class _Locker:
    """Runs a handler holding its request's lock; what the decorator and middleware share."""

    def __init__(
        self, name: str | NameFunction, policy: LockPolicy, client: AnyRedis | None
    ) -> None:
        if isinstance(name, str):
            name = _template_function(NameTemplate(name))
        elif not callable(name):
            raise TypeError(f"name must be a str template or a callable, not {type(name).__name__}")
        if client is not None:
            ensure_async_client(client)
        self.name_of = name
        self.policy = policy
        self.client = client

    async def run(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            name = self.name_of(request)
            if inspect.isawaitable(name):
                name = await name
            if name is None:
                return await handler(request)
            client = self.client if self.client is not None else _client_of(request)
            async with self.policy.hold(client, name) as held:
                request[_HELD] = held
                return await handler(request)
        except Refusal as refusal:
            return web.json_response(refusal.body, status=refusal.status)
        raise AssertionError("unreachable: a lease loss always ends in a Refusal")


def locked(
    name: str | NameFunction,
    *,
    client: AnyRedis | None = None,
    **options: Unpack[LockOptions],
) -> Callable[[Handler], Handler]:
    """Decorate a handler so that each request runs holding the lock `name`.

    `name` is a template such as `"orders:{order_id}"` whose fields come from the route's
    match info, then the query string; or a function of the request returning the name
    (sync or async). The other options are those of `lock_middleware`.
    """
    locker = _Locker(name, LockPolicy(**options), client)

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
    locker = _Locker(name, LockPolicy(**options), client)

    @web.middleware
    async def aiolocks_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await locker.run(request, handler)

    return aiolocks_middleware


def held_lock(request: web.Request) -> HeldLock:
    """The lock the request holds (name, fencing token, `lost` event, the primitive)."""
    try:
        return cast(HeldLock, request[_HELD])
    except KeyError:
        raise LookupError("this request holds no aiolocks lock (no @locked/middleware)") from None


def _template_function(template: NameTemplate) -> NameFunction:
    def fill(request: web.Request) -> str:
        return template.fill(request.match_info, request.query)

    return fill


def _client_of(request: web.Request) -> redis.asyncio.Redis:
    try:
        return request.config_dict[REDIS]
    except KeyError:
        raise RuntimeError(
            "aiolocks found no Redis client for the request lock: set app[REDIS] "
            "(from aiolocks.integrations.aiohttp import REDIS) or pass client="
        ) from None
