"""The engine bugs of issue 24, each reproduced against real servers (a proxy that drops or
delays a link, a stalled event loop, `CLIENT PAUSE`), and the items found by reading it.

1. a grant believed after a later server answer said the token was not the holder;
2. and 3. lived in carrying (a mutex's release queueing this client's later waiters), which
   is gone, with their tests;
4. `RedisMultiLock` keeping the mutex's bounds during a `CLIENT PAUSE`;
5. one failed `CONFIG GET` ending an acquisition the server had answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import pytest
import redis.asyncio
import redis.exceptions
from _faultreport import record
from _faults import aiolocks_keys, close_client, leftovers, make_sides
from _probes import QueueProbe
from _proxy import Proxy
from _servers import ServerProcess

from aiolocks import (
    LockLost,
    RedisElection,
    RedisMultiLock,
    RedisMutex,
    RedisSemaphore,
    ServerUnavailable,
    multilock,
)
from aiolocks._engine import _acquire, _release
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import LeasedLock
from aiolocks._scripts import Script
from aiolocks._transport import _runner
from aiolocks._transport._runner import AUTOPIPELINE_ENV
from aiolocks.election import _Candidacy

pytestmark = pytest.mark.faults

T = TypeVar("T")


class OtherLoop:
    """An event loop in a thread of its own: another process, as far as the engine can tell
    (its own clients, tasks and timers), that keeps running while the test's loop stalls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self.start(coro)), timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
async def other_loop() -> AsyncIterator[OtherLoop]:
    other = OtherLoop()
    try:
        yield other
    finally:
        other.stop()


def _lock(client: redis.asyncio.Redis, kind: str, name: str, ttl: float) -> LeasedLock:
    if kind == "multi":
        return RedisMultiLock(client, _multi_names(name), ttl=ttl)
    if kind == "election":
        return _Candidacy(client, name, "v", ttl=ttl, timeout=None, prefix="aiolocks", on_lost=None)
    if kind == "write":
        return make_sides(client, "rwlock", name, ttl=ttl)[1].lock
    return make_sides(client, kind, name, limit=1, ttl=ttl)[0].lock  # type: ignore[arg-type]


def _multi_names(name: str) -> list[str]:
    return [f"{name}-a", f"{name}-b"]


def _late_messages(client: redis.asyncio.Redis, delay: float) -> None:
    """Every grant message `client`'s notifier reads is delivered `delay` seconds late (a
    slow pub/sub link; commands are not delayed)."""
    notifier = context_for(client).notifier
    deliver = notifier._on_grant

    def late(wake: bytes, payload: bytes) -> None:
        asyncio.get_running_loop().call_later(delay, deliver, wake, payload)

    notifier._on_grant = late  # type: ignore[method-assign]


