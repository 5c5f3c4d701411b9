"""Auto-pipelining of the engine's script calls (`aiolocks/_transport/_runner.py`: the
pipeline, its link and the link's direct reads), on real servers.

Batches are counted by the engine (`AutoPipeline.batches_sent`, `commands_sent`) and by the
server (`INFO commandstats`, `CLIENT LIST`), never by timing. Faults on the link come from
the loopback proxy (`tests/_proxy.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from _proxy import Proxy
from _servers import command_count
from redis.asyncio.cluster import RedisCluster

from aiolocks import RedisMutex, ServerUnavailable
from aiolocks._base import _adapter
from aiolocks._engine._context import ClientContext, context_for
from aiolocks._scripts import Script
from aiolocks._transport import _runner
from aiolocks._transport._runner import AUTOPIPELINE_ENV, AutoPipeline

# Direct reads parse with hiredis; without it (a cell of `nox -s compat`) redis-py reads.
needs_hiredis = pytest.mark.skipif(
    not _runner.HIREDIS, reason="direct reads need hiredis, which is not installed"
)

NAME = "autopipe-test"  # the client name the tests' clients give their connections


def _script(name: str, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


# Echoes its argument, or fails with a script error when given "boom".
ECHO = _script("test_echo", "if ARGV[1] == 'boom' then return redis.error_reply('boom') end\n"
                            "return ARGV[1]")  # fmt: skip
# Not idempotent on purpose: how often it ran shows in the key.
INCR = _script("test_incr", "return redis.call('INCR', KEYS[1])")


def _pipe(context: ClientContext) -> AutoPipeline:
    assert context.autopipe is not None, "auto-pipelining is on by default"
    return context.autopipe


async def _connections(admin: redis.asyncio.Redis, name: str = NAME) -> int:
    """Connections the server has open for clients named `name`."""
    return sum(1 for entry in await admin.client_list() if entry.get("name") == name)


async def _warm_up(client: redis.asyncio.Redis) -> None:
    """Have the server cache the mutex's scripts (the first use is NOSCRIPT, then EVAL)."""
    async with RedisMutex(client, "ap:warm-up"):
        pass


@pytest.fixture
async def named(url: str) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(url, client_name=NAME)
    try:
        yield client
    finally:
        await client.aclose()


