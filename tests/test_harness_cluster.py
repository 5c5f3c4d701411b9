"""Tests of the cluster and sentinel harness: the cluster forms with slots on all three nodes,
keys, scripts and sharded pub/sub work through redis-py's RedisCluster on every node, a slot
moves with its keys, and a sentinel failover promotes the replica that ``master_for`` follows."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis.asyncio
from _cluster import Cluster, names_on_each_node, spread_names
from _sentinel import SentinelGroup
from _serverlog import LogWaitTimeout, LogWatch
from _servers import HOST, ServerProcess, execute
from redis.asyncio.cluster import ClusterPubSub, RedisCluster
from redis.crc import key_slot

pytestmark = pytest.mark.slow

MESSAGE_TIMEOUT = 5.0
# Two keys of one hash tag: the script touches only that tag's slot, as aiolocks' scripts do.
TWO_KEYS = "redis.call('SET', KEYS[1], ARGV[1]); return {redis.call('INCR', KEYS[2]), ARGV[1]}"


def node_client(node: ServerProcess) -> redis.asyncio.Redis:
    """A plain client on one node (no redirections followed)."""
    return redis.asyncio.Redis(host=HOST, port=node.port)


async def next_sharded(pubsub: ClusterPubSub, cluster_r: RedisCluster, key: str) -> Any:
    """The next pub/sub message (subscribe confirmations included) on the connection to the
    node that owns ``key``, or an AssertionError after MESSAGE_TIMEOUT."""
    node = cluster_r.get_node_from_key(key)
    assert node is not None
    deadline = time.monotonic() + MESSAGE_TIMEOUT
    while (remaining := deadline - time.monotonic()) > 0:
        message = await pubsub.get_sharded_message(timeout=remaining, target_node=node)
        if message is not None:
            return message
    raise AssertionError(f"no sharded pub/sub message from {node.name} in {MESSAGE_TIMEOUT}s")


async def test_cluster_forms_with_slots_on_every_node(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    assert cluster.running
    assert len(cluster.nodes) == 3
    assert cluster.startup_url == cluster.urls[0]
    assert cluster.startup_seconds > 0
    for node in cluster.nodes:
        async with node_client(node) as client:
            info = await execute(client)("CLUSTER INFO")
            assert info["cluster_state"] == "ok", info
            assert int(info["cluster_known_nodes"]) == 3
            assert int(info["cluster_size"]) == 3
            assert int(info["cluster_slots_assigned"]) == 16384
            config = await client.config_get("notify-keyspace-events")
            assert set(str(config["notify-keyspace-events"])) == set("AKE"), config
            server = await client.info("server")
            assert (server.get("server_name") == "valkey") == (cluster.kind == "valkey")
    owners = {node.port for node in cluster_r.get_primaries()}
    assert owners == {node.port for node in cluster.nodes}
    for node in cluster.nodes:
        slots = list(cluster.slots_of(node))
        assert len(slots) > 5000
        assert all(cluster.owner(slot) is node for slot in slots)
        for slot in (slots[0], slots[-1]):
            assert cluster_r.nodes_manager.slots_cache[slot][0].port == node.port


async def test_names_on_each_node_land_on_that_node(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    per_node = names_on_each_node(cluster, 3, prefix="harness")
    assert [len(names) for names in per_node] == [3, 3, 3]
    for node, names in zip(cluster.nodes, per_node, strict=True):
        for name in names:
            await cluster_r.set(f"x:{{{name}}}:k", node.port)
        async with node_client(node) as client:
            assert await client.dbsize() == 3
            for name in names:
                assert await client.get(f"x:{{{name}}}:k") == str(node.port).encode()
    spread = spread_names(cluster, 7)
    assert [cluster.nodes.index(cluster.node_of(n)) for n in spread] == [0, 1, 2, 0, 1, 2, 0]


async def test_evalsha_with_one_hash_tag_runs_on_every_node(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    sha = await cluster_r.script_load(TWO_KEYS)  # "SCRIPT LOAD" goes to every primary
    for node in cluster.nodes:
        async with node_client(node) as client:
            assert await client.script_exists(sha) == [True]
    for node, (name,) in zip(cluster.nodes, names_on_each_node(cluster, 1), strict=True):
        keys = (f"x:{{{name}}}:a", f"x:{{{name}}}:b")
        reply = await cluster_r.evalsha(sha, 2, *keys, "v")
        assert reply == [1, b"v"]
        async with node_client(node) as client:
            assert await client.get(keys[0]) == b"v"
    first, second = (names[0] for names in names_on_each_node(cluster, 1)[:2])
    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
        await cluster_r.evalsha(sha, 2, f"x:{{{first}}}:a", f"x:{{{second}}}:a", "v")


async def test_sharded_pubsub_round_trip_on_every_node(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    channels = [f"ch:{{{names[0]}}}" for names in names_on_each_node(cluster, 1)]
    pubsub = cluster_r.pubsub()
    try:
        await pubsub.ssubscribe(*channels)
        # One dedicated connection per node that owns one of the channels.
        assert len(pubsub.node_pubsub_mapping) == 3
        for channel in channels:
            confirmation = await next_sharded(pubsub, cluster_r, channel)
            assert (confirmation["type"], confirmation["channel"]) == (
                "ssubscribe",
                channel.encode(),
            )
        for channel in channels:
            assert await cluster_r.spublish(channel, f"to {channel}") == 1
        for channel in channels:
            message = await next_sharded(pubsub, cluster_r, channel)
            assert message["type"] == "smessage"
            assert (message["channel"], message["data"]) == (
                channel.encode(),
                f"to {channel}".encode(),
            )
    finally:
        await pubsub.aclose()


async def test_migrate_slot_moves_keys_and_client_follows(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    (name,), (other,), _ = names_on_each_node(cluster, 1, prefix="move")
    slot = key_slot(name.encode())
    source, target = cluster.nodes[0], cluster.nodes[1]
    keys = [f"x:{{{name}}}:{i}" for i in range(5)]
    for key in keys:
        await cluster_r.set(key, key)
    seen: dict[str, Any] = {}

    async def on_step(step: str) -> None:
        if step == "keys-moved":
            # Half-way: the source answers ASK for its moved keys, the client follows it.
            seen[step] = await cluster_r.get(keys[0])

    try:
        await cluster.migrate_slot(slot, target, batch=2, on_step=on_step)
        assert seen == {"keys-moved": keys[0].encode()}
        assert cluster.owner(slot) is target
        async with node_client(target) as client:
            assert await client.mget(keys) == [key.encode() for key in keys]
        async with node_client(source) as client:
            with pytest.raises(redis.exceptions.MovedError) as moved:
                await client.get(keys[0])
            assert (moved.value.slot_id, moved.value.port) == (slot, target.port)
        # The client's slot map still says source: it follows MOVED and learns the new owner.
        assert await cluster_r.get(keys[1]) == keys[1].encode()
        owner = cluster_r.get_node_from_key(keys[0])
        assert owner is not None and owner.port == target.port
        assert await cluster_r.get(f"x:{{{other}}}") is None  # the rest of the cluster is intact
    finally:
        if cluster.owner(slot) is not source:
            await cluster.migrate_slot(slot, source)
    assert await cluster_r.get(keys[2]) == keys[2].encode()


async def test_slot_move_unsubscribes_sharded_subscribers(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    """What a notifier must handle: the node that loses a slot drops its subscribers of that
    slot's sharded channels (a server-sent ``sunsubscribe``) and nobody re-subscribes them."""
    (name,), _, _ = names_on_each_node(cluster, 1, prefix="chmove")
    channel = f"ch:{{{name}}}"
    slot = key_slot(channel.encode())
    source = cluster.owner(slot)
    pubsub = cluster_r.pubsub()
    try:
        await pubsub.ssubscribe(channel)
        assert (await next_sharded(pubsub, cluster_r, channel))["type"] == "ssubscribe"
        await cluster.migrate_slot(slot, cluster.nodes[2])
        dropped = await next_sharded(pubsub, cluster_r, channel)  # client's map: still source
        assert (dropped["type"], dropped["channel"]) == ("sunsubscribe", channel.encode())
        async with node_client(cluster.nodes[2]) as client:
            assert await execute(client)("SPUBLISH", channel, "lost") == 0
    finally:
        await pubsub.aclose()
        await cluster.migrate_slot(slot, source)