# -- 1. a grant believed after a later answer said "not the holder" -------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mutex", "semaphore", "write", "election"])
async def test_a_grant_older_than_a_queued_answer_is_not_believed(
    server: ServerProcess, other_loop: OtherLoop, kind: str
) -> None:
    """ttl 1 s. H (another process) releases to W while W's loop is stalled 1.5 s; W's
    pub/sub link is 0.3 s late. W's lease ends on the server unrenewed, X (queued behind W)
    gets the lock; W's re-check after the stall finds it queued again; then the old grant
    message arrives. Before: W's `acquire()` returned True with a fence below X's while X
    held. Now the message is dropped (its fence is at or below the queued answer's floor)
    and W gets the lock after X, with a higher fence."""
    name = f"stale-grant-{kind}"
    admin = redis.asyncio.Redis.from_url(server.url)
    await admin.flushall()
    mine = redis.asyncio.Redis.from_url(server.url)
    theirs: list[redis.asyncio.Redis] = []

    async def open_theirs() -> tuple[LeasedLock, LeasedLock]:
        theirs.append(redis.asyncio.Redis.from_url(server.url))
        return _lock(theirs[0], kind, name, 1.0), _lock(theirs[0], kind, name, 1.0)

    try:
        holder, other = await other_loop.run(open_theirs())
        assert await other_loop.run(holder.acquire())
        waiter = _lock(mine, kind, name, 1.0)
        probe = QueueProbe(mine)
        waiting = asyncio.create_task(waiter.acquire(timeout=15))
        await probe.wait_queued(1, 5)
        x_acquired = other_loop.start(other.acquire(timeout=15))  # queued behind W
        await asyncio.sleep(0.2)  # X's call is in (the queue order is W, X)
        _late_messages(mine, 0.3)
        released = other_loop.start(holder.release())  # grants W: published
        time.sleep(1.5)  # noqa: ASYNC251 (on purpose: W's loop stalls past its lease)
        await asyncio.wait_for(asyncio.wrap_future(released), 5)
        assert await asyncio.wait_for(asyncio.wrap_future(x_acquired), 5), "X not granted"
        x_fence = next(iter(other._holdings.values())).fence
        await asyncio.sleep(0.6)  # the old message arrived 0.3 s after the stall
        if waiting.done():
            got = waiting.result()
            fence = waiter._holdings[waiting].fence if got else None
            pytest.fail(f"W acquired ({got}, fence {fence}) while X holds (fence {x_fence})")
        await other_loop.run(other.release())  # adopted: X's acquiring task has ended
        assert await asyncio.wait_for(waiting, 10)
        w_fence = waiter._holdings[waiting].fence
        assert w_fence > x_fence, (w_fence, x_fence)
        await waiter.release()
        record("24.1 stale grant dropped", trials=1, note=f"{kind}: W after X, fences rise")
    finally:
        if theirs:
            await other_loop.run(close_client(theirs[0]))
        await close_client(mine)
        await admin.aclose()


async def _taken_at_once(later: RedisMutex | LeasedLock, report: str, note: str) -> None:
    """Another client's `later` takes the name at once (a departed token holds nothing) and
    gives it back; recorded under `report`, `note` followed by how long it waited."""
    started = time.monotonic()
    assert await later.acquire(timeout=8), "the departed acquisition kept it"
    waited = time.monotonic() - started
    await later.release()
    assert waited < 1.0, waited
    record(report, trials=1, recover=[waited], note=f"{note}next holder after {waited:.3f} s")


# -- its own call in flight when a waiter leaves ----------------------------------------------