async def test_calls_made_in_one_loop_iteration_go_out_as_one_pipeline(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    context = context_for(named)
    await context.run(ECHO, (), ("warm-up",))  # NOSCRIPT, then EVAL: the script is cached
    trips, sent = _pipe(context).batches_sent, context.commands_sent
    before = await command_count(r, ["evalsha"])

    replies = await asyncio.gather(*(context.run(ECHO, (), (f"v{i}",)) for i in range(100)))

    assert replies == [f"v{i}".encode() for i in range(100)]
    assert _pipe(context).batches_sent - trips == 1
    assert context.commands_sent - sent == 100
    assert await command_count(r, ["evalsha"]) - before == 100
    assert await _connections(r) == 1  # one connection carried all of them


async def test_a_burst_of_acquisitions_is_a_few_batches_on_one_connection(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    mutexes = [RedisMutex(named, f"ap:{i}", ttl=30) for i in range(200)]
    await _warm_up(named)
    context = context_for(named)
    trips = _pipe(context).batches_sent

    assert all(await asyncio.gather(*(m.acquire(blocking=False) for m in mutexes)))
    assert _pipe(context).batches_sent - trips == 1
    await asyncio.gather(*(m.release() for m in mutexes))
    assert _pipe(context).batches_sent - trips == 2
    assert [m for m in mutexes if await m.locked()] == []


async def test_a_script_error_fails_only_its_own_call(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    context = context_for(named)
    await context.run(ECHO, (), ("warm-up",))
    trips = _pipe(context).batches_sent
    args = ["a", "b", "boom", "c", "boom", "d"]

    replies = await asyncio.gather(
        *(context.run(ECHO, (), (arg,)) for arg in args), return_exceptions=True
    )

    assert _pipe(context).batches_sent - trips == 1
    for arg, reply in zip(args, replies, strict=True):
        if arg == "boom":
            assert isinstance(reply, redis.exceptions.ResponseError) and "boom" in str(reply)
        else:
            assert reply == arg.encode()


async def test_a_primitive_with_a_broken_key_fails_alone(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    """A key of the wrong type fails that acquisition (naming the key); the other
    acquisitions of the same batch succeed."""
    await r.hset("aiolocks:mutex:{ap:bad}:owner", "not", "a string")
    names = ["ap:a", "ap:b", "ap:bad", "ap:c"]
    mutexes = [RedisMutex(named, name, ttl=30) for name in names]

    outcomes = await asyncio.gather(
        *(m.acquire(blocking=False) for m in mutexes), return_exceptions=True
    )

    assert outcomes[0] is True and outcomes[1] is True and outcomes[3] is True
    assert isinstance(outcomes[2], ServerUnavailable), outcomes[2]
    assert "aiolocks:mutex:{ap:bad}:owner" in str(outcomes[2])
    for mutex in (mutexes[0], mutexes[1], mutexes[3]):
        await mutex.release()


async def test_noscript_is_answered_by_eval_for_those_calls_only(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    """After SCRIPT FLUSH, in one batch: the calls of the script the server knows again
    succeed at once; the others are answered NOSCRIPT and sent once more, by EVAL."""
    context = context_for(named)
    await context.run(ECHO, (), ("warm-up",))
    await r.script_flush()
    await r.script_load(INCR.source)  # known again; ECHO is not
    trips, sent = _pipe(context).batches_sent, context.commands_sent
    evals = await command_count(r, ["eval"])

    calls = [
        context.run(ECHO, (), (f"e{i}",)) if i % 2 else context.run(INCR, (b"ap:n",), ())
        for i in range(20)
    ]
    replies = await asyncio.gather(*calls)

    assert [reply for i, reply in enumerate(replies) if i % 2] == [
        f"e{i}".encode() for i in range(1, 20, 2)
    ]
    assert sorted(reply for i, reply in enumerate(replies) if i % 2 == 0) == list(range(1, 11))
    assert _pipe(context).batches_sent - trips == 2  # the batch, then the EVALs
    assert context.commands_sent - sent == 30
    assert await command_count(r, ["eval"]) - evals == 10


async def test_a_caller_cancelled_before_its_batch_is_written_is_not_sent(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    context = context_for(named)
    await context.run(INCR, (b"ap:warm",), ())
    sent = context.commands_sent
    tasks = [asyncio.create_task(context.run(INCR, (f"ap:{i}".encode(),), ())) for i in range(10)]
    await asyncio.sleep(0)  # every task has queued its call; the writer runs after us
    tasks[3].cancel()

    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    assert isinstance(outcomes[3], asyncio.CancelledError)
    assert [outcome for i, outcome in enumerate(outcomes) if i != 3] == [1] * 9
    assert context.commands_sent - sent == 9
    assert await r.exists("ap:3") == 0


# ----------------------------------------------------------------------- through a proxy


@pytest.fixture
async def proxied(proxy: Proxy) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        yield client
    finally:
        for context in list(getattr(client, "_aiolocks_contexts", {}).values()):
            await context.aclose()
        await client.aclose()


def _written(pipe: AutoPipeline) -> asyncio.Event:
    """Set once the next batch is being written (the engine counts it just before)."""
    written = asyncio.Event()
    count = pipe._count

    def sent(commands: int) -> None:
        count(commands)
        written.set()

    pipe._count = sent  # type: ignore[method-assign]
    return written


async def test_a_caller_cancelled_mid_batch_leaves_the_others_their_replies(
    proxy: Proxy, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    """The batch is on the wire (the proxy holds it back) when one caller is cancelled: the
    server still runs its call, the others get their own replies, and the link stays in
    step (the next call gets its own reply, not the cancelled one's)."""
    context = context_for(proxied)
    await context.run(INCR, (b"ap:warm",), ())
    written = _written(_pipe(context))
    proxy.stall()
    tasks = [asyncio.create_task(context.run(INCR, (f"ap:{i}".encode(),), ())) for i in range(10)]
    await asyncio.wait_for(written.wait(), 5)
    tasks[4].cancel()
    proxy.resume()

    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    assert isinstance(outcomes[4], asyncio.CancelledError)
    assert [outcome for i, outcome in enumerate(outcomes) if i != 4] == [1] * 9
    assert await direct.get("ap:4") == b"1"  # it was sent, and ran
    assert await context.run(INCR, (b"ap:4",), ()) == 2
    assert await context.run(ECHO, (), ("in step",)) == b"in step"


async def test_cancelled_acquisitions_mid_batch_leave_nothing_behind(
    proxy: Proxy, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    """Acquisitions cancelled while their batch is on the wire: each one's clean-up release
    goes on the same connection, after its acquire, so it finds and undoes it."""
    mutexes = [RedisMutex(proxied, f"ap:c{i}", ttl=30) for i in range(10)]
    await _warm_up(proxied)
    written = _written(_pipe(context_for(proxied)))
    proxy.stall()
    tasks = [asyncio.create_task(m.acquire(timeout=10)) for m in mutexes]
    await asyncio.wait_for(written.wait(), 5)
    for task in tasks[::2]:
        task.cancel()
    proxy.resume()

    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    for index, outcome in enumerate(outcomes):
        if index % 2:
            assert outcome is True
        else:
            assert isinstance(outcome, asyncio.CancelledError)
    for index, mutex in enumerate(mutexes):
        assert await mutex.locked() == bool(index % 2)
        if index % 2:
            await mutex.release()
    assert [key async for key in direct.scan_iter("aiolocks:*:owner")] == []


@pytest.mark.parametrize("point", ["request", "reply"])
async def test_a_dropped_connection_resends_a_batch_once_for_the_calls_that_allow_it(
    proxy: Proxy, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis, point: str
) -> None:
    """The connection drops under a batch, before the server saw it ("request") or after
    it ran it ("reply"). Calls with `retry` go once more, on a new connection (INCR shows
    whether they ran twice); calls without fail with the connection error."""
    context = context_for(proxied)
    await context.run(INCR, (b"ap:warm",), ())
    connections = proxy.connections
    dropped = proxy.drop_on(lambda data: INCR.sha.encode() in data and b"ap:r0" in data, point)

    outcomes = await asyncio.gather(
        *(context.run(INCR, (f"ap:r{i}".encode(),), (), retry=i % 2 == 0) for i in range(6)),
        return_exceptions=True,
    )

    assert dropped.fired.is_set()
    ran_before = 1 if point == "reply" else 0
    for index, outcome in enumerate(outcomes):
        if index % 2 == 0:
            assert outcome == ran_before + 1
        else:
            assert isinstance(outcome, redis.exceptions.ConnectionError), outcome
        stored = await direct.get(f"ap:r{index}")
        assert int(stored or 0) == ran_before + (index % 2 == 0)
    assert proxy.connections == connections + 1  # the batch went again on a new one
    assert await context.run(ECHO, (), ("after",)) == b"after"


# --------------------------------------------------------------------------- connections


@pytest.mark.slow
async def test_a_burst_of_2000_acquisitions_over_200_names_uses_few_connections(
    r: redis.asyncio.Redis, named: redis.asyncio.Redis
) -> None:
    """Every task asks at once; the first per name holds until every name is held, then
    everything drains. The client opens its auto-pipeline link and its pub/sub
    connection (the lease keeper maybe one more), not one per command in flight."""
    names, tasks = 200, 2000
    opened_before = int((await r.info("stats"))["total_connections_received"])
    every_name_held = asyncio.Event()
    drain = asyncio.Event()
    holding: list[int] = []

    async def body(index: int) -> None:
        async with RedisMutex(named, f"ap:burst:{index % names}", ttl=30, timeout=60):
            if not drain.is_set():
                holding.append(index)
                if len(holding) == names:
                    every_name_held.set()
                await drain.wait()

    running = asyncio.gather(*(body(i) for i in range(tasks)))
    await asyncio.wait_for(every_name_held.wait(), 60)
    at_peak = await _connections(r)
    drain.set()
    await asyncio.wait_for(running, 120)

    opened = int((await r.info("stats"))["total_connections_received"]) - opened_before
    assert at_peak <= 3, at_peak
    assert opened <= 3 + 2, opened  # r's own INFO / CLIENT LIST connection may be new too
    assert await _connections(r) <= 3


@needs_hiredis
async def test_an_idle_link_gives_its_connection_back(
    named: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As redis-py left it: the transport gets the connection's own protocol back, and
    redis-py reads that connection again."""
    monkeypatch.setattr(_runner, "IDLE_S", 0.05)
    context = context_for(named)
    assert await context.run(ECHO, (), ("x",)) == b"x"
    link = _pipe(context)._link
    assert link is not None and link.reader is not None and link.transport is not None
    own = _replies_protocol(_pipe(context)).inner
    engine: Any = context.engine  # the engine's own connections (`_adapter.engine_client`)
    pool = engine.connection_pool
    assert link.connection in pool._in_use_connections
    await asyncio.wait_for(link.reader, 5)
    assert _pipe(context)._link is None
    assert link.transport.get_protocol() is own
    assert link.connection in pool._available_connections
    assert await named.echo("through redis-py") == b"through redis-py"  # that connection
    assert link.connection in pool._available_connections
    assert await context.run(ECHO, (), ("y",)) == b"y"  # a new link from the pool


async def test_off_switch_sends_each_call_on_its_own(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(AUTOPIPELINE_ENV, "0")
    client = redis.asyncio.Redis.from_url(url)
    try:
        context = context_for(client)
        assert context.autopipe is None
        mutexes = [RedisMutex(client, f"ap:off:{i}", ttl=30) for i in range(20)]
        assert all(await asyncio.gather(*(m.acquire(blocking=False) for m in mutexes)))
        await asyncio.gather(*(m.release() for m in mutexes))
    finally:
        await client.aclose()


async def test_cluster_clients_keep_the_per_command_path(cluster_r: RedisCluster) -> None:
    """redis-py routes each command of a `RedisCluster` to its slot's node (and follows
    MOVED / ASK): the engine leaves that to it."""
    context = context_for(cluster_r)
    assert context.autopipe is None
    mutexes = [RedisMutex(cluster_r, f"ap:cluster:{i}", ttl=30) for i in range(30)]
    outcomes: list[Any] = await asyncio.gather(*(m.acquire(blocking=False) for m in mutexes))
    assert all(outcomes)
    await asyncio.gather(*(m.release() for m in mutexes))


# --------------------------------------------------------------------------- direct reads


def _replies_protocol(pipe: AutoPipeline) -> Any:
    link = pipe._link
    assert link is not None and link.transport is not None
    return link.transport.get_protocol()


@needs_hiredis
@pytest.mark.parametrize("protocol", [2, 3])
@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
async def test_replies_are_parsed_where_they_arrive(url: str, protocol: int, decode: bool) -> None:
    """On a socket the link's replies are parsed in its transport's callback (RESP2 and
    RESP3, bytes or decoded), each caller answered with its own reply or error, in order;
    a NOSCRIPT is answered by EVAL on the same link."""
    client = redis.asyncio.Redis.from_url(url, protocol=protocol, decode_responses=decode)
    try:
        context = context_for(client)
        fresh = _script("test_fresh", f"return 'fresh-{protocol}-{decode}'")  # not cached
        replies = await asyncio.gather(
            *(context.run(ECHO, (), (f"v{i}",)) for i in range(50)),
            context.run(ECHO, (), ("boom",)),
            context.run(fresh, (), ()),
            return_exceptions=True,
        )
        assert isinstance(_replies_protocol(_pipe(context)), _runner.Replies)
        expected = [f"v{i}" if decode else f"v{i}".encode() for i in range(50)]
        assert replies[:50] == expected
        assert isinstance(replies[50], redis.exceptions.ResponseError)
        assert "boom" in str(replies[50])
        fresh_reply = f"fresh-{protocol}-{decode}"
        assert replies[51] == (fresh_reply if decode else fresh_reply.encode())
    finally:
        await client.aclose()


class _Fed:
    """A hiredis reader whose `feed` is observed."""

    def __init__(self, reader: Any, feed: Any) -> None:
        self._reader = reader
        self.feed = feed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


@needs_hiredis
async def test_a_resp3_push_on_the_link_answers_no_call(url: str, r: redis.asyncio.Redis) -> None:
    """A push (here: a client-tracking invalidation) arriving between replies is not
    taken for the reply of the call in flight."""
    client = redis.asyncio.Redis.from_url(url, protocol=3)
    try:
        # The connection the link will take: tracking on, and a key read (so tracked).
        await r.set("ap:tracked", "first")
        context = context_for(client)
        engine: Any = context.engine  # the engine's own connections (`_adapter.engine_client`)
        pool = engine.connection_pool
        connection = await _adapter.pooled_connection(pool)
        await connection.send_command("CLIENT", "TRACKING", "ON")
        assert await connection.read_response() in (b"OK", "OK")
        await connection.send_command("GET", "ap:tracked")
        await connection.read_response()
        await pool.release(connection)
        assert await context.run(ECHO, (), ("before",)) == b"before"
        link = _pipe(context)._link
        assert link is not None and link.connection is connection
        pushed = asyncio.Event()
        feed = link.parser.feed

        def fed(data: bytes) -> None:
            feed(data)
            if b"invalidate" in data:
                pushed.set()

        link.parser = _Fed(link.parser, fed)
        await r.set("ap:tracked", "changed")  # the server pushes an invalidation to the link
        await asyncio.wait_for(pushed.wait(), 5)
        replies = await asyncio.gather(*(context.run(ECHO, (), (f"a{i}",)) for i in range(20)))
        assert replies == [f"a{i}".encode() for i in range(20)]
        assert _pipe(context)._link is link  # not broken by it
    finally:
        await client.aclose()


async def test_a_stalled_direct_link_fails_its_calls_after_socket_timeout(
    proxy: Proxy, direct: redis.asyncio.Redis
) -> None:
    """No reply within the client's socket_timeout breaks the link, as redis-py's read
    would: a call that may not be sent again fails with TimeoutError, one that may goes
    again on a new connection once the server answers."""
    client = redis.asyncio.Redis.from_url(proxy.url, socket_timeout=0.3)
    try:
        context = context_for(client)
        assert await context.run(ECHO, (), ("warm",)) == b"warm"
        connections = proxy.connections
        proxy.stall()
        loop = asyncio.get_running_loop()
        started = loop.time()
        once = asyncio.ensure_future(context.run(INCR, (b"ap:once",), (), retry=False))
        with pytest.raises(redis.exceptions.TimeoutError):
            await asyncio.wait_for(once, 5)
        # uvloop's clock counts whole milliseconds: 0.3 s may read as 0.2999...
        assert 0.299 <= loop.time() - started < 3.0
        proxy.resume()
        assert await asyncio.wait_for(context.run(ECHO, (), ("after",)), 5) == b"after"
        assert proxy.connections == connections + 1  # a new link
    finally:
        for context in list(getattr(client, "_aiolocks_contexts", {}).values()):
            await context.aclose()
        await client.aclose()


async def test_the_redis_py_reader_still_serves_when_direct_reads_are_off(
    named: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_runner, "DIRECT_READS", False)
    context = context_for(named)
    replies = await asyncio.gather(
        *(context.run(ECHO, (), (f"v{i}",)) for i in range(20)),
        context.run(ECHO, (), ("boom",)),
        return_exceptions=True,
    )
    assert replies[:20] == [f"v{i}".encode() for i in range(20)]
    assert isinstance(replies[20], redis.exceptions.ResponseError)
    link = _pipe(context)._link
    assert link is not None and link.parser is None
    writer = link.connection._writer
    assert writer is not None
    assert not isinstance(writer.transport.get_protocol(), _runner.Replies)
