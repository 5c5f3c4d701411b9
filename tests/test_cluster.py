"""aiolocks on a real 3-primary Redis / Valkey Cluster, and behind Sentinel.

The generic lock contract also runs on the clusters (``tests/test_contract.py``). Here:
locks spread over all three nodes, wake-ups on the owning shard only, processes contending
through ``RedisCluster`` clients, a slot moved while waiters wait, and a Sentinel failover
under a held lock.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _cluster import Cluster, names_on_each_node
from _lockworker import CLUSTER_SCHEME
from _probes import QueueProbe, Renewals
from _sentinel import MASTER_NAME, SentinelGroup
from _servers import arun_workers, command_count
from conftest import SENTINEL_VARIANTS, open_sentinel_group
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from aiolocks import RedisMutex, RedisReadWriteLock, RedisRegistry, RedisSemaphore
from aiolocks._base import _telemetry
from aiolocks._engine._context import context_for
from aiolocks._leases._renewbatch import RENEW_BATCH

pytestmark = pytest.mark.slow

COUNTER = Path(__file__).resolve().parent / "workers" / "mutex_counter.py"


def _node_client(cluster: Cluster, index: int) -> redis.asyncio.Redis:
    return redis.asyncio.Redis(host="127.0.0.1", port=cluster.nodes[index].port)


async def _spublish_counts(cluster: Cluster) -> list[int]:
    counts = []
    for index in range(len(cluster.nodes)):
        async with _node_client(cluster, index) as client:
            counts.append(await command_count(client, ["spublish"]))
    return counts


async def test_every_script_stays_in_one_slot(cluster_r: RedisCluster, cluster: Cluster) -> None:
    """Each primitive on a name of each node: every key it leaves is in the name's slot
    (a script touching another slot would have failed with CROSSSLOT first)."""
    for index, names in enumerate(names_on_each_node(cluster, 1, prefix="slot")):
        name = names[0]
        for lock in (
            RedisMutex(cluster_r, name),
            RedisSemaphore(cluster_r, name, limit=2),
            RedisReadWriteLock(cluster_r, name).write(),
        ):
            async with lock:
                pass
        await RedisRegistry(cluster_r, name).register_many(["a", "b"])
        async with _node_client(cluster, index) as node:
            keys = [key async for key in node.scan_iter(match="aiolocks:*")]
        assert keys, name
        assert {key_slot(key) for key in keys} == {key_slot(name.encode())}, keys


async def test_hand_offs_wake_only_the_owning_shard(
    cluster_r: RedisCluster, cluster: Cluster
) -> None:
    other = cluster.client()
    try:
        per_node = names_on_each_node(cluster, 1, prefix="shard")
        for index, (name,) in enumerate(per_node):
            holder, waiter = RedisMutex(cluster_r, name), RedisMutex(other, name)
            probe = QueueProbe(other)
            before = await _spublish_counts(cluster)
            for _ in range(5):
                assert await holder.acquire()
                waiting = asyncio.create_task(waiter.acquire())
                # Queued behind the holder's cohort (the default mutex): one SPUBLISH, on
                # the owning shard, that tells the holder's process (issue 45).
                await probe.wait_queued(len(probe.queued) + 1)
                await holder.release()  # hands over across clients: one SPUBLISH
                assert await asyncio.wait_for(waiting, 10)
                await waiter.release()
            after = await _spublish_counts(cluster)
            grown = [a - b for a, b in zip(after, before, strict=True)]
            assert grown == [10 if node == index else 0 for node in range(3)], (name, grown)
        # The waiting client keeps one pub/sub connection per node it waited on.
        assert len(context_for(other).notifier._links) == 3
    finally:
        await other.aclose()


async def test_contended_locks_on_every_node(cluster_r: RedisCluster, cluster: Cluster) -> None:
    clients = [cluster_r, cluster.client()]
    names = [name for group in names_on_each_node(cluster, 2, prefix="busy") for name in group]
    counters = dict.fromkeys(names, 0)
    inside = dict.fromkeys(names, 0)
    most = dict.fromkeys(names, 0)

    async def work(client: RedisCluster, name: str) -> None:
        mutex = RedisMutex(client, name, ttl=10, timeout=30)
        for _ in range(10):
            async with mutex:
                inside[name] += 1
                most[name] = max(most[name], inside[name])
                value = counters[name]
                await asyncio.sleep(0.001)
                counters[name] = value + 1
                inside[name] -= 1

    try:
        await asyncio.gather(*(work(c, n) for n in names for c in clients for _ in range(2)))
    finally:
        await clients[1].aclose()
    assert counters == dict.fromkeys(names, 40)
    assert most == dict.fromkeys(names, 1)
    for name in names:
        info = await RedisMutex(cluster_r, name).inspect()
        assert (info.owner, info.queue_length) == (None, 0) and info.fence > 0


async def test_mutual_exclusion_across_processes_on_a_cluster(
    cluster_r: RedisCluster, cluster: Cluster
) -> None:
    """4 processes x 3 names (one per node) x 50 non-atomic increments through
    RedisCluster clients: nothing lost, every fence used exactly once, per name."""
    names = [group[0] for group in names_on_each_node(cluster, 1, prefix="procs")]
    workers, iterations = 4, 50
    url = CLUSTER_SCHEME + cluster.startup_url
    results = await arun_workers(
        str(COUNTER),
        [
            [url, ",".join(names), str(i), str(workers), str(iterations), "5", "60"]
            for i in range(workers)
        ],
        timeout=90,
    )
    fences: dict[str, list[int]] = {name: [] for name in names}
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        for line in result.stdout.splitlines():
            word, _worker, name, data = line.split(" ", 3)
            if word == "fences":
                mine = json.loads(data)
                assert len(mine) == iterations
                assert all(a < b for a, b in itertools.pairwise(mine)), mine
                fences[name] += mine
    for name in names:
        assert await cluster_r.get(f"test:{{{name}}}:counter") == str(workers * iterations).encode()
        assert len(set(fences[name])) == workers * iterations, name  # each fence used once


class Turns:
    """Waiters on one mutex, queued one by one alternately through two clients; each
    records its turn (index, fence) and checks that nobody else is inside meanwhile."""

    def __init__(self, clients: tuple[RedisCluster, RedisCluster], name: str) -> None:
        self.clients = clients
        self.name = name
        self.taken: list[tuple[int, int]] = []  # (index, fence) in the order they held it
        self.tasks: list[asyncio.Task[None]] = []
        self._inside = 0
        self._probes = [QueueProbe(client) for client in clients]

    async def queue(self, count: int, ttl: float) -> None:
        """Start `count` waiters; return once the server has queued every one of them."""
        for index in range(count):
            probe = self._probes[index % 2]
            client = self.clients[index % 2]
            self.tasks.append(asyncio.create_task(self._turn(client, index, ttl)))
            await probe.wait_queued(len(probe.queued) + 1)

    async def _turn(self, client: RedisCluster, index: int, ttl: float) -> None:
        # strict FIFO: the server queue, in the order queued, is what these tests follow
        async with RedisMutex(client, self.name, ttl=ttl, timeout=60, local_handoff=0) as mine:
            self._inside += 1
            assert self._inside == 1
            assert mine.fencing_token is not None
            self.taken.append((index, mine.fencing_token))
            await asyncio.sleep(0.01)
            self._inside -= 1

    async def finish(self, timeout: float) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), timeout)


async def test_waiters_follow_a_slot_that_moves(cluster_r: RedisCluster, cluster: Cluster) -> None:
    """A held mutex's slot is migrated to another node while 6 waiters (two clients)
    wait: afterwards they all acquire, in the order they queued, one at a time, with
    increasing fences; nothing is left queued."""
    name = names_on_each_node(cluster, 1, prefix="moving")[0][0]
    slot = key_slot(name.encode())
    source = cluster.owner(slot)
    target = next(node for node in cluster.nodes if node is not source)
    other = cluster.client()
    try:
        holder = RedisMutex(cluster_r, name, ttl=10, local_handoff=0)
        assert await holder.acquire()
        first_fence = holder.fencing_token
        assert first_fence is not None
        turns = Turns((cluster_r, other), name)
        await turns.queue(6, ttl=10)
        await cluster.migrate_slot(slot, target)
        assert cluster.owner(slot) is target
        await holder.release()  # goes to the new owner (MOVED), hands over by SPUBLISH there
        await turns.finish(30)
    finally:
        await other.aclose()
    assert [index for index, _ in turns.taken] == list(range(6))
    taken = [fence for _, fence in turns.taken]
    assert taken == sorted(set(taken)) and taken[0] > first_fence, (first_fence, taken)
    info = await RedisMutex(cluster_r, name).inspect()
    assert (info.owner, info.queue_length) == (None, 0)
    async with redis.asyncio.Redis(host="127.0.0.1", port=target.port) as node:
        assert await node.exists(f"aiolocks:mutex:{{{name}}}:fence") == 1


async def test_waiters_survive_their_node_restarting(
    cluster_r: RedisCluster, cluster: Cluster
) -> None:
    """The node owning a held mutex restarts and loses its keys while 4 waiters (two
    clients) wait: the holder is told (LockLost), and every waiter still gets the mutex,
    one at a time, once the node is back; its pub/sub links reconnect on their own."""
    name = names_on_each_node(cluster, 1, prefix="restart")[0][0]
    other = cluster.client()
    try:
        holder = RedisMutex(cluster_r, name, ttl=2, local_handoff=0)
        assert await holder.acquire()
        turns = Turns((cluster_r, other), name)
        await turns.queue(4, ttl=5)
        await cluster.restart_node(cluster.node_of(name))
        # The owner key is gone with the node's data: the holder's next renewal says so.
        await asyncio.wait_for(holder.lost.wait(), 10)
        await turns.finish(60)
    finally:
        await other.aclose()
    # The queue was lost with the node: they re-queued, in whatever order they re-checked.
    assert sorted(index for index, _ in turns.taken) == [0, 1, 2, 3]


# -- Sentinel ----------------------------------------------------------------------------


@pytest.fixture(params=SENTINEL_VARIANTS, ids=SENTINEL_VARIANTS)
async def two_replica_group(request: pytest.FixtureRequest) -> AsyncIterator[SentinelGroup]:
    """A primary with two replicas behind three sentinels: after a failover one replica is
    left to acknowledge grants (``replicas=1``)."""
    async with open_sentinel_group(request.param, replicas=2) as group:
        yield group


async def test_the_lock_service_survives_a_failover(two_replica_group: SentinelGroup) -> None:
    """A mutex with replicas=1 held, a waiter waiting, the primary killed: after the
    failover the holder releases on the new primary, the waiter gets it, and every fence
    handed out is higher than every fence before."""
    sentinel_group = two_replica_group
    holder_client = sentinel_group.master_for()
    waiter_client = sentinel_group.master_for()
    # The replica left re-syncs with the new primary after the failover: allow for it. The
    # lease must outlast the failover (a few seconds; more on a loaded machine), or the
    # holder is rightly told LockLost.
    options: dict[str, Any] = {"ttl": 30, "replicas": 1, "replica_timeout": 10}
    holder = RedisMutex(holder_client, "failover", **options)
    waiter = RedisMutex(waiter_client, "failover", timeout=30, **options)
    assert await holder.acquire()
    before = holder.fencing_token
    assert before is not None
    probe = QueueProbe(waiter_client)

    async def wait_and_take() -> int:
        assert await waiter.acquire()
        fence = waiter.fencing_token
        assert fence is not None
        await waiter.release()
        return fence

    waiting = asyncio.create_task(wait_and_take())
    await probe.wait_queued(1)
    new_primary = await sentinel_group.kill_primary_and_wait_failover()
    assert new_primary[1] == sentinel_group.primary.port
    await holder.release()  # the client finds the new primary through the sentinels
    handed = await asyncio.wait_for(waiting, 30)
    assert handed > before
    later = []
    for _ in range(3):
        async with holder:
            assert holder.fencing_token is not None
            later.append(holder.fencing_token)
    assert later == sorted(later) and later[0] > handed


@pytest.mark.parametrize("name", ["orders:42", "a", "x:{y", "ünïcode"])
def test_every_key_and_channel_of_a_primitive_shares_one_slot(name: str) -> None:
    """No server needed: what each primitive's scripts are given (KEYS and the channel
    they publish on) hashes to one slot, so no script can cross slots on a Cluster."""
    if "{" in name:
        with pytest.raises(ValueError):
            RedisMutex(redis.asyncio.Redis(host="127.0.0.1", port=1), name)
        return
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    rw = RedisReadWriteLock(client, name)
    for lock in (
        RedisMutex(client, name),
        RedisSemaphore(client, name, limit=3),
        rw.read(),
        rw.write(),
    ):
        spec = lock._spec
        slots = {key_slot(key) for key in (*spec.keys, spec.channel, *spec.renew_keys)}
        assert slots == {key_slot(name.encode())}, (type(lock).__name__, spec.keys)
    registry = RedisRegistry(client, name)
    keys = (registry._ids, registry._names, registry._counter)
    assert {key_slot(key) for key in keys} == {key_slot(name.encode())}


async def test_a_command_redis_py_dropped_before_sending_is_sent_again(
    cluster_r: RedisCluster, cluster: Cluster
) -> None:
    """redis-py 8.1's cluster client can fail a command with AttributeError when a topology
    refresh closes the connection while it connects (nothing was sent): the engine sends
    it again. The failure is injected once, by the client class, on a real cluster."""

    class Dropping(RedisCluster):
        drops = 1

        async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            if self.drops and args[0] == "EVALSHA":
                self.drops -= 1
                raise AttributeError("'NoneType' object has no attribute 'writelines'")
            return await super().execute_command(*args, **kwargs)

    client = Dropping(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        mutex = RedisMutex(client, "dropped")
        async with mutex:
            assert (mutex.fencing_token or 0) > 0
        assert client.drops == 0
    finally:
        await client.aclose()


async def test_renewals_go_out_one_call_per_slot(
    cluster_r: RedisCluster, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 permits of one semaphore (one slot) and mutexes on 3 names of each node: a renewal
    round is one script call per slot (10), not one per lease (39), and renews them all."""
    permits = RedisSemaphore(cluster_r, "pool", limit=30, ttl=30)
    mutexes = [
        RedisMutex(cluster_r, name, ttl=30)
        for names in names_on_each_node(cluster, 3, prefix="renew")
        for name in names
    ]
    acquired = await asyncio.gather(
        *(permits.acquire() for _ in range(30)), *(mutex.acquire() for mutex in mutexes)
    )
    assert all(acquired)
    context = context_for(cluster_r)
    leases = [
        holding.lease
        for lock in [permits, *mutexes]
        for holding in lock._holdings.values()
        if holding.lease is not None
    ]
    assert len(leases) == 39
    slots = {key_slot(lease.keys[0]) for lease in leases}
    assert len(slots) == 10
    renewals = Renewals()
    monkeypatch.setattr(_telemetry, "recorder", renewals)
    for lease in leases:  # the script is known on every node first: no NOSCRIPT re-sends
        await context.run(RENEW_BATCH, (lease.keys[0],), (b"",))
    before = context.commands_sent
    now = time.monotonic()
    for lease in leases:
        lease.next_due = now
        context.keeper.hold(lease)
    await renewals.until(len(leases), 10)
    assert context.commands_sent - before == len(slots)
    assert not any(lease.lost for lease in leases)
    # Hand everything back: a keeper left renewing on a client the fixture then closes
    # leaves sockets behind for a later test to trip over.
    await asyncio.gather(*(permits.release() for _ in range(30)), *(m.release() for m in mutexes))