@pytest.mark.parametrize(
    ("kind", "call"),
    [
        *(
            (kind, call)
            for kind in ("mutex", "semaphore", "write", "election")
            for call in ("try", "wait")
        ),
        ("multi", "try"),  # its one script for all names (queued, each name is a mutex)
    ],
)
@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_departed_acquisition_leaves_nothing_behind_its_call_in_flight(
    proxy: Proxy,
    direct: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    how: str,
    call: str,
) -> None:
    """Auto-pipelining off (as on Cluster), every primitive of the acquire skeleton and the
    multi-lock's one-script try: W's own acquire call is held back 0.5 s on its connection,
    and W leaves (cancelled, or its 0.1 s timeout) while it is in flight: its try call
    with the primitive free, or its queue call while another client's H holds it (H then
    releases). W's clean-up waits for that call's reply before it is sent. Before,
    it went at once on another connection and found nothing; the late call then granted W's
    token the free primitive, which it held for its whole ttl (5 s) while another client
    waited, or queued it: a phantom head (handed on when H's release granted it only
    because W's client was still subscribed and remembered the token, `WaitQueue.depart`)."""
    monkeypatch.setenv(AUTOPIPELINE_ENV, "0")
    delay = 0.5
    name = f"in-flight-{kind}-{how.replace(' ', '-')}-{call}"
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        lock = _lock(client, kind, name, ttl=5)
        assert await lock.acquire()  # loads the script: EVALSHA from now on
        await lock.release()
        holder = _lock(direct, kind, name, ttl=5)
        if call == "wait":
            assert await holder.acquire()
        sha, mode = lock._spec.acquire.sha.encode(), f"\r\n{call}\r\n".encode()  # its ARGV
        if kind == "multi":
            sha, mode = multilock._TRY_ALL.sha.encode(), b""
        held = proxy.delay_on(lambda data: sha in data and mode in data, delay)
        timeout = 0.1 if how == "timed out" else None
        waiting = asyncio.create_task(lock.acquire(timeout=timeout))
        await asyncio.wait_for(held.fired.wait(), 5)
        started = time.monotonic()
        if how == "cancelled":
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        else:
            assert await waiting is False
        left = time.monotonic() - started
        assert left < delay + 0.2, left  # its clean-up's bound: 5 s; a timeout's: + 50 ms
        await asyncio.wait_for(held.answered.wait(), 5)  # the server ran the late call
        await _background_done(5)
        family = {"write": "rwlock", "multi": "mutex"}.get(kind, kind)
        names = _multi_names(name) if kind == "multi" else [name]
        for each in names:
            parts = await aiolocks_keys(direct, family, each)
            assert not {"queue", "waiters"} & parts.keys(), parts  # no phantom queue entry
        if call == "wait":
            await holder.release()
        await _taken_at_once(
            _lock(direct, kind, name, ttl=5),
            "24 follow-up: departed acquisition, call in flight",
            f"{kind}, {how}, {call}: left after {left:.3f} s; ",
        )
        if kind != "election":  # keeps its candidates' register
            for each in names:
                assert await leftovers(direct, family, each) == {}
    finally:
        await close_client(client)


