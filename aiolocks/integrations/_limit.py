"""What the web integrations share for rate limits: the policy, and one `take()`.

A request takes its permits before the handler runs (waiting for them up to `timeout`);
when it cannot, it is refused with 429, a `Retry-After` header (seconds until the slot it
asked for, rounded up) and the JSON body the lock refusals use. A permit is a slot in
time: nothing is released after the handler.

`limits=` may be a function of the request returning the request's limit(s) (e.g. by the
tenant's plan). A name keeps one set of limits while it is live: a request whose limits
differ from the name's live ones is answered 500 `limit_mismatch` (so each set of limits
needs its own names, e.g. the tenant in the name).

A policy builds one `RedisRateLimiter` per client, name and limits and reuses it for the
requests that follow (the most recently used `KEPT_LIMITERS` of each client), as long as it
uses the policy's limits: one that adopted limits stored by `set_limits()` is replaced by a
new one at its next request, which is what a limiter made per request would have done.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .._base._clients import AnyRedis, ensure_async_client
from .._base._errors import AccessDenied, LimitMismatch, ServerUnavailable
from .._base._keys import DEFAULT_PREFIX, validate_prefix
from .._engine._settings import validate_timeout
from ..ratelimit import MAX_BURST, Limit, RedisRateLimiter, validate_cost, validate_limits
from ._hold import Answer, Refusal, as_raised, retry_after, status_code

__all__ = ["KEPT_LIMITERS", "LimitOptions", "LimitPolicy", "Limits", "LimitsFunction", "Permit"]

# Limiters a policy keeps per client for reuse, the most recently used (names may be many).
KEPT_LIMITERS = 1024

Limits = Limit | Sequence[Limit]
# A function of the request (sync or async) returning the request's limit(s).
LimitsFunction = Callable[[Any], Limits | Awaitable[Limits]]


@dataclass(frozen=True, slots=True)
class Permit:
    """The permits a request was granted."""

    name: str
    cost: int
    limiter: RedisRateLimiter


class LimitOptions(TypedDict, total=False):
    """The keyword options every rate-limit integration takes (the fields of `LimitPolicy`
    but `rate`): `limits=[Limit(...), ...]` instead of `rate=` takes several at once."""

    per: float
    burst: int | None
    limits: Sequence[Limit] | LimitsFunction | None
    cost: int
    timeout: float | None
    prefix: str
    busy_status: int


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """How a request takes its permits; validated when the dependency/decorator is made."""

    rate: float | None = None
    per: float = 1.0
    burst: int | None = None
    # several limits instead of rate, per, burst; or a function of the request giving them
    limits: Sequence[Limit] | LimitsFunction | None = None
    cost: int = 1  # permits each request takes
    timeout: float | None = 0.0  # 0: refuse at once; t: wait up to t s for the slot
    prefix: str = DEFAULT_PREFIX
    busy_status: int = 429
    # client -> {(name, limits): its limiter}, least recently used first
    _limiters: weakref.WeakKeyDictionary[
        AnyRedis, dict[tuple[str, tuple[Limit, ...] | None], RedisRateLimiter]
    ] = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Fail when the app is built, not on its first request.
        if callable(self.limits):  # per request: checked with each request's limits
            if self.rate is not None or self.burst is not None or self.per != 1.0:
                raise ValueError("give rate=, per=, burst= (one limit) or limits=, not both")
            validate_cost(self.cost, MAX_BURST)  # and each request's burst
        else:
            settings = validate_limits(self.rate, self.per, self.burst, self.limits)
            if self.limits is not None:
                object.__setattr__(self, "limits", tuple(self.limits))  # not changed later
            validate_cost(self.cost, min(burst for _, _, burst, _ in settings))
        validate_timeout(self.timeout)
        validate_prefix(self.prefix)
        status_code(self.busy_status, "busy_status", 400)

    async def take(
        self, client: AnyRedis, name: str, request: object, answer: Answer = as_raised
    ) -> Permit:
        """Take the permits of `name` (waiting up to `timeout`); raise `answer(Refusal)` if
        they cannot be had in time. (Nothing to release after the request: no `hold()`.)"""
        client = ensure_async_client(client)
        limits = self.limits
        if callable(limits):
            limits = await _limits_of(limits, request, self.cost)
        try:  # (the name is checked there, once)
            limiter = self._limiter(client, name, None if limits is None else tuple(limits))
        except ValueError as exc:  # the limits were checked: a ValueError is the name's
            raise answer(Refusal(422, "lock_name_invalid", name, str(exc))) from None
        try:
            wait = await limiter._acquire(True, self.timeout, self.cost)
        except (ServerUnavailable, AccessDenied) as exc:
            raise answer(Refusal(503, "lock_unavailable", name, exc.reason)) from exc
        except LimitMismatch as exc:
            raise answer(Refusal(500, "limit_mismatch", name, str(exc))) from exc
        if wait is not None:
            waited = "" if self.timeout == 0 else f" within {self.timeout:g} s"
            allows = " and ".join(
                f"{limit.rate:g} requests per {limit.per:g} s" for limit in limiter.limits
            )
            message = f"{name!r} allows {allows}; no slot free{waited}: the next is in {wait:.3f} s"
            refusal = Refusal(self.busy_status, "rate_limited", name, message, retry_after(wait))
            raise answer(refusal)
        return Permit(name, self.cost, limiter)

    def _limiter(
        self, client: AnyRedis, name: str, limits: tuple[Limit, ...] | None
    ) -> RedisRateLimiter:
        """The limiter of `name` with `limits` on `client`: the one built for an earlier
        request, while it still uses the policy's limits, else a new one."""
        kept = self._limiters.get(client)
        if kept is None:
            kept = self._limiters[client] = {}
        key = (name, limits)
        limiter = kept.pop(key, None)  # (put back last: the most recently used)
        if limiter is None or limiter._stamp:  # (_stamp: it adopted stored limits)
            limiter = RedisRateLimiter(
                client,
                name,
                rate=self.rate,
                per=self.per,
                burst=self.burst,
                limits=limits,
                prefix=self.prefix,
            )
        kept[key] = limiter
        if len(kept) > KEPT_LIMITERS:
            del kept[next(iter(kept))]
        return limiter


async def _limits_of(function: LimitsFunction, request: object, cost: int) -> tuple[Limit, ...]:
    """The limits `function` gives for `request` (one `Limit` or a sequence of them),
    checked: a TypeError/ValueError here is the function's bug (a 500)."""
    limits = function(request)
    if inspect.isawaitable(limits):
        limits = await limits
    chosen = (limits,) if isinstance(limits, Limit) else tuple(limits)
    settings = validate_limits(None, 1.0, None, chosen)
    validate_cost(cost, min(burst for _, _, burst, _ in settings))
    return chosen
