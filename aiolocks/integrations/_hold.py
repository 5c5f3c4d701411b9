"""What the web integrations share: the lock policy, the name template, and one `hold()`.

A request holds its lock like the body of `async with`: a lost lease cancels the work
and is reported. Whatever the request cannot have (busy, lost, Redis down, a bad name)
becomes a `Refusal` carrying an HTTP status and a JSON body; each framework turns it into
its own response type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import string
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict

from .._base._clients import AnyRedis
from .._base._errors import AccessDenied, LockError, LockLost, LockTimeout, ServerUnavailable
from .._base._keys import DEFAULT_PREFIX, validate_name, validate_prefix
from .._engine._settings import DEFAULT_TTL, validate_int, validate_timeout, validate_ttl
from .._leases import _keeper
from ..mutex import RedisMutex
from ..semaphore import MAX_LIMIT, RedisSemaphore

__all__ = [
    "Answer",
    "HeldLock",
    "Holding",
    "LockOptions",
    "LockPolicy",
    "NameTemplate",
    "Refusal",
    "TemplateMismatch",
    "as_raised",
    "refusal_for",
    "retry_after",
    "status_code",
]

log = logging.getLogger("aiolocks")


@dataclass(frozen=True, slots=True)
class HeldLock:
    """The lock a request holds: give `fencing_token` to the storage you write to."""

    name: str
    fencing_token: int
    lock: RedisMutex | RedisSemaphore
    _holding: _keeper.Holding = dataclasses.field(repr=False, compare=False)

    @property
    def lost(self) -> asyncio.Event:
        """Set if the lease is lost while the request runs (the same event at each access,
        made when first asked for: most requests never ask)."""
        return self._holding.lost


class Refusal(Exception):
    """The request cannot go on: answer `status` with the JSON `body` (and `headers`)."""

    def __init__(
        self,
        status: int,
        error: str,
        name: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, str] = {"error": error, "lock": name, "message": message}
        self.headers = headers


# What a refusal is raised as: the framework's own exception (FastAPI's HTTPException), or
# the `Refusal` itself (`as_raised`) for a caller that answers it (aiohttp's).
Answer = Callable[[Refusal], Exception]


def as_raised(refusal: Refusal) -> Exception:
    return refusal


def retry_after(wait: float) -> dict[str, str]:
    """The headers of a refusal whose next chance is `wait` seconds away: `Retry-After`
    in whole seconds, rounded up (at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(wait)))}


def refusal_for(error: LockError) -> Refusal | None:
    """The answer for an aiolocks error raised by code inside a handler (a semaphore, a
    limiter, a lock used by hand), or None for a bug in that code (`LockNotOwned`...).
    A timeout is told apart by `retry_after`: a rate limiter's is 429 with `Retry-After`
    (no slot before then), a lock's 409 (its holder may release any moment)."""
    if isinstance(error, (ServerUnavailable, AccessDenied)):
        return Refusal(503, "lock_unavailable", error.name, str(error))
    if isinstance(error, LockTimeout):
        if error.retry_after is not None:  # a rate limiter's: its next slot is that far
            return Refusal(
                429, "rate_limited", error.name, str(error), retry_after(error.retry_after)
            )
        return Refusal(409, "lock_busy", error.name, str(error))
    if isinstance(error, LockLost):
        return Refusal(500, "lock_lost", error.name, str(error))
    return None


class TemplateMismatch(ValueError):
    """A name template asks for a value its route does not have: the server's bug."""


def _listed(names: Collection[str]) -> str:
    return ", ".join(sorted(names)) or "none"


class NameTemplate:
    """A lock name such as `"orders:{order_id}"`, each field filled from request values."""

    __slots__ = ("fields", "template")

    def __init__(self, template: str) -> None:
        what = "lock name template"
        if not isinstance(template, str):
            raise TypeError(f"{what} must be a str, not {type(template).__name__}")
        try:
            parts = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ValueError(f"{what} {template!r}: {exc}") from None
        fields = [field for _, field, _, _ in parts if field is not None]
        for _, field, spec, conversion in parts:
            if field is not None and (not field.isidentifier() or spec or conversion):
                raise ValueError(
                    f"{what} {template!r}: fields must be plain names such as {{order_id}}"
                )
        self.template = template
        self.fields = tuple(fields)
        validate_name(template.format_map(dict.fromkeys(fields, "x")), what)

    def check(self, route: str, path: Collection[str], query: Collection[str]) -> None:
        """Raise `TemplateMismatch` if a field is neither one of the route's `path`
        parameters nor one of its declared `query` parameters (a typo in the template)."""
        for field in self.fields:
            if field not in path and field not in query:
                raise TemplateMismatch(
                    f"the lock name template {self.template!r} needs {field!r}, which the "
                    f"route {route} has neither as a path parameter "
                    f"({_listed(path)}) nor as a declared query parameter ({_listed(query)})"
                )

    def fill(self, *sources: Mapping[str, object]) -> str:
        """The name, each field taken from the first of `sources` that has it."""
        values: dict[str, str] = {}
        for field in self.fields:
            for source in sources:
                if field in source:
                    values[field] = str(source[field])
                    break
            else:
                message = (
                    f"the lock name {self.template!r} needs {field!r}, "
                    "found neither in the path nor in the query string"
                )
                raise Refusal(422, "lock_name_incomplete", self.template, message)
        return self.template.format_map(values)