@pytest.mark.parametrize("variant", SENTINEL_VARIANTS)
async def test_a_sentinel_client_dropped_without_aclose_is_collected_cleanly(
    variant: str,
) -> None:
    """Issue 40: a Sentinel-managed pool gives its connections a weak proxy of itself, and
    the engine's pool copies it. A client dropped without `aclose()` goes with its pool in
    one garbage collection, before its engine's connections are closed: closing them must
    not need the pool (no ReferenceError, in a task or a log), and leaves none open."""
    errors: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: errors.append(repr(context)))
    handler = _Errors(errors)
    logging.getLogger().addHandler(handler)
    tag = f"aiolocks-sentinel-dropped-{variant}"
    try:
        async with open_sentinel_group(variant) as group:
            admin, sentinel = group.master_for(), group.sentinel()
            collected: list[int] = []
            for index in range(3):
                client = sentinel.master_for(MASTER_NAME, client_name=tag)  # not kept by group
                weakref.finalize(client, collected.append, index)
                holder, waiter = RedisMutex(admin, f"sd{index}"), RedisMutex(client, f"sd{index}")
                assert await holder.acquire()
                probe = QueueProbe(client)
                waiting = asyncio.create_task(waiter.acquire(timeout=10))
                await probe.wait_queued(1)  # queued and subscribed: woken by the message
                await holder.release()
                assert await waiting
                await waiter.release()
                del client, waiter, waiting, probe
            await _settled()  # the idle lease keepers end (they hold their engine until then)
            gc.collect()
            await _settled()  # the collected engines' connections closed
            assert sorted(collected) == [0, 1, 2]
            left = [c for c in await admin.client_list() if c.get("name") == tag]
            assert not left, left
            await admin.aclose()
    finally:
        logging.getLogger().removeHandler(handler)
        loop.set_exception_handler(None)
    assert not errors, errors


class _Errors(logging.Handler):
    def __init__(self, errors: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.errors = errors

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "ReferenceError" in record.getMessage():
            self.errors.append(self.format(record))


async def _settled() -> None:
    """Every other task done, within a bound."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=10)
