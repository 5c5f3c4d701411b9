"""Bad input, table-driven: every public constructor and method given wrong types, empty,
huge or brace-holding names, NaN / infinite / out-of-range numbers, mismatched limits,
double or foreign releases, an unreachable server, or keys that already hold another
Redis type. Each case raises a clear aiolocks error, or ValueError / TypeError, whose
message names the problem, and leaves Redis byte for byte as it was (a DUMP of every key,
and which keys expire, compared before and after)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
from _faultreport import record
from _faults import close_client, snapshot
from _servers import ServerProcess, free_port

from aiolocks import (
    ClientClosed,
    LimitMismatch,
    LockError,
    LockLost,
    LockNotOwned,
    LockReentry,
    RedisElection,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._base import _adapter

pytestmark = pytest.mark.faults

N = "bad"  # the name every case uses
NAN, INF = float("nan"), float("inf")
MUTEX = f"aiolocks:mutex:{{{N}}}:"
SEM = f"aiolocks:semaphore:{{{N}}}:"
RW = f"aiolocks:rwlock:{{{N}}}:"

Act = Callable[[redis.asyncio.Redis, dict[str, Any]], Awaitable[object]]


@dataclass(frozen=True)
class Bad:
    case: str
    act: Act  # the bad call; gets the client and what `setup` left in the context dict
    error: type[BaseException]
    says: str  # the message must contain this (it names the problem)
    setup: Act | None = None  # state made before the "before" snapshot
    cleanup: Act | None = None  # undoes `setup` after the "after" snapshot


async def _nothing(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    return None


def _(value: object) -> Any:
    """A wrongly typed argument, passed on purpose."""
    return value


def make(factory: Callable[[redis.asyncio.Redis], object]) -> Act:
    """A case that only constructs something."""

    async def act(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> object:
        return factory(r)

    return act


def mutex_call(method: str, **kwargs: Any) -> Act:
    async def act(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> object:
        lock = ctx.get("lock") or RedisMutex(r, N)
        result: Awaitable[object] = getattr(lock, method)(**kwargs)
        return await result

    return act


def holding(factory: Callable[[redis.asyncio.Redis], Any]) -> Act:
    """Setup: acquire `factory(r)` in the test's task and keep it in ctx["lock"]."""

    async def setup(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
        ctx["lock"] = factory(r)
        assert await ctx["lock"].acquire()

    return setup


async def release_it(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    await ctx["lock"].release()


def wrong_type(key: str, kind: str) -> Act:
    """Setup: `key` holds a `kind` ("list", "string", "hash", "zset") that aiolocks did not
    put there."""

    async def setup(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
        if kind == "list":
            await r.rpush(key, "someone", "else")
        elif kind == "hash":
            await r.hset(key, "field", "value")
        elif kind == "zset":
            await r.zadd(key, {"member": 1})
        else:
            await r.set(key, kind)  # a string, numeric or not

    return setup


async def _released_twice(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    ctx["lock"] = RedisMutex(r, N)
    assert await ctx["lock"].acquire()
    await ctx["lock"].release()


async def _held_by_other_task(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    lock, held, done = RedisMutex(r, N), asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        assert await lock.acquire()
        held.set()
        await done.wait()
        await lock.release()

    ctx.update(lock=lock, done=done, task=asyncio.create_task(holder()))
    await asyncio.wait_for(held.wait(), 5)


async def _held_elsewhere_and_waiters_a_list(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    await r.set(MUTEX + "owner", "another-holder")  # no expiry: the snapshot stays still
    await wrong_type(MUTEX + "waiters", "list")(r, ctx)


async def _end_other_task(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    ctx["done"].set()
    await asyncio.wait_for(ctx["task"], 5)


async def _holding_write_side(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    ctx["rw"] = RedisReadWriteLock(r, N)
    ctx["lock"] = ctx["rw"].write()
    assert await ctx["lock"].acquire()


async def _stored_limit_2(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    sem = RedisSemaphore(r, N, limit=2)
    assert await sem.acquire()
    await sem.release()


async def _unreachable(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> object:
    nowhere = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        return await RedisMutex(nowhere, N).acquire()
    finally:
        await nowhere.aclose()


async def _enter_with_mismatch(r: redis.asyncio.Redis, ctx: dict[str, Any]) -> None:
    async with RedisSemaphore(r, N, limit=3):
        pass


def _sync_client(r: redis.asyncio.Redis) -> object:
    sync = redis.Redis()  # never connects: construction only
    return RedisMutex(_(sync), N)


CASES: list[Bad] = [
    # -- constructors: the client ---------------------------------------------------------
    Bad("client is a sync redis.Redis", make(_sync_client), TypeError, "redis.asyncio"),
    Bad("client is None", make(lambda r: RedisMutex(_(None), N)), TypeError, "client"),
    Bad(
        "semaphore client is a URL",
        make(lambda r: RedisSemaphore(_("redis://"), N, limit=1)),
        TypeError,
        "client",
    ),
    Bad(
        "rwlock client is an int", make(lambda r: RedisReadWriteLock(_(42), N)), TypeError, "client"
    ),
    # -- names and prefixes ---------------------------------------------------------------
    Bad("name is an int", make(lambda r: RedisMutex(r, _(123))), TypeError, "name"),
    Bad("name is bytes", make(lambda r: RedisMutex(r, _(b"x"))), TypeError, "name"),
    Bad("name is empty", make(lambda r: RedisMutex(r, "")), ValueError, "empty"),
    Bad("name has {", make(lambda r: RedisMutex(r, "a{b")), ValueError, "hash tag"),
    Bad(
        "semaphore name has }",
        make(lambda r: RedisSemaphore(r, "a}b", limit=1)),
        ValueError,
        "hash tag",
    ),
    Bad("rwlock name is empty", make(lambda r: RedisReadWriteLock(r, "")), ValueError, "empty"),
    Bad("name is huge", make(lambda r: RedisMutex(r, "x" * 100_000)), ValueError, "too long"),
    Bad("name is not UTF-8", make(lambda r: RedisMutex(r, "a\ud800")), ValueError, "UTF-8"),
    Bad("prefix is empty", make(lambda r: RedisMutex(r, N, prefix="")), ValueError, "prefix"),
    Bad("prefix has {", make(lambda r: RedisMutex(r, N, prefix="a{")), ValueError, "prefix"),
    # -- ttl and timeout ------------------------------------------------------------------
    Bad("ttl is NaN", make(lambda r: RedisMutex(r, N, ttl=NAN)), ValueError, "ttl"),
    Bad("ttl is infinite", make(lambda r: RedisMutex(r, N, ttl=INF)), ValueError, "ttl"),
    Bad("ttl is 0", make(lambda r: RedisSemaphore(r, N, limit=1, ttl=0)), ValueError, "ttl"),
    Bad("ttl is negative", make(lambda r: RedisReadWriteLock(r, N, ttl=-1)), ValueError, "ttl"),
    Bad("ttl is a str", make(lambda r: RedisMutex(r, N, ttl=_("30"))), TypeError, "ttl"),
    Bad("ttl is a bool", make(lambda r: RedisMutex(r, N, ttl=True)), TypeError, "ttl"),
    Bad("ttl is below 10 ms", make(lambda r: RedisMutex(r, N, ttl=0.001)), ValueError, "ttl"),
    Bad("ttl is 1e300", make(lambda r: RedisMutex(r, N, ttl=1e300)), ValueError, "ttl"),
    Bad("ttl is 10**400", make(lambda r: RedisMutex(r, N, ttl=10**400)), ValueError, "ttl"),
    Bad("timeout is NaN", make(lambda r: RedisMutex(r, N, timeout=NAN)), ValueError, "timeout"),
    Bad("timeout is negative", make(lambda r: RedisMutex(r, N, timeout=-1)), ValueError, "timeout"),
    Bad("timeout is a str", make(lambda r: RedisMutex(r, N, timeout=_("5"))), TypeError, "timeout"),
    Bad(
        "timeout is 10**400",
        make(lambda r: RedisMutex(r, N, timeout=10**400)),
        ValueError,
        "timeout",
    ),
    Bad(
        "on_lost is not callable",
        make(lambda r: RedisMutex(r, N, on_lost=_("log"))),
        TypeError,
        "on_lost",
    ),
    Bad(
        "ttl given by position", make(lambda r: RedisMutex(r, N, *_([30]))), TypeError, "positional"
    ),
    # -- the semaphore's limit ------------------------------------------------------------
    Bad("limit missing", make(lambda r: RedisSemaphore(r, N, **_({}))), TypeError, "limit"),
    Bad("limit is 0", make(lambda r: RedisSemaphore(r, N, limit=0)), ValueError, "limit"),
    Bad("limit is negative", make(lambda r: RedisSemaphore(r, N, limit=-2)), ValueError, "limit"),
    Bad("limit is a float", make(lambda r: RedisSemaphore(r, N, limit=_(1.5))), TypeError, "limit"),
    Bad("limit is a str", make(lambda r: RedisSemaphore(r, N, limit=_("3"))), TypeError, "limit"),
    Bad("limit is a bool", make(lambda r: RedisSemaphore(r, N, limit=True)), TypeError, "limit"),
    Bad("limit is 2**63", make(lambda r: RedisSemaphore(r, N, limit=2**63)), ValueError, "limit"),
    Bad(
        "limit differs from the stored one",
        lambda r, ctx: RedisSemaphore(r, N, limit=3).acquire(),
        LimitMismatch,
        "stored with limit 2",
        setup=_stored_limit_2,
    ),
    Bad(
        "async with, limit differs",
        _enter_with_mismatch,
        LimitMismatch,
        "limit 2",
        setup=_stored_limit_2,
    ),
    Bad(
        "set_limit(0)",
        lambda r, ctx: RedisSemaphore(r, N, limit=1).set_limit(0),
        ValueError,
        "limit",
    ),
    Bad(
        "set_limit('4')",
        lambda r, ctx: RedisSemaphore(r, N, limit=1).set_limit(_("4")),
        TypeError,
        "limit",
    ),
    # -- method arguments -----------------------------------------------------------------
    Bad("acquire(timeout=NaN)", mutex_call("acquire", timeout=NAN), ValueError, "timeout"),
    Bad("acquire(timeout=-1)", mutex_call("acquire", timeout=-1), ValueError, "timeout"),
    Bad("acquire(timeout='1')", mutex_call("acquire", timeout="1"), TypeError, "timeout"),
    Bad(
        "acquire(blocking=False, timeout=1)",
        mutex_call("acquire", blocking=False, timeout=1),
        ValueError,
        "blocking=False",
    ),
    # -- using it wrongly -----------------------------------------------------------------
    Bad("release without acquire", mutex_call("release"), LockNotOwned, "does not hold"),
    Bad(
        "release twice", mutex_call("release"), LockNotOwned, "does not hold", setup=_released_twice
    ),
    Bad(
        "release from another (running) task",
        mutex_call("release"),
        LockNotOwned,
        "does not hold",
        setup=_held_by_other_task,
        cleanup=_end_other_task,
    ),
    Bad(
        "lost of a holding not held",
        make(lambda r: RedisMutex(r, N).lost),
        LockNotOwned,
        "does not hold",
    ),
    Bad(
        "acquire again in the same task",
        mutex_call("acquire"),
        LockReentry,
        "reentrant",
        setup=holding(lambda r: RedisMutex(r, N)),
        cleanup=release_it,
    ),
    Bad(
        "read side while holding the write side",
        lambda r, ctx: ctx["rw"].read().acquire(),
        LockReentry,
        "other side",
        setup=_holding_write_side,
        cleanup=release_it,
    ),
    Bad("the server is unreachable", _unreachable, ServerUnavailable, "unreachable"),
    # -- keys that already hold another Redis type ----------------------------------------
    Bad(
        "mutex owner is a list",
        mutex_call("acquire"),
        ServerUnavailable,
        "owner holds a list",
        setup=wrong_type(MUTEX + "owner", "list"),
    ),
    Bad(
        "mutex queue is a string",
        mutex_call("acquire"),
        ServerUnavailable,
        "queue holds a string",
        setup=wrong_type(MUTEX + "queue", "string"),
    ),
    Bad(
        # The free path reads and writes no waiters key: a waiter joining the queue checks it.
        "mutex waiters is a list",
        mutex_call("acquire", timeout=5),
        ServerUnavailable,
        "waiters holds a list",
        setup=_held_elsewhere_and_waiters_a_list,
    ),
    Bad(
        "mutex fence is a hash",
        mutex_call("acquire"),
        ServerUnavailable,
        "fence holds a hash",
        setup=wrong_type(MUTEX + "fence", "hash"),
    ),
    Bad(
        "mutex fence is not a number",
        mutex_call("acquire"),
        ServerUnavailable,
        "not a number",
        setup=wrong_type(MUTEX + "fence", "abc"),
    ),
    Bad(
        "release when the owner key became a list",
        mutex_call("release"),
        ServerUnavailable,
        "owner holds a list",
        setup=holding(lambda r: RedisMutex(r, N)),
    ),
    Bad(
        "semaphore holders is a string",
        lambda r, ctx: RedisSemaphore(r, N, limit=2).acquire(),
        ServerUnavailable,
        "holders holds a string",
        setup=wrong_type(SEM + "holders", "string"),
    ),
    Bad(
        "semaphore limit is a list",
        lambda r, ctx: RedisSemaphore(r, N, limit=2).acquire(),
        ServerUnavailable,
        "limit holds a list",
        setup=wrong_type(SEM + "limit", "list"),
    ),
    Bad(
        "semaphore limit is not a number",
        lambda r, ctx: RedisSemaphore(r, N, limit=2).acquire(),
        ServerUnavailable,
        "not a number",
        setup=wrong_type(SEM + "limit", "two"),
    ),
    Bad(
        "semaphore fences is a zset",
        lambda r, ctx: RedisSemaphore(r, N, limit=2).acquire(),
        ServerUnavailable,
        "fences holds a zset",
        setup=wrong_type(SEM + "fences", "zset"),
    ),
    Bad(
        "set_limit when holders is a list",
        lambda r, ctx: RedisSemaphore(r, N, limit=2).set_limit(3),
        ServerUnavailable,
        "holders holds a list",
        setup=wrong_type(SEM + "holders", "list"),
    ),
    Bad(
        "rwlock writer is a list",
        lambda r, ctx: RedisReadWriteLock(r, N).write().acquire(),
        ServerUnavailable,
        "writer holds a list",
        setup=wrong_type(RW + "writer", "list"),
    ),
    Bad(
        "rwlock readers is a string",
        lambda r, ctx: RedisReadWriteLock(r, N).read().acquire(),
        ServerUnavailable,
        "readers holds a string",
        setup=wrong_type(RW + "readers", "string"),
    ),
]


@pytest.fixture
async def client(valkey_notify: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    made = redis.asyncio.Redis.from_url(valkey_notify.url)
    await made.flushall()
    try:
        yield made
    finally:
        await close_client(made)


@pytest.mark.parametrize("bad", CASES, ids=[bad.case for bad in CASES])
async def test_bad_input_is_refused_clearly_and_changes_nothing(
    client: redis.asyncio.Redis, bad: Bad
) -> None:
    ctx: dict[str, Any] = {}
    await (bad.setup or _nothing)(client, ctx)
    if bad.case == "release when the owner key became a list":
        # Someone overwrote the holder's key with a list after the grant.
        await client.delete(MUTEX + "owner")
        await wrong_type(MUTEX + "owner", "list")(client, ctx)
    before = await snapshot(client)
    with pytest.raises(bad.error) as raised:
        await bad.act(client, ctx)
    after = await snapshot(client)
    try:
        assert bad.says in str(raised.value), raised.value
        if isinstance(raised.value, LockError):
            assert raised.value.name == N or bad.case.startswith("lost")
        assert after == before  # byte for byte, expiries included
    finally:
        await (bad.cleanup or _nothing)(client, ctx)
    record("bad input (table-driven)", trials=1)  # each case (with xdist, on any worker)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 30
    record(
        "bad input (table-driven)",
        trials=0,
        note=f"{len(CASES)} cases, Redis unchanged (DUMP) in each",
    )
    assert len({bad.case for bad in CASES}) == len(CASES)


async def test_an_infinite_timeout_means_no_timeout(client: redis.asyncio.Redis) -> None:
    """Not bad input: like asyncio and anyio, `inf` waits forever (the same as None)."""
    mutex = RedisMutex(client, N, timeout=INF)
    async with mutex:
        assert await RedisMutex(client, N).acquire(blocking=False) is False
    assert await mutex.acquire(timeout=INF)
    await mutex.release()


async def test_a_client_closed_by_its_user_stays_closed_on_its_loop(
    client: redis.asyncio.Redis, valkey_notify: ServerProcess
) -> None:
    """Not bad input either: issue 40, a closed client stays closed. What was held is lost
    (never released on the closed client: its lease ends on the server by its ttl), and new
    work on it on this loop (an acquire, a campaign: a service's loop that campaigns again
    after its LockLost) fails with ClientClosed naming the client and the primitive, with
    no fresh engine (it made one, opened connections the user had just closed and armed
    timers past the loop's end; the scheduler example's exit flaked on that)."""
    mutex = RedisMutex(client, N, ttl=1)
    assert await mutex.acquire()
    waiting = [  # a task of its process waits in the process, one of another on the server
        asyncio.create_task(RedisMutex(client, N, local_handoff=handoff).acquire(timeout=8))
        for handoff in (None, 0)
    ]
    await asyncio.sleep(0.2)
    await client.aclose()
    assert mutex.lost.is_set()
    for wait in waiting:
        with pytest.raises(ClientClosed):
            await asyncio.wait_for(wait, 1)  # at once, not at its timeout
    with pytest.raises(LockLost):
        await mutex.release()
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: RedisMutex(client, N).acquire(blocking=False),
        lambda: RedisMutex(client, "other").acquire(timeout=1),
        lambda: RedisElection(client, "e").campaign("me").__aenter__(),
        lambda: RedisSemaphore(client, "s", limit=2).acquire(),
    ]
    for call in calls:
        with pytest.raises(ClientClosed) as refused:
            await call()
        assert _adapter.describe(client) in str(refused.value), refused.value
        assert f":{valkey_notify.port}," in str(refused.value)
        assert "closed by its user (aclose())" in str(refused.value)
    assert not _adapter.holds_connections(client)  # nothing opened on the closed client
    loop = asyncio.get_running_loop()
    armed = [
        timer
        for timer in getattr(loop, "_scheduled", ())
        if not timer.cancelled()
        and getattr(timer._callback, "__module__", "").startswith("aiolocks")
    ]
    assert armed == []
    async with redis.asyncio.Redis.from_url(valkey_notify.url) as other:
        assert await other.pttl(MUTEX + "owner") > 0  # left to its ttl, not released
