"""Engine edge cases of issue 13, section 3, each on real servers (keyspace notifications on
and off where it matters):

1. a grant to a waiter of the same client whose release reply was lost (a dropped
   connection, a cancelled release, `set_limit`) wakes it at once;
2. a grant read late (a stalled event loop) is never reported as a lease the server ended;
3. a semaphore's head waiter wakes at the earliest lease end, not the newest grant's;
4. channels that leave together leave no stale confirmation behind (nor a subscription);
5. `set_limit()` while a task of the same instance is between its try and its wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from _faultreport import record
from _faults import close_client, make_sides
from _probes import QueueProbe
from _proxy import Proxy
from _servers import ServerProcess

from aiolocks import LockLost, RedisMutex, RedisSemaphore
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import LeasedLock
from aiolocks._waiting import _notifier as notifier_module
from aiolocks._waiting._waitqueue import WaitQueue
from aiolocks.mutex import _RELEASE as MUTEX_RELEASE
from aiolocks.semaphore import _ACQUIRE as SEM_ACQUIRE
from aiolocks.semaphore import _SET_LIMIT

pytestmark = pytest.mark.faults

WAKE_BOUND = 0.2  # 3.1: the waiter holds within 0.2 s of the release reaching the server
TIMER_BOUND = 0.3  # 3.3: woken within 0.3 s of the earliest lease end


def _sha_match(sha: str) -> Any:
    needle = sha.encode()
    return lambda data: needle in data


# -- 3.1 a lost release reply ---------------------------------------------------------------


@pytest.fixture(params=["valkey-notify", "valkey-plain"])
async def any_proxy(
    request: pytest.FixtureRequest, server_pool: Any
) -> AsyncIterator[tuple[Proxy, redis.asyncio.Redis]]:
    """A proxy in front of a server with keyspace notifications on or off (with them, a
    mutex hand-off's `del` event wakes the head waiter anyway), and a direct client."""
    server: ServerProcess = server_pool.get(request.param)
    proxy = await Proxy(server.port).start()
    direct = redis.asyncio.Redis.from_url(server.url)
    await direct.flushall()
    try:
        yield proxy, direct
    finally:
        await proxy.aclose()
        await close_client(direct)


@pytest.mark.parametrize("how", ["dropped", "cancelled"])
async def test_a_same_client_grant_whose_release_reply_was_lost_wakes_the_waiter(
    any_proxy: tuple[Proxy, redis.asyncio.Redis], how: str
) -> None:
    """Holder and waiter share a client (grants to it are not published); the release's
    reply is lost. ttl 9 s: without a re-check the waiter slept until its heartbeat (3 s)."""
    proxy, direct = any_proxy
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        name = f"lost-reply-{how}"
        # Strict FIFO: the waiter queued on the server, granted by the release script.
        holder = RedisMutex(client, name, ttl=9, local_handoff=0)
        waiter = RedisMutex(client, name, ttl=9, local_handoff=0)
        held, go = asyncio.Event(), asyncio.Event()

        async def hold() -> None:
            assert await holder.acquire()
            held.set()
            await go.wait()
            await holder.release()

        holding = asyncio.create_task(hold())
        await asyncio.wait_for(held.wait(), 5)
        probe = QueueProbe(client)
        waiting = asyncio.create_task(waiter.acquire(timeout=20))
        await probe.wait_queued(1, 5)
        if how == "dropped":
            drop = proxy.drop_on(_sha_match(MUTEX_RELEASE.sha), "reply")
            go.set()
            await holding  # the retry answers "not held"; the first call released
            assert drop.at is not None
            reached = drop.at  # the reply came back: the server had run it
        else:
            proxy.latency = 0.05
            go.set()
            await asyncio.sleep(0.02)  # written, not yet run on the server
            holding.cancel()
            with pytest.raises(asyncio.CancelledError):
                await holding
            reached = time.monotonic()  # the server ran it by now (latency 50 ms)
        assert await asyncio.wait_for(waiting, 10)
        late = time.monotonic() - reached
        assert late <= WAKE_BOUND, late
        assert await direct.get(f"aiolocks:mutex:{{{name}}}:owner") is not None
        await waiter.release()
        record(
            "13 edges: lost release reply", trials=1, recover=[late], note=f"{how}: {late:.3f} s"
        )
    finally:
        proxy.latency = 0.0
        await close_client(client)


async def test_a_set_limit_whose_reply_was_lost_wakes_the_waiter(
    any_proxy: tuple[Proxy, redis.asyncio.Redis],
) -> None:
    proxy = any_proxy[0]
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        sem = RedisSemaphore(client, "lost-set-limit", limit=1, ttl=9)
        assert await sem.acquire()
        probe = QueueProbe(client)
        other = RedisSemaphore(client, "lost-set-limit", limit=1, ttl=9)
        waiting = asyncio.create_task(other.acquire(timeout=20))
        await probe.wait_queued(1, 5)
        drop = proxy.drop_on(_sha_match(_SET_LIMIT.sha), "reply")
        await sem.set_limit(2)  # sent again after the drop: that reply has no grant
        assert drop.at is not None
        assert await asyncio.wait_for(waiting, 10)
        late = time.monotonic() - drop.at
        assert late <= WAKE_BOUND, late
        await sem.release()
        other._spec = other._make_spec()
        record(
            "13 edges: lost release reply",
            trials=1,
            recover=[late],
            note=f"set_limit: {late:.3f} s",
        )
    finally:
        await close_client(client)


# -- 3.2 a grant read late ------------------------------------------------------------------


def _side(client: redis.asyncio.Redis, kind: str, name: str, **options: Any) -> LeasedLock:
    if kind == "write":
        return make_sides(client, "rwlock", name, **options)[1].lock
    if kind == "mutex":  # strict FIFO: the grant by the server's queue, to either client
        options["local_handoff"] = 0
    return make_sides(client, kind, name, limit=1, **options)[0].lock  # type: ignore[arg-type]


async def _server_holds(client: redis.asyncio.Redis, kind: str, name: str, token: str) -> float:
    """Seconds the server still holds `token`'s lease on `name` (0: it does not)."""
    if kind in ("mutex", "write"):
        key = f"aiolocks:{'mutex' if kind == 'mutex' else 'rwlock'}:{{{name}}}:"
        key += "owner" if kind == "mutex" else "writer"
        owner = await client.get(key)
        if owner is None or owner != token.encode():
            return 0.0
        return max(0, int(await client.pttl(key))) / 1000
    score = await client.zscore(f"aiolocks:semaphore:{{{name}}}:holders", token)
    if score is None:
        return 0.0
    seconds, micros = await client.time()
    return max(0.0, (score - (seconds * 1000 + micros / 1000)) / 1000)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mutex", "semaphore", "write"])
@pytest.mark.parametrize("via", ["message", "reply"])
async def test_a_grant_read_after_a_loop_stall_is_confirmed_with_the_server(
    server: ServerProcess, kind: str, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ttl 1 s; the waiter's loop stalls 2 s between the grant and reading it (a grant
    message from another client, or a release reply of its own client). `acquire()` may
    return True only for a lease the server still holds, and `lease_remaining` must not
    exceed what the server has left."""
    clients = [redis.asyncio.Redis.from_url(server.url) for _ in range(2)]
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        await admin.flushall()
        name = f"late-grant-{kind}-{via}"
        holder = _side(clients[0 if via == "message" else 1], kind, name, ttl=1.0)
        waiter = _side(clients[1], kind, name, ttl=1.0)
        assert await holder.acquire()
        probe = QueueProbe(clients[1])
        waiting = asyncio.create_task(waiter.acquire(timeout=10))
        await probe.wait_queued(1, 5)
        # The loop stalls 2 s just as the grant is delivered (read from the message, or from
        # the release reply): past the lease, nothing else runs meanwhile.
        target = context_for(clients[1]).waitqueue
        deliver = WaitQueue.unpark
        stalled: list[str] = []

        def stalled_unpark(
            self: WaitQueue,
            token: str,
            fence: int,
            after: float | None = None,
            channel: bytes | None = None,
        ) -> bool:
            if self is target and not stalled:
                stalled.append(token)
                time.sleep(2.0)
            return deliver(self, token, fence, after, channel)

        monkeypatch.setattr(WaitQueue, "unpark", stalled_unpark)
        with contextlib.suppress(LockLost):
            # Through the stall, the holder's own release may be answered after its lease's
            # validity (the same loop stalls): a loss it must report then.
            await holder.release()  # grants the waiter (published, or in this reply)
        assert await asyncio.wait_for(waiting, 10)
        assert stalled, "the grant was never delivered to the waiter's queue"
        holding = waiter._holdings[waiting]
        assert holding.lease is not None
        remaining = holding.lease.remaining
        on_server = await _server_holds(admin, kind, name, holding.token)
        assert on_server > 0, "acquire() returned True for a lease the server had ended"
        assert remaining <= on_server + 0.05, (remaining, on_server)
        record(
            "13 edges: grant read after a loop stall",
            trials=1,
            note=f"{kind} via {via}: lease_remaining {remaining:.3f} s, server {on_server:.3f} s",
        )
        await waiter.release()
    finally:
        for client in clients:
            await close_client(client)
        await admin.aclose()


# -- 3.3 the head waiter's timer ------------------------------------------------------------


@pytest.mark.slow
async def test_a_semaphore_waiter_wakes_at_the_earliest_lease_end(
    server: ServerProcess,
) -> None:
    """limit 2: a crashed holder (ttl 1.5 s, never renewed) and a live one (ttl 5 s) hold;
    two waiters queue; the live holder releases, and its permit goes to the first waiter by
    message (ttl 5 s). The second must get the crashed holder's permit within 0.3 s of that
    lease's end, not a whole 5 s lease later."""
    clients = [redis.asyncio.Redis.from_url(server.url) for _ in range(3)]
    try:
        await clients[0].flushall()
        name = "earliest-end"
        crashed = RedisSemaphore(clients[2], name, limit=2, ttl=5)
        context = context_for(clients[2])
        sent = time.monotonic()
        member = context.waitqueue.member("crashed0000", 1500, "x")
        reply = await context.run(
            SEM_ACQUIRE, crashed._spec.keys, (member, "try", crashed._spec.channel, 2)
        )
        assert int(reply[0]) == 1
        crash_end = sent + 1.5  # the server's lease ends no earlier than this
        live = RedisSemaphore(clients[0], name, limit=2, ttl=5)
        assert await live.acquire()
        probe = QueueProbe(clients[1])
        first = RedisSemaphore(clients[1], name, limit=2, ttl=5)
        second = RedisSemaphore(clients[1], name, limit=2, ttl=5)
        got_first = asyncio.create_task(first.acquire(timeout=10))
        await probe.wait_queued(1, 5)
        got_second = asyncio.create_task(second.acquire(timeout=10))
        await probe.wait_queued(2, 5)
        await live.release()
        assert await asyncio.wait_for(got_first, 5)
        assert await asyncio.wait_for(got_second, 10)
        late = time.monotonic() - crash_end
        assert late <= TIMER_BOUND, late
        record(
            "13 edges: semaphore head timer",
            trials=1,
            recover=[late],
            note=f"{server.kind} notify={server.notify}: {late:.3f} s after the crashed lease",
        )
    finally:
        for client in clients:
            await close_client(client)


# -- 3.4 channels leaving together ----------------------------------------------------------


async def test_channels_that_leave_together_leave_no_stale_confirmation(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notifier_module, "_LINGER", 0.05)
    client = redis.asyncio.Redis.from_url(server.url)
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        await admin.flushall()
        context = context_for(client)
        notifier = context.notifier
        subscriptions = notifier
        channels = [f"aiolocks:mutex:{{leave-{i}}}:wake".encode() for i in range(20)]
        for channel in channels:
            await notifier.retain(channel, None)
        gone = asyncio.Event()
        original = subscriptions._forget

        def forget(channel: Any) -> None:
            original(channel)
            if not subscriptions._channels:
                gone.set()

        monkeypatch.setattr(subscriptions, "_forget", forget)
        for channel in channels:
            notifier.release(channel)
        await asyncio.wait_for(gone.wait(), 5)
        # The reader ends once nothing is routed to it and (with the fix) every
        # unsubscription it sent is confirmed.
        reader = subscriptions._links[""].reader
        if reader is not None:
            await asyncio.wait_for(asyncio.shield(reader), 5)
        started = time.monotonic()
        await notifier.retain(channels[3], None)
        took = time.monotonic() - started
        assert took < 0.5, took  # the confirmation bound is 1 s
        assert notifier.watching(channels[3])
        counts = await admin.execute_command("PUBSUB", "SHARDNUMSUB", *channels)  # type: ignore[no-untyped-call]
        plain = await admin.execute_command("PUBSUB", "NUMSUB", *channels)  # type: ignore[no-untyped-call]
        subscribed = {
            channel: int(a) + int(b)
            for channel, a, b in zip(channels, counts[1::2], plain[1::2], strict=True)
        }
        assert subscribed == {channel: int(channel == channels[3]) for channel in channels}
        notifier.release(channels[3])
        record("13 edges: channels leaving together", trials=1, note=f"re-subscribe {took:.3f} s")
    finally:
        await close_client(client)
        await admin.aclose()


async def test_a_channel_that_left_is_not_subscribed_again_after_a_reconnect(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notifier parses its messages where they arrive, so redis-py never reads an
    unsubscription's confirmation: it is told of it (`_adapter.pubsub_unsubscribed`), else
    it would subscribe the channel that left again on its next re-connect, for good."""
    monkeypatch.setattr(notifier_module, "_LINGER", 0.05)
    client = redis.asyncio.Redis.from_url(server.url)
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        await admin.flushall()
        notifier = context_for(client).notifier
        left, kept = (f"aiolocks:mutex:{{{name}}}:wake".encode() for name in ("left", "kept"))
        await notifier.retain(kept, None)
        await notifier.retain(left, None)
        link = notifier._links[""]
        assert link.parser is not None  # read where they arrive (hiredis, a socket)
        confirmed = asyncio.Event()
        unsubscribed = link.unsubscribed

        def confirmation(name: bytes) -> bool:
            ours = unsubscribed(name)
            if ours and name == left:
                confirmed.set()
            return ours

        monkeypatch.setattr(link, "unsubscribed", confirmation)
        notifier.release(left)
        await asyncio.wait_for(confirmed.wait(), 5)
        resynced: list[bytes] = []
        again = asyncio.Event()
        resync = notifier.resync

        def resync_kept(wake: bytes) -> None:
            resync(wake)
            resynced.append(wake)
            if resynced.count(kept) >= 2:  # at the drop, then once subscribed again
                again.set()

        monkeypatch.setattr(notifier, "resync", resync_kept)
        await admin.client_kill_filter(_type="pubsub")
        await asyncio.wait_for(again.wait(), 10)
        counts = await admin.execute_command("PUBSUB", "SHARDNUMSUB", left, kept)  # type: ignore[no-untyped-call]
        plain = await admin.execute_command("PUBSUB", "NUMSUB", left, kept)  # type: ignore[no-untyped-call]
        subscribed = [int(a) + int(b) for a, b in zip(counts[1::2], plain[1::2], strict=True)]
        assert subscribed == [0, 1], subscribed
        notifier.release(kept)
    finally:
        await close_client(client)
        await admin.aclose()


# -- 3.5 set_limit between try and wait -----------------------------------------------------


async def test_set_limit_between_a_try_and_its_wait_goes_on_with_the_new_limit(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis.asyncio.Redis.from_url(server.url)
    try:
        await client.flushall()
        sem = RedisSemaphore(client, "limit-race", limit=1, ttl=5)
        holder = RedisSemaphore(client, "limit-race", limit=1, ttl=5)
        assert await holder.acquire()
        notifier = context_for(client).notifier
        original = notifier.retain

        async def retain_after_set_limit(wake: bytes, watch_key: bytes | None) -> None:
            monkeypatch.setattr(notifier, "retain", original)
            await sem.set_limit(2)  # another task of the same instance, in the gap
            await original(wake, watch_key)

        monkeypatch.setattr(notifier, "retain", retain_after_set_limit)
        assert await sem.acquire(timeout=5)
        assert (await sem.inspect()).holders == 2
        await sem.release()
        holder._spec = sem._spec
        await holder.release()
    finally:
        await close_client(client)