def status_code(value: object, what: str, low: int) -> int:
    """`value` if it is an HTTP status in `low`..599; raises naming `what` if not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int HTTP status, not {type(value).__name__}")
    if not low <= value <= 599:
        raise ValueError(f"{what} must be an HTTP status in {low}..599, got {value}")
    return value


class LockOptions(TypedDict, total=False):
    """The keyword options every integration takes (the fields of `LockPolicy`)."""

    ttl: float
    timeout: float | None
    limit: int | None
    prefix: str
    busy_status: int
    lost_status: int


@dataclass(frozen=True, slots=True)
class LockPolicy:
    """How a request takes its lock; validated when the dependency/decorator is made."""

    ttl: float = DEFAULT_TTL
    timeout: float | None = 0.0  # 0: answer `busy_status` at once; None: wait for it
    limit: int | None = None  # None: a RedisMutex; N: a RedisSemaphore of N holders
    prefix: str = DEFAULT_PREFIX
    busy_status: int = 409
    lost_status: int = 500

    def __post_init__(self) -> None:
        # Fail when the app is built, not on its first request.
        validate_ttl(self.ttl)
        validate_timeout(self.timeout)
        if self.limit is not None:
            validate_int(self.limit, "limit", 1, MAX_LIMIT)
        validate_prefix(self.prefix)
        status_code(self.busy_status, "busy_status", 400)
        status_code(self.lost_status, "lost_status", 500)  # the work may have overlapped: 5xx

    def hold(
        self, client: AnyRedis, name: str, request: object, answer: Answer = as_raised
    ) -> Holding:
        """Hold the lock `name` around the body (`async with`); raise `answer(Refusal)` if
        it cannot be had, or if its lease was lost (the body is cancelled at the loss, as
        the lock's own `async with` does). (`request`: unused, a rate limit's per-request
        limits read it.)"""
        return Holding(self, client, name, answer)


class Holding:
    """One request's holding: the lock's own `async with` (its body cancelled at a loss,
    `LockLost` at its exit), what it cannot have raised as `answer(Refusal)` (the
    framework's own exception, or the `Refusal`). A class, not a generator: one is made
    per request."""

    __slots__ = ("answer", "client", "lock", "name", "policy")

    def __init__(self, policy: LockPolicy, client: AnyRedis, name: str, answer: Answer) -> None:
        self.policy = policy
        self.client = client
        self.name = name
        self.answer = answer
        self.lock: RedisMutex | RedisSemaphore | None = None

    async def __aenter__(self) -> HeldLock:
        policy, name = self.policy, self.name
        lock: RedisMutex | RedisSemaphore
        try:  # (the client and the name are checked there, once)
            if policy.limit is None:
                lock = RedisMutex(self.client, name, ttl=policy.ttl, prefix=policy.prefix)
            else:
                lock = RedisSemaphore(
                    self.client, name, limit=policy.limit, ttl=policy.ttl, prefix=policy.prefix
                )
        except ValueError as exc:  # the policy's settings were checked when it was made
            raise self.answer(Refusal(422, "lock_name_invalid", name, str(exc))) from None
        self.lock = lock
        task = _keeper.current_task()
        try:
            if policy.timeout == 0:  # one try, no subscription
                acquired = await lock._acquisition(task, False, None)
            else:
                acquired = await lock._acquisition(task, True, policy.timeout)
        except BaseException as exc:
            del task  # (a failed acquisition lets go of its task: `_leasedlock`)
            if isinstance(exc, (ServerUnavailable, AccessDenied)):
                raise self.answer(Refusal(503, "lock_unavailable", name, exc.reason)) from exc
            raise
        if not acquired:
            del task
            waited = "" if policy.timeout == 0 else f" within {policy.timeout:g} s"
            # Who holds it is not known here (another request, a worker, a script): say
            # only what is.
            if policy.limit is None:
                busy = f"{name!r} is held elsewhere"
            else:
                busy = f"{name!r} has all {policy.limit} of its slots held"
            message = f"{busy}; not acquired{waited}"
            raise self.answer(Refusal(policy.busy_status, "lock_busy", name, message))
        # As the lock's own `async with`: a loss cancels the body. (The holding: its fence,
        # and its `lost` event when asked for.)
        holding = lock._enter_body(task)
        return HeldLock(name, holding.fence, lock, holding)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        raised: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release; a lost lease becomes a `Refusal` (and a body cancelled at the loss
        ends there), unless the request is being cancelled from outside: nobody is left
        to answer, and that cancellation must go on."""
        lock = self.lock
        assert lock is not None
        try:
            await lock.__aexit__(exc_type, raised, traceback)
        except LockLost as lost:
            if _cancelled_from_outside():
                log.warning("aiolocks: %s (the request was cancelled)", lost)
                return
            message = (
                f"the lease on {lock.name!r} was lost while the request ran ({lost.reason}); "
                "its work may have overlapped another holder's"
            )
            refusal = Refusal(self.policy.lost_status, "lock_lost", lock.name, message)
            raise self.answer(refusal) from (raised or lost)
        except (ServerUnavailable, AccessDenied) as exc:
            if _cancelled_from_outside():
                return
            raise self.answer(Refusal(503, "lock_unavailable", lock.name, exc.reason)) from exc


def _cancelled_from_outside() -> bool:
    """The current task has a cancellation pending that is not a loss's (the lock's exit
    took back the one a loss made)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
