"""What the server says about one primitive: the library's own `inspect()` summary, plus its
holders and its queue read in one transaction, with ages on the server's clock.

The server keeps no time of entry for a waiter: each queue entry has a liveness deadline
(`waiters` ZSET, see `_scripts/_prelude.lua`) that its process pushes to now + ttl at
every heartbeat (every ttl/3). So a waiter's age shown here is the time since its last
heartbeat, and a waiter past its deadline is dead (its process stopped heartbeating) and
will be purged by the next script that passes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from .._base._adapter import text
from .._base._keys import KeySpace
from ..election import ElectionInfo, RedisElection
from ..mutex import MutexInfo, RedisMutex
from ..ratelimit import RateLimiterInfo, RedisRateLimiter
from ..registry import RedisRegistry
from ..rwlock import RedisReadWriteLock, RWLockInfo
from ..semaphore import RedisSemaphore, SemaphoreInfo

__all__ = [
    "SHORT_TOKEN",
    "Holder",
    "Info",
    "RegistryInfo",
    "View",
    "Waiter",
    "info_of",
    "state_of",
    "view_of",
]


# Tables show the first characters of a token (64 bits: unique in practice), so that they
# fit 80 columns; `--json` has them whole, and `release --token` takes any unique start.
SHORT_TOKEN = 16


@dataclass(frozen=True, slots=True)
class RegistryInfo:
    """What the server says about a registry (it has no holders or queue)."""

    name: str
    names: int  # names registered (= the highest id)


Info = MutexInfo | SemaphoreInfo | RWLockInfo | ElectionInfo | RegistryInfo | RateLimiterInfo


@dataclass(frozen=True, slots=True)
class Holder:
    """One lease on the primitive."""

    token: str
    side: str  # 'x' exclusive (mutex, semaphore permit), 'r' reader, 'w' writer
    fence: int | None
    lease_remaining_ms: int  # <= 0: the lease has ended (not yet purged)
    value: str | None = None  # an election's leader: the value it proclaimed


@dataclass(frozen=True, slots=True)
class Waiter:
    """One queue entry, in FIFO order (position 1 is served first)."""

    position: int
    token: str
    side: str
    ttl_ms: int  # the lease it asks for (also its heartbeat window)
    client_tag: str  # the client (one per process and event loop) it waits in
    live: bool  # its liveness deadline has not passed
    heartbeat_age_ms: int | None  # since its last heartbeat, on the server's clock
    expires_in_ms: int | None  # until its deadline, unless heartbeated again
    value: str | None = None  # an election's candidate: the value it campaigns with


@dataclass(frozen=True, slots=True)
class View:
    """A primitive's summary (`inspect()`), holders and queue."""

    kind: str
    name: str
    prefix: str
    info: Info
    holders: tuple[Holder, ...]
    queue: tuple[Waiter, ...]
    server_time_ms: int

    @property
    def state(self) -> str:
        return state_of(self.info)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "prefix": self.prefix,
            "state": self.state,
            "summary": summary(self.info),
            "holders": [self._fields(holder) for holder in self.holders],
            "queue": [self._fields(waiter) for waiter in self.queue],
            "server_time_ms": self.server_time_ms,
        }

    def _fields(self, row: Holder | Waiter) -> dict[str, Any]:
        fields = dataclasses.asdict(row)
        if self.kind != "election":
            del fields["value"]  # only elections have values
        return fields


def summary(info: Info) -> dict[str, Any]:
    """The `inspect()` fields, for JSON (the name is given beside it)."""
    fields = dataclasses.asdict(info)
    del fields["name"]
    return fields


def state_of(info: Info) -> str:
    """One word or two: held / free, and how."""
    if isinstance(info, MutexInfo):
        return "held" if info.owner is not None else "free"
    if isinstance(info, SemaphoreInfo):
        limit = "?" if info.limit is None else str(info.limit)
        return f"{info.holders}/{limit} held" if info.holders else "free"
    if isinstance(info, RWLockInfo):
        if info.writer is not None:
            return "write-held"
        return f"read-held x{info.readers}" if info.readers else "free"
    if isinstance(info, ElectionInfo):
        return f"led by {info.value!r}" if info.leader is not None else "vacant"
    if isinstance(info, RateLimiterInfo):
        if info.burst is None:
            return "idle"
        settings = " and ".join(f"{limit.rate:g} per {limit.per:g} s" for limit in info.limits)
        if info.available:
            return f"{info.available} free, {settings}"
        return f"next slot in {info.next_free_ms} ms, {settings}"
    return f"{info.names} names"


