"""A real Redis/Valkey Cluster of three primaries on loopback ports, formed by the suite.

The nodes are ``ServerProcess``es with cluster mode on. ``Cluster.start()`` splits the 16384
slots in three (``CLUSTER ADDSLOTS``, which Redis 6.2 has too), joins the nodes (``CLUSTER
MEET``), waits for every node to log "Cluster state changed: ok" and checks that every node
reports the same slot map.
``migrate_slot`` moves one slot the way an operator does (IMPORTING/MIGRATING, ``MIGRATE`` in
batches, ``SETSLOT NODE`` everywhere). Start and stop from the main thread (see _servers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import redis
import redis.asyncio
from _serverlog import LogWatch
from _servers import HOST, ServerKind, ServerProcess, execute
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

__all__ = ["SLOTS", "Cluster", "names_on_each_node", "spread_names"]

SLOTS = 16384
NODE_TIMEOUT_MS = 3000
# A primary holds its state at "fail" for 2 s after start (the server's CLUSTER_WRITABLE_DELAY),
# so forming takes a bit over 2 s however fast the handshake is.
FORM_TIMEOUT = 20.0
STATE_OK = "Cluster state changed: ok"
MIGRATE_TIMEOUT_MS = 5000
_NODE_ARGS = (
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",  # relative to the node's own directory
    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
)  # fmt: skip


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    """Split 0..16383 into ``masters`` contiguous ranges, as ``redis-cli --cluster`` does."""
    edges = [round(SLOTS * i / masters) for i in range(masters + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(masters)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Cluster:
    """Three cluster-mode primaries of one server kind, no replicas.

    ``nodes[i]`` owns ``ranges[i]`` after start; ``owner(slot)`` follows later
    ``migrate_slot`` calls. Clients made by ``client()`` belong to the caller.
    """

    def __init__(self, binary: str, *, kind: ServerKind, notify: bool = True, masters: int = 3):
        self.kind: ServerKind = kind
        self.notify = notify
        self.ranges = _slot_ranges(masters)
        self.nodes = [
            ServerProcess(binary, kind=kind, notify=notify, extra_args=_NODE_ARGS)
            for _ in range(masters)
        ]
        self.ids: list[str] = []
        self._owner: list[int] = []  # slot -> index into nodes
        self._broken = False  # a slot move or node restart broke off: form a new cluster
        self.startup_seconds = 0.0  # how long the last start() took

    def __repr__(self) -> str:
        return f"<Cluster {self.name} ports={[n.port for n in self.nodes if n.running]}>"

    @property
    def name(self) -> str:
        return f"{self.kind}-cluster"

    @property
    def running(self) -> bool:
        """Formed, every node up, and no slot move or node restart left half-done."""
        return bool(self.ids) and not self._broken and all(node.running for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def startup_url(self) -> str:
        return self.nodes[0].url

    # -- forming ------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the nodes, assign the slots, join them and wait until all report ok."""
        began = time.monotonic()
        try:
            for node in self.nodes:
                node.start()
            watches = [LogWatch(node, from_start=True) for node in self.nodes]
            clients = [redis.Redis(host=HOST, port=node.port) for node in self.nodes]
            try:
                runs = [execute(client) for client in clients]
                self.ids = [_text(run("CLUSTER", "MYID")) for run in runs]
                for run, (first, last) in zip(runs, self.ranges, strict=True):
                    run("CLUSTER", "ADDSLOTS", *range(first, last + 1))
                # Every pair meets directly, instead of learning of each other by gossip (which
                # can take seconds).
                for i, run in enumerate(runs):
                    for node in self.nodes[i + 1 :]:
                        run("CLUSTER", "MEET", HOST, node.port)
                for watch in watches:
                    watch.wait(STATE_OK, FORM_TIMEOUT - (time.monotonic() - began))
                self._owner = [i for i, (a, b) in enumerate(self.ranges) for _ in range(a, b + 1)]
                for client in clients:
                    self._check_slot_map(client)
            finally:
                for client in clients:
                    client.close()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.ids, self._owner, self._broken = [], [], False

    async def restart_node(self, node: ServerProcess, timeout: float = FORM_TIMEOUT) -> None:
        """Restart ``node`` on its port with its ``nodes.conf`` (same id and slots, no data:
        a crash that loses the node's keys) and wait until it reports the cluster ok again.

        The restart blocks the loop briefly (stop, spawn, PING); the wait for the log line
        (over 2 s, the server's own delay) runs in a thread, so other tasks keep running.
        """
        self._broken = True  # until the node is back
        node.restart(keep_dir=True)
        watch = LogWatch(node, from_start=True)
        await asyncio.to_thread(watch.wait, STATE_OK, timeout)
        self._broken = False

    def _check_slot_map(self, client: redis.Redis) -> None:
        """Assert that ``client``'s node reports exactly our slot map (CLUSTER SLOTS)."""
        reported: dict[int, tuple[int, int]] = {}
        for first, last, primary, *_replicas in execute(client)("CLUSTER", "SLOTS"):
            port = int(primary[1])
            reported[port] = (int(first), int(last)) if port not in reported else (-1, -1)
        expected = {node.port: rng for node, rng in zip(self.nodes, self.ranges, strict=True)}
        if reported != expected:
            raise AssertionError(
                f"{self!r}: node {client} reports slots {reported}, expected {expected}"
            )

    # -- slot map -----------------------------------------------------------------------------

    def owner(self, slot: int) -> ServerProcess:
        """The node that owns ``slot`` now."""
        return self.nodes[self._owner[slot]]

    def node_of(self, name: str | bytes) -> ServerProcess:
        """The node that owns the slot of ``name`` (a key, or a name used as a hash tag)."""
        return self.owner(key_slot(name.encode() if isinstance(name, str) else name))

    def slots_of(self, node: ServerProcess) -> Iterator[int]:
        """The slots ``node`` owns now, in order."""
        index = self.nodes.index(node)
        return (slot for slot, owner in enumerate(self._owner) if owner == index)

    # -- clients ------------------------------------------------------------------------------

    def client(self, **kwargs: Any) -> RedisCluster:
        """A new ``RedisCluster`` client, bootstrapped from the first node; caller closes it."""
        return RedisCluster(host=HOST, port=self.nodes[0].port, **kwargs)

    async def flushall(self) -> None:
        """FLUSHALL on every node and restore the notification setting (test isolation)."""
        for node in self.nodes:
            async with redis.asyncio.Redis(host=HOST, port=node.port) as client:
                await client.flushall()
                await client.config_set("notify-keyspace-events", node.notify_flags)

    # -- resharding ---------------------------------------------------------------------------

    async def migrate_slot(
        self,
        slot: int,
        to_node: ServerProcess,
        *,
        batch: int = 100,
        on_step: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """Move ``slot`` and its keys to ``to_node`` the way an operator reshards.

        Order: target IMPORTING, source MIGRATING, ``MIGRATE ... KEYS`` in batches of
        ``batch`` until ``GETKEYSINSLOT`` is empty, then ``SETSLOT NODE`` on the target, the
        source and the rest. ``on_step(name)`` is awaited after "importing", "migrating" and
        "keys-moved", so a test can act while the slot is half-way.
        """
        source = self.owner(slot)
        if source is to_node:
            raise ValueError(f"slot {slot} is already on {to_node!r}")
        target_id = self.ids[self.nodes.index(to_node)]
        source_id = self.ids[self.nodes.index(source)]
        others = [node for node in self.nodes if node is not source and node is not to_node]
        clients = {node.port: redis.asyncio.Redis(host=HOST, port=node.port) for node in self.nodes}
        on_target, on_source = execute(clients[to_node.port]), execute(clients[source.port])

        async def step(name: str) -> None:
            if on_step is not None:
                await on_step(name)

        self._broken = True  # until the move completes
        try:
            await on_target("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            await step("importing")
            await on_source("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            await step("migrating")
            while keys := await on_source("CLUSTER", "GETKEYSINSLOT", slot, batch):
                await on_source(
                    "MIGRATE", HOST, to_node.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys
                )
            await step("keys-moved")
            for node in (to_node, source, *others):
                await execute(clients[node.port])("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            self._owner[slot] = self.nodes.index(to_node)
            self._broken = False
        finally:
            for client in clients.values():
                await client.aclose()


def names_on_each_node(cluster: Cluster, count: int, prefix: str = "name") -> list[list[str]]:
    """``count`` names per node (in node order) whose hash slot that node owns now.

    A name used as a hash tag (``{name}``, as aiolocks' keys do) lands on the same node.
    """
    found: list[list[str]] = [[] for _ in cluster.nodes]
    i = 0
    while min(len(names) for names in found) < count:
        name = f"{prefix}{i}"
        names = found[cluster.nodes.index(cluster.node_of(name))]
        if len(names) < count:
            names.append(name)
        i += 1
    return found


def spread_names(cluster: Cluster, total: int, prefix: str = "name") -> list[str]:
    """``total`` names taking turns over the nodes (node 0, 1, 2, 0, ...)."""
    per_node = names_on_each_node(cluster, -(-total // len(cluster.nodes)), prefix)
    interleaved = [name for group in zip(*per_node, strict=True) for name in group]
    return interleaved[:total]