async def test_restart_node_keeps_its_id_and_slots_but_not_its_keys(
    cluster: Cluster, cluster_r: RedisCluster
) -> None:
    node = cluster.nodes[2]
    (name,) = names_on_each_node(cluster, 1, prefix="restart")[2]
    await cluster_r.set(f"x:{{{name}}}", "lost in the crash")
    await cluster.restart_node(node)
    assert cluster.running
    async with node_client(node) as client:
        assert await execute(client)("CLUSTER", "MYID") == cluster.ids[2].encode()
        info = await execute(client)("CLUSTER INFO")
        assert info["cluster_state"] == "ok", info
        assert await client.dbsize() == 0
    assert await cluster_r.get(f"x:{{{name}}}") is None  # the client reconnects by itself
    await cluster_r.set(f"x:{{{name}}}", "after")
    assert await cluster_r.get(f"x:{{{name}}}") == b"after"


def test_log_watch_times_out_on_a_line_never_logged(
    server_factory: Any,
) -> None:
    server = server_factory(kind="valkey")
    watch = LogWatch(server, from_start=True)
    assert watch.count("Ready to accept connections") == 1
    with pytest.raises(LogWaitTimeout, match="did not log"):
        watch.wait("a line no server writes", 0.05)


async def test_sentinel_failover_promotes_replica_and_master_for_follows(
    sentinel_group: SentinelGroup,
) -> None:
    group = sentinel_group
    old_primary, replica = group.primary, group.replica
    assert group.startup_seconds > 0
    for host, port in group.sentinel_addresses:
        async with redis.asyncio.Redis(host=host, port=port) as sentinel:
            peers = await sentinel.sentinel_sentinels(group.master_name)
            assert isinstance(peers, list) and len(peers) == 2
            replicas = await sentinel.sentinel_slaves(group.master_name)
            assert isinstance(replicas, list)
            assert [int(r["port"]) for r in replicas] == [replica.port]
    client = group.master_for()
    try:
        await client.set("k", "before failover")
        assert await execute(client)("WAIT", 1, 5000) == 1
        address = await group.kill_primary_and_wait_failover()
        assert address == (HOST, replica.port)
        assert group.primary is replica and not old_primary.running
        assert group.failover_seconds > 0
        assert await group.sentinel().discover_master(group.master_name) == address
        assert await client.get("k") == b"before failover"
        assert (await execute(client)("ROLE"))[0] == b"master"
        async with node_client(replica) as direct:
            await client.set("k", "after failover")
            assert await direct.get("k") == b"after failover"
    finally:
        await client.aclose()