async def info_of(client: redis.asyncio.Redis, kind: str, name: str, prefix: str) -> Info:
    """The library's own `inspect()` of the primitive (a registry: its count)."""
    if kind == "mutex":
        return await RedisMutex(client, name, prefix=prefix).inspect()
    if kind == "semaphore":
        # The limit given here is only used by acquisitions, never by inspect().
        return await RedisSemaphore(client, name, limit=1, prefix=prefix).inspect()
    if kind == "rwlock":
        return await RedisReadWriteLock(client, name, prefix=prefix).inspect()
    if kind == "election":
        return await RedisElection(client, name, prefix=prefix).inspect()
    if kind == "registry":
        return RegistryInfo(name, await RedisRegistry(client, name, prefix=prefix).count())
    if kind == "ratelimit":
        # The settings given here are never used by inspect(), which reads the stored ones.
        return await RedisRateLimiter(client, name, rate=1, prefix=prefix).inspect()
    raise ValueError(f"unknown kind {kind!r}")


async def view_of(client: redis.asyncio.Redis, kind: str, name: str, prefix: str) -> View:
    """`info_of`, then holders and queue in one MULTI/EXEC with the server's TIME."""
    info = await info_of(client, kind, name, prefix)
    if kind in ("registry", "ratelimit"):  # no holders, no queue
        now = _ms(await client.time())
        return View(kind, name, prefix, info, (), (), now)
    keys = KeySpace(prefix, kind, name)
    pipe = client.pipeline(transaction=True)
    pipe.time()
    pipe.lrange(keys.key("queue"), 0, -1)
    pipe.zrange(keys.key("waiters"), 0, -1, withscores=True)
    if kind == "mutex":
        pipe.get(keys.key("owner"))
        pipe.pttl(keys.key("owner"))
        pipe.get(keys.key("fence"))
    elif kind == "semaphore":
        pipe.zrange(keys.key("holders"), 0, -1, withscores=True)
        pipe.hgetall(keys.key("fences"))
    elif kind == "election":
        pipe.hgetall(keys.key("leader"))
        pipe.pttl(keys.key("leader"))
        pipe.hgetall(keys.key("candidates"))
    else:
        pipe.get(keys.key("writer"))
        pipe.pttl(keys.key("writer"))
        pipe.get(keys.key("fence"))
        pipe.zrange(keys.key("readers"), 0, -1, withscores=True)
        pipe.hgetall(keys.key("fences"))
    clock, members, deadlines, *rest = await pipe.execute()
    now = _ms(clock)
    queue = _queue(members, dict(deadlines), now)
    if kind == "mutex":
        holders = _owner(rest[0], rest[1], rest[2], "x")
    elif kind == "semaphore":
        holders = _leases(rest[0], rest[1], now, "x")
    elif kind == "election":
        holders = _leader(rest[0], rest[1])
        values = {text(token): text(value) for token, value in rest[2].items()}
        queue = tuple(dataclasses.replace(w, value=values.get(w.token)) for w in queue)
    else:
        holders = _owner(rest[0], rest[1], rest[2], "w") + _leases(rest[3], rest[4], now, "r")
    return View(kind, name, prefix, info, holders, queue, now)


def _ms(clock: Any) -> int:
    seconds, micros = clock
    return int(seconds) * 1000 + int(micros) // 1000


def _owner(token: Any, pttl: Any, fence: Any, side: str) -> tuple[Holder, ...]:
    if token is None:
        return ()
    return (Holder(text(token), side, int(fence or 0), max(0, int(pttl))),)


def _leader(fields: dict[Any, Any], pttl: Any) -> tuple[Holder, ...]:
    leader = {text(key): text(value) for key, value in fields.items()}
    if "token" not in leader:
        return ()
    fence = int(leader.get("fence", 0))
    return (Holder(leader["token"], "x", fence, max(0, int(pttl)), leader.get("value", "")),)


def _leases(deadlines: Any, fences: Any, now: int, side: str) -> tuple[Holder, ...]:
    by_token = {text(token): int(fence) for token, fence in dict(fences).items()}
    holders = [
        Holder(text(token), side, by_token.get(text(token)), int(deadline) - now)
        for token, deadline in deadlines
    ]
    return tuple(sorted(holders, key=lambda holder: holder.fence or 0))  # oldest grant first


def _queue(members: list[Any], deadlines: dict[Any, float], now: int) -> tuple[Waiter, ...]:
    waiters = []
    for position, member in enumerate(members, 1):
        fields = text(member).split(":", 3)
        if len(fields) != 4 or not fields[1].isdigit():
            fields = [text(member), "0", "", "?"]  # not written by aiolocks: show it as is
        token, ttl, tag, side = fields
        deadline = deadlines.get(member)
        ttl_ms = int(ttl)
        waiters.append(
            Waiter(
                position=position,
                token=token,
                side=side,
                ttl_ms=ttl_ms,
                client_tag=tag,
                live=deadline is not None and deadline >= now,
                heartbeat_age_ms=None if deadline is None else now - (int(deadline) - ttl_ms),
                expires_in_ms=None if deadline is None else int(deadline) - now,
            )
        )
    return tuple(waiters)
