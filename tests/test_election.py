"""`RedisElection` on real servers (keyspace notifications on and off) and on the 3-primary
cluster: FIFO among candidates, proclaim, resign, lease loss, observe (every change, in
order, without polling, one subscription per process), cancellation, bad arguments."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from _cli import cli
from _faults import close_client
from _probes import QueueProbe
from _servers import has_sharded_pubsub
from _workers import ROOT, Spawn
from conftest import Tasks

from aiolocks import LeaderInfo, LockLost, LockTimeout, RedisElection, Term
from aiolocks._engine._context import context_for
from aiolocks.election import hubs_of
from aiolocks.testing import expire_lease, expire_leases

REPLICA = ROOT / "tests" / "workers" / "election_replica.py"
FENCE_KEEP = 5.0  # FENCE_KEEP_MS in _prelude.lua: a fence counter outlives its last grant this long
Snapshot = tuple[str, int] | None  # (value, fence) of a leader, None while vacant
BOUND = 5.0  # the longest any wait for an expected event may take here


class Watch:
    """One `observe()` running in a task: what it yielded, waited for with a bound."""

    def __init__(self, election: RedisElection, tasks: Tasks) -> None:
        self.seen: list[Snapshot] = []
        self.infos: list[LeaderInfo | None] = []
        self.times: list[float] = []
        self._grew = asyncio.Event()
        self.task = tasks.start(self._run(election))

    async def _run(self, election: RedisElection) -> None:
        async for info in election.observe():
            self.infos.append(info)
            self.seen.append(None if info is None else (info.value, info.fencing_token))
            self.times.append(time.time())
            self._grew.set()

    async def until(self, count: int, timeout: float = BOUND) -> list[Snapshot]:
        async def wait() -> None:
            while len(self.seen) < count:
                self._grew.clear()
                await self._grew.wait()

        await asyncio.wait_for(wait(), timeout)
        return self.seen

    def mark(self) -> int:
        return len(self.seen)

    async def until_seen(self, snapshot: Snapshot, since: int = 0, timeout: float = BOUND) -> float:
        """Wait until `snapshot` is yielded at index `since` or later (`mark()` gives the
        next index); the wall time it was yielded at."""
        start = since

        async def wait() -> int:
            while True:
                for index in range(start, len(self.seen)):
                    if self.seen[index] == snapshot:
                        return index
                self._grew.clear()
                await self._grew.wait()

        return self.times[await asyncio.wait_for(wait(), timeout)]


@pytest.fixture
async def clients(url: str, r: redis.asyncio.Redis) -> AsyncIterator[Callable[[], Any]]:
    """Makes more clients on the (flushed) server, each its own engine context (a
    'process' of its own)."""
    made: list[redis.asyncio.Redis] = []

    def make() -> redis.asyncio.Redis:
        made.append(redis.asyncio.Redis.from_url(url))
        return made[-1]

    try:
        yield make
    finally:
        for client in made:
            await close_client(client)


async def keys_left(client: Any, name: str) -> set[str]:
    """The parts of the election's keys that exist (one hash tag: one node on Cluster)."""
    parts = ("leader", "queue", "waiters", "fence", "candidates")
    keys = [f"aiolocks:election:{{{name}}}:{part}" for part in parts]
    present = [bool(await client.exists(key)) for key in keys]
    return {part for part, there in zip(parts, present, strict=True) if there}


# -- campaign, FIFO, resign, proclaim -----------------------------------------------------


async def fifo_scenario(make: Callable[[], Any], tasks: Tasks) -> None:
    """A leads; B, C, D queue in that order from three clients; each resigns in turn: the
    next is elected at once, in queue order, with a higher fence; an observer sees it all."""
    watcher = Watch(RedisElection(make(), "scheduler", ttl=30), tasks)
    assert await watcher.until(1) == [None]
    leader_client = make()
    election = RedisElection(leader_client, "scheduler", ttl=30)
    order: list[tuple[str, int]] = []
    entered: dict[str, asyncio.Event] = {}
    leave: dict[str, asyncio.Event] = {}
    left_at: dict[str, float] = {}
    entered_at: dict[str, float] = {}

    async def candidate(client: Any, value: str) -> None:
        async with RedisElection(client, "scheduler", ttl=30).campaign(value) as term:
            entered_at[value] = time.monotonic()
            assert term.value == value
            order.append((value, term.fencing_token))
            entered[value].set()
            await leave[value].wait()
        left_at[value] = time.monotonic()

    for value in "ABCD":
        entered[value], leave[value] = asyncio.Event(), asyncio.Event()
    tasks.start(candidate(leader_client, "A"))
    await asyncio.wait_for(entered["A"].wait(), BOUND)
    for value in "BCD":
        client = make()
        probe = QueueProbe(client)
        await tasks.queued(probe, candidate(client, value))
    info = await election.inspect()
    assert (info.value, info.candidates) == ("A", 3)
    for before, after in zip("ABC", "BCD", strict=True):
        leave[before].set()
        await asyncio.wait_for(entered[after].wait(), BOUND)
        # The ttl is 30 s: only the resignation can have elected the next one.
        assert entered_at[after] - left_at[before] < 1.0
    leave["D"].set()
    assert [value for value, _ in order] == list("ABCD")
    fences = [fence for _, fence in order]
    assert fences == sorted(fences) and len(set(fences)) == 4
    expected = [None, *order, None]
    assert await watcher.until(len(expected)) == expected
    assert await election.leader() is None