async def _cancelled_while_held_back(
    proxy: Proxy, match: Callable[[bytes], bool], call: Coroutine[Any, Any, Any]
) -> None:
    """Run `call` with the request that `match`es held back 0.5 s on its connection, cancel
    it meanwhile, and wait until the server has run that request and the clean-ups ended."""
    held = proxy.delay_on(match, 0.5)
    task = asyncio.create_task(call)
    await asyncio.wait_for(held.fired.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(held.answered.wait(), 5)  # the server ran the late call
    await _background_done(5)


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
async def test_an_adoption_cancelled_with_its_call_in_flight_leaves_nothing_behind(
    proxy: Proxy, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Auto-pipelining off: `adopt()`'s call (which moves the detached holding to a new
    token) is held back 0.5 s, and the adopting task is cancelled meanwhile. The give-back
    of the new token waits for that call's reply; before, it went first on another
    connection, and the late call then moved the holding to a token nobody had: held for
    its ttl (5 s) while another client waited."""
    monkeypatch.setenv(AUTOPIPELINE_ENV, "0")
    name = f"adopt-in-flight-{kind}"
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        lock = _lock(client, kind, name, ttl=5)
        assert await lock.acquire()
        await lock.adopt(lock.detach())  # loads the script: EVALSHA from now on
        await lock.release()
        assert await lock.acquire()
        handle = lock.detach()
        sha = lock._adopt_call()[0].sha.encode()
        await _cancelled_while_held_back(proxy, lambda data: sha in data, lock.adopt(handle))
        await _taken_at_once(
            _lock(direct, kind, name, ttl=5), "24 follow-up: cancelled adoption", f"{kind}: "
        )
    finally:
        await close_client(client)


@pytest.mark.parametrize("autopipe", ["on", "off"])
async def test_a_replication_check_cancelled_in_flight_leaves_nothing_behind(
    proxy: Proxy, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, autopipe: str
) -> None:
    """`replicas=1` on a server without replicas: the grant's confirmation (the acquire
    script again, then WAIT, on a pooled connection of its own even with auto-pipelining)
    is held back 0.5 s, and the acquiring task is cancelled meanwhile. The give-back waits
    for that call's reply; before, it went first on another connection and freed the
    mutex, and the late confirmation then granted it anew to the token nobody had: held for
    its ttl (5 s) while another client waited."""
    monkeypatch.setenv(AUTOPIPELINE_ENV, "1" if autopipe == "on" else "0")
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        name = f"replicated-in-flight-{autopipe}"
        lock = RedisMutex(client, name, ttl=5, replicas=1, replica_timeout=0.1)
        await _cancelled_while_held_back(proxy, lambda data: b"WAIT" in data, lock.acquire())
        await _taken_at_once(
            RedisMutex(direct, name, ttl=5), "24 follow-up: cancelled replication check", ""
        )
    finally:
        await close_client(client)


# -- by reading: an election grant delivered twice ------------------------------------------


@pytest.mark.parametrize("autopipe", ["on", "off"])
async def test_an_election_grant_read_twice_after_a_lost_release_reply_is_one_term(
    proxy: Proxy, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, autopipe: str
) -> None:
    """L resigns to C (same client); the resignation's reply is lost. C hears its election
    three ways: the message (an election publishes every grant), the re-check the lost reply
    causes, and the retry (which finds C leading: no grant). C leads once, for one term above
    L's; once C resigns nothing is left and a newcomer is elected at once. (Checked: the
    second delivery is dropped, `Waiter.grant` keeps the first; not a bug.)"""
    if autopipe == "off":
        monkeypatch.setenv(AUTOPIPELINE_ENV, "0")
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        election = RedisElection(client, "twice", ttl=5)
        leading, resign = asyncio.Event(), asyncio.Event()
        terms: list[int] = []

        async def lead(value: str) -> None:
            async with election.campaign(value, timeout=10) as term:
                terms.append(term.fencing_token)
                leading.set()
                await resign.wait()

        first = asyncio.create_task(lead("L"))
        await asyncio.wait_for(leading.wait(), 5)
        leading.clear()
        probe = QueueProbe(client)
        second = asyncio.create_task(lead("C"))
        await probe.wait_queued(1, 5)
        sha = election._probe._spec.release.sha.encode()
        drop = proxy.drop_on(lambda data: sha in data, "reply")
        resign.set()
        await asyncio.wait_for(first, 5)  # no LockLost: the retry finds it resigned
        assert drop.at is not None
        await asyncio.wait_for(second, 5)
        assert len(terms) == 2 and terms[1] > terms[0], terms
        info = await election.inspect()
        assert info.leader is None and info.candidates == 0, info
        resign.clear()
        leading.clear()
        third = asyncio.create_task(lead("D"))
        await asyncio.wait_for(leading.wait(), 2)
        resign.set()
        await third
        assert terms[2] > terms[1], terms
    finally:
        await close_client(client)


# -- by reading: one blackholed auto-pipeline link -----------------------------------------


@pytest.mark.parametrize("reads", ["direct", "reader task"])
async def test_a_blackholed_link_does_not_hold_every_script_call(
    proxy: Proxy, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, reads: str
) -> None:
    """A client without socket_timeout (redis-py 5-7's default; redis-py 8's connections
    default to 5 s); the connection its script calls share (the auto-pipeline's link) goes
    dead without a reset (nothing comes back, nothing fails); new connections work. Its
    calls go again on a new connection after STALL_BOUND (1 s here), whether the link's
    replies are parsed where they arrive or read by its task (connections that are not
    sockets, RESP3 without hiredis' push type). Before, every script call of the client
    waited on the dead link: a free mutex was not acquired within 5 s."""
    monkeypatch.setattr(_runner, "STALL_BOUND", 1.0)
    monkeypatch.setattr(_runner, "DIRECT_READS", reads == "direct")
    client = redis.asyncio.Redis.from_url(proxy.url, socket_timeout=None)
    try:
        lock = RedisMutex(client, "blackholed", ttl=5)
        assert await lock.acquire()  # the link is open (and stays: 5 s idle)
        await lock.release()
        assert proxy.blackhole_open() == 1
        started = time.monotonic()
        assert await lock.acquire(timeout=5), "the client's calls waited on the dead link"
        took = time.monotonic() - started
        assert took < 1.0 + 1.0, took
        await lock.release()
        record(
            "by reading: blackholed link", trials=1, recover=[took], note=f"{reads}: {took:.3f} s"
        )
    finally:
        await close_client(client)


# -- 4. the multi-lock's bounds during a CLIENT PAUSE -----------------------------------------


async def _background_done(timeout: float) -> None:
    """Wait (bounded) for the clean-ups left to finish in the background."""
    pending = list(_release._BACKGROUND)
    if pending:
        await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout)


@pytest.mark.slow
async def test_a_multi_lock_keeps_the_mutex_bounds_during_a_client_pause(
    server_factory: Any,
) -> None:
    """`CLIENT PAUSE 6000 ALL`, a client without socket_timeout. The bounds docs/mutex.md
    gives: release() of a ttl-1 holding raises LockLost within its validity + 0.3 s;
    acquire(timeout=0.5) returns False within 0.7 s; acquire(blocking=False) raises
    ServerUnavailable within TRY_BOUND + 0.2 s. Before: 6.1 s, 5.5 s, and True after 6.1 s.
    Once the pause ends, the background clean-ups leave nothing behind."""
    server: ServerProcess = server_factory(notify=False)
    client = redis.asyncio.Redis.from_url(server.url)
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        held = RedisMultiLock(client, ["pa", "pb"], ttl=1)
        assert await held.acquire()
        warm = RedisMultiLock(client, ["pc", "pd"], ttl=2)
        assert await warm.acquire()  # the scripts loaded, the link open
        await warm.release()
        await admin.execute_command("CLIENT", "PAUSE", 6000, "ALL")  # type: ignore[no-untyped-call]
        holding = held._current()
        assert holding is not None and holding.lease is not None
        valid_for = holding.lease.valid_until - time.monotonic()
        started = time.monotonic()
        with pytest.raises(LockLost):
            await held.release()
        released = time.monotonic() - started
        assert released <= max(valid_for, 0.0) + 0.3, (released, valid_for)

        started = time.monotonic()
        assert await RedisMultiLock(client, ["pc", "pd"], ttl=2).acquire(timeout=0.5) is False
        timed = time.monotonic() - started
        assert timed <= 0.5 + 0.2, timed

        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            await RedisMultiLock(client, ["pe", "pf"], ttl=2).acquire(blocking=False)
        tried = time.monotonic() - started
        assert tried <= _acquire.TRY_BOUND + 0.2, tried

        await _background_done(20)
        for name in ("pa", "pb", "pc", "pd", "pe", "pf"):
            assert await leftovers(admin, "mutex", name) == {}, name
            assert not await RedisMutex(admin, name).locked(), name
        record(
            "24.4 multi-lock under CLIENT PAUSE",
            trials=3,
            note=f"release {released:.3f} s (validity {valid_for:.3f} s), "
            f"acquire(timeout=0.5) {timed:.3f} s, blocking=False {tried:.3f} s",
        )
    finally:
        await close_client(client)
        await admin.aclose()


@pytest.mark.slow
async def test_a_multi_lock_grant_read_after_a_loop_stall_is_confirmed(
    r: redis.asyncio.Redis,
) -> None:
    """ttl 1 s; the loop stalls 2 s as the one-script try's reply is read (every name was
    free): past the leases. `acquire()` may return True only for leases the server holds.
    Before, it reported names whose leases the server had ended."""
    context = context_for(r)
    inner = context.run
    stalled: list[bool] = []

    async def run(
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        retry: bool = True,
        sent: Any = None,
    ) -> Any:
        reply = await inner(script, keys, args, retry=retry, sent=sent)
        if script is multilock._TRY_ALL and not stalled:
            stalled.append(True)
            time.sleep(2.0)  # noqa: ASYNC251 (on purpose: the loop stalls past the leases)
        return reply

    context.run = run  # type: ignore[method-assign]
    lock = RedisMultiLock(r, ["late-a", "late-b"], ttl=1)
    assert await lock.acquire(timeout=5)
    assert stalled
    holding = lock._current()
    assert holding is not None and holding.lease is not None
    for name in ("late-a", "late-b"):
        key = f"aiolocks:mutex:{{{name}}}:owner"
        owner = await r.get(key)
        assert owner == holding.token.encode(), f"{name}: the server had ended its lease"
        on_server = int(await r.pttl(key)) / 1000
        # Read after the server's answer: the local validity may only be shorter (1 ms of
        # PTTL's rounding), however long the round trips took on a loaded machine.
        remaining = holding.lease.remaining
        assert remaining <= on_server + 0.001, (name, remaining, on_server)
    await lock.release()
    record("24.4 multi-lock late grant", trials=1, note=f"confirmed: {remaining:.3f} s left")


# -- 5. one failed CONFIG GET ---------------------------------------------------------------


async def test_a_failed_config_get_does_not_end_a_queued_acquisition(
    proxy: Proxy, direct: redis.asyncio.Redis
) -> None:
    """The waiter's first try is answered (busy); the `CONFIG GET` its notifier sends before
    subscribing loses its connection. It waits on, as after a failed subscribe, and gets the
    lock when the holder releases. Before: `ServerUnavailable` at once."""
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        holder = RedisMutex(direct, "facts-lost", ttl=5)
        assert await holder.acquire()
        drop = proxy.drop_on(lambda data: b"notify-keyspace-events" in data, "request")
        waiter = RedisMutex(client, "facts-lost", ttl=5)
        waiting = asyncio.create_task(waiter.acquire(timeout=10))
        await asyncio.wait_for(drop.fired.wait(), 5)
        await asyncio.sleep(0.1)  # the waiter went on (or, before, failed)
        assert not waiting.done() or waiting.exception() is None, waiting.exception()
        released = time.monotonic()
        await holder.release()
        assert await asyncio.wait_for(waiting, 10)
        late = time.monotonic() - released
        await waiter.release()
        record("24.5 failed CONFIG GET", trials=1, recover=[late], note=f"granted {late:.3f} s")
    finally:
        await close_client(client)


# -- a release cancelled after its lease's validity ended --------------------------------------


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
async def test_a_release_cancelled_after_the_validity_ended_records_the_loss(
    r: redis.asyncio.Redis, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop stall outlasts the lease's validity, then the release is cancelled with its
    call in flight (found by the simulation, seed 1035). The keeper reports no loss of a
    lease being released and the cancelled release answered nothing: before, the loss was
    never recorded (the holding's `lost` never set, no count in `statistics()`)."""
    lock: LeasedLock = (
        RedisMutex(r, "cancel-late", ttl=1)
        if kind == "mutex"
        else RedisSemaphore(r, "cancel-late", limit=2, ttl=1)
    )
    context = context_for(r)
    run, sent = context.run, asyncio.Event()

    async def held_in_flight(script: Script, *args: Any, **options: Any) -> Any:
        if script is lock._spec.release:
            sent.set()
            await asyncio.sleep(0.2)  # on its way: the cancel comes before the answer
        return await run(script, *args, **options)

    monkeypatch.setattr(context, "run", held_in_flight)
    holdings = []

    async def hold() -> None:
        assert await lock.acquire()
        holdings.append(lock._current())
        time.sleep(1.2)  # noqa: ASYNC251 (the loop stalls past the validity: ttl 1 s)
        await lock.release()

    holder = asyncio.create_task(hold())
    await asyncio.wait_for(sent.wait(), 5)
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    (holding,) = holdings
    assert holding is not None and holding.lease is not None
    assert holding.lease.remaining <= 0
    assert holding.lost.is_set(), "a loss after the validity ended went unrecorded"
    assert holding.lost_reason is not None and "cancelled" in holding.lost_reason
    assert lock.statistics().leases_lost == 1


async def test_a_clean_up_under_way_when_its_client_is_closed_ends_first(
    proxy: Proxy, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40 item 3: a client its user closes stays closed, but what began before the
    close ends first. An acquisition times out while its call is in flight (held back by
    the link); its clean-up waits for that call's reply in the background, past the task's
    end; the user, having awaited the task, closes the client. Before, the close refused the
    clean-up's call: the late call had granted the departed token the free mutex, which
    it then held for its whole ttl."""
    monkeypatch.setenv(AUTOPIPELINE_ENV, "0")  # the clean-up waits for the call's reply
    name = "closed-under-a-clean-up"
    client = redis.asyncio.Redis.from_url(proxy.url)
    lock = RedisMutex(client, name, ttl=5, local_handoff=0)
    assert await lock.acquire()  # loads the script: EVALSHA from now on
    await lock.release()
    sha = lock._spec.acquire.sha.encode()
    held = proxy.delay_on(lambda data: sha in data and b"\r\ntry\r\n" in data, 0.3)
    assert await lock.acquire(timeout=0.1) is False  # before the late call's reply
    assert not held.answered.is_set()
    await client.aclose()
    closed_first = not held.answered.is_set()
    await asyncio.wait_for(held.answered.wait(), 5)  # the late call ran on the server
    assert await leftovers(direct, "mutex", name) == {}  # its grant was given back
    assert not closed_first  # the close waited for it, and for the clean-up after it


async def test_a_resign_under_way_when_its_client_is_closed_is_answered_first(
    proxy: Proxy, direct: redis.asyncio.Redis
) -> None:
    """Issue 40 item 3: a leader's resign begun before its client is closed, its call held
    back by the link, is answered before the close takes the connection: the resign
    returns (before, the close cut its reply off, its retry was refused and the resign
    raised ClientClosed), and the server has no leader."""
    client = redis.asyncio.Redis.from_url(proxy.url)
    election = RedisElection(client, "closed-under-a-resign", ttl=5)
    elected, resign = asyncio.Event(), asyncio.Event()

    async def lead() -> None:
        async with election.campaign("a"):
            elected.set()
            await resign.wait()

    leading = asyncio.create_task(lead())
    await asyncio.wait_for(elected.wait(), 5)
    sha = election._probe._spec.release.sha.encode()
    held = proxy.delay_on(lambda data: sha in data, 0.3)
    resign.set()
    await asyncio.wait_for(held.fired.wait(), 5)
    await client.aclose()
    await asyncio.wait_for(leading, 5)  # the resign was answered: no ClientClosed
    assert await RedisElection(direct, "closed-under-a-resign").leader() is None


async def test_a_subscription_begun_in_the_background_ends_with_its_client(
    valkey_notify: ServerProcess, direct: redis.asyncio.Redis
) -> None:
    """A cohort's first local waiter subscribes to its announcements in the background
    (`Notifier.retain_soon`), behind another subscription on the same link; its user closes
    the client meanwhile. Before, the background subscription went on after the close (a
    burst of 200 names did so in CI) and opened a pub/sub connection nobody closed: a
    socket left on the server, and a ResourceWarning at the next garbage collection."""
    name = "subscribed-as-closed"
    client = redis.asyncio.Redis.from_url(valkey_notify.url, client_name=name)
    notifier = context_for(client).notifier
    await notifier._server_facts()  # known from an earlier wait
    queued = b"aiolocks:{subscribed-as-closed}:queued"
    assert notifier.retain_soon(queued)
    async with notifier._channels[queued].link.lock:  # another subscription under way
        await asyncio.sleep(0)  # the background subscription waits for the link
        await asyncio.wait_for(client.aclose(), 5)
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=5)  # whatever the close left running has ended
    assert [c for c in await direct.client_list() if c.get("name") == name] == []