@pytest.mark.parametrize("server", ["valkey-notify", "valkey-plain"], indirect=True)
async def test_candidates_are_elected_in_order_and_resigning_hands_over_at_once(
    clients: Callable[[], Any], tasks: Tasks
) -> None:
    await fifo_scenario(clients, tasks)


async def test_fifo_and_observe_on_the_cluster(cluster: Any, cluster_r: Any, tasks: Tasks) -> None:
    made: list[Any] = []

    def make() -> Any:
        made.append(cluster.client())
        return made[-1]

    try:
        await fifo_scenario(make, tasks)
        await proclaim_scenario(make(), make(), tasks)
        assert await keys_left(cluster_r, "scheduler") == {"fence"}
    finally:
        await tasks.reap()
        for client in made:
            await close_client(client)


async def proclaim_scenario(client: Any, other: Any, tasks: Tasks) -> None:
    """A burst of proclamations is seen value by value, in order; each change (elected,
    proclaimed, resigned) reaches the observer within 0.2 s."""
    watcher = Watch(RedisElection(other, "scheduler", ttl=30), tasks)
    await watcher.until(1)
    election = RedisElection(client, "scheduler", ttl=30)
    assert await election.leader() is None  # the client's first use (Cluster: its set-up)
    latencies = []
    asked = time.time()
    async with election.campaign("v1") as term:
        fence = term.fencing_token
        latencies.append(await watcher.until_seen(("v1", fence)) - asked)
        for value in ("v2", "v3", "v4", "v5"):  # a burst: each is seen, in order
            await term.proclaim(value)
        assert term.value == "v5"
        leader = await RedisElection(other, "scheduler").leader()
        assert leader is not None and (leader.value, leader.fencing_token) == ("v5", fence)
        assert 0 < leader.lease_remaining <= 30
        await watcher.until(6)
        asked = time.time()
        await term.proclaim("v6")
        latencies.append(await watcher.until_seen(("v6", fence)) - asked)
        mark = watcher.mark()
        asked = time.time()
    latencies.append(await watcher.until_seen(None, since=mark) - asked)
    values = [f"v{n}" for n in range(1, 7)]
    assert watcher.seen == [watcher.seen[0], *((v, fence) for v in values), None]
    assert max(latencies) <= 0.2, latencies


async def test_proclaim_keeps_the_term_and_every_value_is_seen(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    await proclaim_scenario(r, clients(), tasks)


async def test_proclaim_after_the_term_ended_raises_lock_lost(r: redis.asyncio.Redis) -> None:
    election = RedisElection(r, "scheduler", ttl=30)
    with pytest.raises(LockLost):
        async with election.campaign("a") as term:
            await expire_lease(term)
    assert term.lost.is_set()
    with pytest.raises(LockLost, match="not the leader"):
        await term.proclaim("too late")
    assert await election.leader() is None


async def test_resign_inside_the_block_elects_the_next_at_once(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    other = clients()
    probe = QueueProbe(other)
    async with RedisElection(r, "scheduler", ttl=30).campaign("a") as term:
        waiting = await tasks.queued(probe, _elected_value(other, "b"))
        await term.resign()
        assert await asyncio.wait_for(waiting, BOUND) == "b"
    assert await keys_left(r, "scheduler") == {"fence"}


async def _elected_value(client: Any, value: str) -> str:
    async with RedisElection(client, "scheduler", ttl=30).campaign(value) as term:
        return term.value


async def test_timeout_and_one_try(r: redis.asyncio.Redis, clients: Callable[[], Any]) -> None:
    other = RedisElection(clients(), "scheduler", ttl=30)
    async with RedisElection(r, "scheduler", ttl=30).campaign("a"):
        started = time.monotonic()
        with pytest.raises(LockTimeout):
            async with other.campaign("b", timeout=0.3):
                pytest.fail("elected while another leads")
        assert 0.3 <= time.monotonic() - started < 0.3 + BOUND
        with pytest.raises(LockTimeout):
            async with other.campaign("b", timeout=0):
                pytest.fail("elected while another leads")
        assert (await other.inspect()).candidates == 0  # the timed-out ones left the queue
    async with other.campaign("b", timeout=0) as term:
        assert term.value == "b"


@pytest.mark.parametrize("server", ["valkey-notify", "valkey-plain"], indirect=True)
async def test_lease_loss_cancels_the_body_and_raises_lock_lost(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    lost: list[LockLost] = []
    election = RedisElection(r, "scheduler", ttl=0.6, on_lost=lost.append)
    watcher = Watch(RedisElection(clients(), "scheduler"), tasks)
    body_ended = asyncio.Event()
    with pytest.raises(LockLost):
        async with election.campaign("a") as term:
            await watcher.until_seen(("a", term.fencing_token))
            # Another process ends the lease: the keeper finds out within ttl/3.
            mark = watcher.mark()
            assert await expire_leases(election) == 1
            try:
                await asyncio.sleep(BOUND)
            finally:
                body_ended.set()
            pytest.fail("the body went on after the lease was lost")
    assert body_ended.is_set() and term.lost.is_set() and len(lost) == 1
    await watcher.until_seen(None, since=mark)


async def test_bad_arguments_change_nothing(r: redis.asyncio.Redis) -> None:
    with pytest.raises(ValueError, match=re.escape("'{'")):
        RedisElection(r, "a{b}")
    with pytest.raises(ValueError, match="ttl"):
        RedisElection(r, "scheduler", ttl=0)
    with pytest.raises(TypeError, match="redis"):
        RedisElection(object(), "scheduler")  # type: ignore[arg-type]
    election = RedisElection(r, "scheduler")
    with pytest.raises(TypeError, match="value must be a str"):
        election.campaign(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="too long"):
        election.campaign("x" * 70_000)
    with pytest.raises(ValueError, match="timeout"):
        election.campaign("a", timeout=-1)
    async with election.campaign("a") as term:
        with pytest.raises(ValueError, match="UTF-8"):
            await term.proclaim("\ud800")
        assert (await election.leader()) is not None
        assert (await election.inspect()).value == "a"
    assert await r.keys("*") == [b"aiolocks:election:{scheduler}:fence"]


# -- observe -------------------------------------------------------------------------------


async def _commands(r: redis.asyncio.Redis) -> int:
    """Commands the server has run (minus this INFO itself, counted once it ran)."""
    return int((await r.info("stats"))["total_commands_processed"])


@pytest.mark.parametrize("server", ["valkey-notify", "redis-plain"], indirect=True)
async def test_observers_share_one_subscription_and_do_not_poll(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    observing = clients()
    watchers = [Watch(RedisElection(observing, "scheduler"), tasks) for _ in range(20)]
    for watcher in watchers:
        assert await watcher.until(1) == [None]
    context = context_for(observing)
    # One read served all twenty (plus the notifier's one question about pub/sub).
    assert context.commands_sent <= 2
    channel = "aiolocks:election:{scheduler}:wake"
    sharded = 0  # Redis 6.2 has no sharded pub/sub
    if await has_sharded_pubsub(r):
        reply = await r.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
        sharded = int(reply[1])
    plain = await r.pubsub_numsub(channel)  # [(channel, n)]
    assert sharded + int(plain[0][1]) == 1

    for quiet_with in ("vacant", "a leader"):
        sent, before = context.commands_sent, await _commands(r)
        await asyncio.sleep(1.0)  # a quiet election: nobody changes anything
        assert context.commands_sent == sent, quiet_with
        assert await _commands(r) == before + 1, quiet_with  # only the INFO above
        if quiet_with == "vacant":
            term = RedisElection(r, "scheduler", ttl=30).campaign("a")
            held = await term.__aenter__()
            for watcher in watchers:
                await watcher.until_seen(("a", held.fencing_token))
    mark = [watcher.mark() for watcher in watchers]
    await term.__aexit__(None, None, None)
    for watcher, since in zip(watchers, mark, strict=True):
        await watcher.until_seen(None, since=since)


@pytest.mark.slow
async def test_a_crashed_leader_is_seen_gone_within_200_ms_of_its_expiry(
    url: str, r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks, spawn: Spawn
) -> None:
    watcher = Watch(RedisElection(clients(), "scheduler"), tasks)
    await watcher.until(1)
    leader = await spawn(REPLICA, url, "crasher", 0.5, 0.05, 30)
    fence = int((await leader.expect("elected"))[3])
    await watcher.until_seen(("crasher", fence))
    await leader.expect("ran")
    mark = watcher.mark()
    leader.kill()  # SIGKILL: no resignation, its lease just stops being renewed
    assert await leader.finish() == -signal.SIGKILL
    expires_at = int(await r.pexpiretime("aiolocks:election:{scheduler}:leader")) / 1000
    assert expires_at > 0, "the lease had already ended"
    seen_at = await watcher.until_seen(None, since=mark)
    assert -0.01 < seen_at - expires_at <= 0.2, seen_at - expires_at


async def test_an_observer_stalled_past_the_idle_window_sees_the_leader_gone(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    """A leader crashes while the observer's event loop is stalled until every key of the
    election has expired, the fence counter too (max(ttl + 1 s, 5 s), FENCE_KEEP_MS in
    the prelude): the read then finds no fence
    at all, and must still count as after the term the observer knew, so the observer
    shows the vacancy, once, and goes quiet (no read loop at the old lease end)."""
    ttl = 0.3
    observing = clients()
    watcher = Watch(RedisElection(observing, "scheduler"), tasks)
    await watcher.until(1)
    crasher = RedisElection(clients(), "scheduler", ttl=ttl)._probe  # campaigns with ""
    assert await crasher.acquire()
    holding = crasher._current()
    assert holding is not None and holding.lease is not None
    await watcher.until_seen(("", holding.fence))
    context_for(crasher._client).keeper.drop(holding.lease)  # as if its process died
    mark = watcher.mark()
    # on purpose: the loop stalls past the idle window and the fence counter's keep
    time.sleep(max(ttl + 1.0, FENCE_KEEP) + 0.3)  # noqa: ASYNC251
    assert await keys_left(r, "scheduler") == set()
    await watcher.until_seen(None, since=mark)
    sent = context_for(observing).commands_sent
    await asyncio.sleep(0.5)
    assert context_for(observing).commands_sent == sent  # no reads: it knows it is vacant
    assert watcher.seen[mark:] == [None]


async def test_an_observer_sees_the_state_again_after_a_reconnect(
    r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    observing = clients()
    watcher = Watch(RedisElection(observing, "scheduler"), tasks)
    async with RedisElection(r, "scheduler", ttl=30).campaign("a") as term:
        await watcher.until_seen(("a", term.fencing_token))
        mark = watcher.mark()
        killed = await r.client_kill_filter(_type="pubsub")
        assert killed >= 1
        await watcher.until_seen(("a", term.fencing_token), since=mark)  # shown again
        await term.proclaim("b")  # and changes still arrive
        await watcher.until_seen(("b", term.fencing_token))


async def test_observe_closed_or_dropped_leaves_the_subscription(r: redis.asyncio.Redis) -> None:
    election = RedisElection(r, "scheduler")
    changes = election.observe()
    assert await changes.__anext__() is None
    context = context_for(r)
    assert list(hubs_of(context)) == [b"aiolocks:election:{scheduler}:wake"]
    await changes.aclose()  # type: ignore[attr-defined]
    assert not hubs_of(context)
    with pytest.raises(StopAsyncIteration):
        await changes.__anext__()
    async for info in election.observe():  # a loop left by break: dropped, then cleaned
        assert info is None
        break
    assert not hubs_of(context)


async def test_an_observed_leaders_timer_ends_when_the_engine_stops(
    r: redis.asyncio.Redis,
) -> None:
    """An observer shown a leader arms a timer at that lease's end; the engine stopping on
    the client (closed, or its loop ending) ends it, even with the observer still there:
    a program whose loop ends leaves no timer of aiolocks armed."""
    observing = redis.asyncio.Redis(connection_pool=r.connection_pool)
    context = context_for(observing)
    changes = RedisElection(observing, "scheduler").observe()
    async with RedisElection(r, "scheduler", ttl=30).campaign("a"):
        while (info := await asyncio.wait_for(changes.__anext__(), 5)) is None:
            pass
        assert info.value == "a"
        (hub,) = hubs_of(context).values()
        timer = hub._timer
        assert timer is not None and not timer.cancelled()  # armed at the lease's end
        await context.aclose()
        assert timer.cancelled()
        assert hub._timer is None and not hubs_of(context)
    await changes.aclose()  # type: ignore[attr-defined]


# -- cancellation ----------------------------------------------------------------------------


async def test_cancellation_at_any_await_leaves_nothing(
    r: redis.asyncio.Redis, clients: Callable[[], Any]
) -> None:
    rng = random.Random(16)
    elections = [RedisElection(clients(), "scheduler", ttl=5) for _ in range(3)]
    outcomes = {"elected": 0, "cancelled": 0}

    async def campaign(election: RedisElection) -> None:
        async with election.campaign("x") as term:
            outcomes["elected"] += 1
            if rng.random() < 0.5:
                await term.proclaim("y")
            await asyncio.sleep(rng.random() * 0.003)

    async def observe(election: RedisElection) -> None:
        async for _ in election.observe():
            await asyncio.sleep(0)

    for _ in range(150):
        election = rng.choice(elections)
        task = asyncio.create_task(rng.choice((campaign, campaign, observe))(election))
        await asyncio.sleep(rng.random() * (0.004 if rng.random() < 0.9 else 0.03))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            outcomes["cancelled"] += 1
    assert outcomes["elected"] > 0 and outcomes["cancelled"] > 0, outcomes
    assert await keys_left(r, "scheduler") == {"fence"}
    for election in elections:
        context = context_for(election._probe._client)
        assert not hubs_of(context), "an observer was left subscribed"
        async with election.campaign("after", timeout=BOUND) as term:  # still works
            assert isinstance(term, Term)


# -- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize("server", ["valkey-notify"], indirect=True)
async def test_cli_inspect_list_and_release_show_elections(
    url: str, r: redis.asyncio.Redis, clients: Callable[[], Any], tasks: Tasks
) -> None:
    election = RedisElection(r, "scheduler", ttl=30)
    finished: list[bool] = []
    with pytest.raises(LockLost) as caught:  # the release below took it away
        await _cli_scenario(url, election, clients, tasks, finished)
    # The body ran to its end: no failure in it was turned into LockLost.
    assert finished == [True], repr(caught.value.__cause__)
    assert await keys_left(r, "scheduler") == {"fence"}


async def _cli_scenario(
    url: str,
    election: RedisElection,
    clients: Callable[[], Any],
    tasks: Tasks,
    finished: list[bool],
) -> None:
    async with election.campaign("replica-a") as term:
        await term.proclaim("replica-a v2")
        queued = []
        candidates = []
        for value in ("replica-b", "replica-c"):
            client = clients()
            probe = QueueProbe(client)
            candidates.append(await tasks.queued(probe, _elected_value(client, value)))
            queued.append((probe.queued[0], value))

        ran = await cli("inspect", "scheduler", "--url", url, "--json")
        assert ran.code == 0, ran.err
        view = ran.json()
        assert (view["kind"], view["state"]) == ("election", "led by 'replica-a v2'")
        assert view["summary"]["term"] == term.fencing_token
        assert view["summary"]["candidates"] == 2
        [leader] = view["holders"]
        assert (leader["value"], leader["fence"]) == ("replica-a v2", term.fencing_token)
        assert 0 < leader["lease_remaining_ms"] <= 30_000
        assert [(w["token"], w["value"]) for w in view["queue"]] == queued

        table = await cli("inspect", "scheduler", "--url", url)
        assert table.code == 0 and "replica-b" in table.out and "candidates" in table.out
        listing = await cli("list", "--url", url, "--json")
        assert [(row["kind"], row["state"]) for row in listing.json()] == [
            ("election", "led by 'replica-a v2'")
        ]
        watcher = Watch(election, tasks)
        await watcher.until(1)
        released = await cli("release", "scheduler", "--force", "--yes", "--url", url)
        assert released.code == 0, released.err
        assert f"handed to {queued[0][0]}" in released.out
        # replica-b was elected and resigned at once (it returns), then replica-c.
        assert await asyncio.wait_for(asyncio.gather(*candidates), BOUND) == [
            "replica-b",
            "replica-c",
        ]
        await watcher.until_seen(None, since=1)
        values = [seen[0] for seen in watcher.seen[1:] if seen is not None]
        assert values == ["replica-b", "replica-c"], watcher.seen
        finished.append(True)
