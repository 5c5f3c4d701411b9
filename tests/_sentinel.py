"""A primary, its replica(s) and three sentinels on loopback ports, started by the suite.

``SentinelGroup.start()`` starts the primary, then the replicas (``--replicaof``) and waits for
each to log a finished sync, then three sentinels (``--sentinel`` with a generated
``sentinel.conf``) and waits until each has logged the replicas and the two other sentinels.
``kill_primary_and_wait_failover`` SIGKILLs the primary and waits for ``+switch-master`` on every
sentinel's pub/sub. Start and stop from the main thread (see _servers).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from _serverlog import LogWatch
from _servers import HOST, ServerKind, ServerProcess, execute
from redis.asyncio.sentinel import Sentinel

__all__ = ["MASTER_NAME", "SentinelGroup", "SentinelProcess"]

MASTER_NAME = "mymaster"
QUORUM = 2
SENTINELS = 3
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
READY_TIMEOUT = 15.0
# A split vote makes the sentinels retry the election after 2 x failover-timeout (10 s), so a
# loaded machine can need two or three elections: allow for them.
FAILOVER_WAIT = 60.0
SYNCED = "<-> REPLICA sync: Finished with success"  # "MASTER <->" (Redis), "PRIMARY <->" (Valkey)
# Sentinel's hello and INFO periods (2 s and 10 s) made short with SENTINEL DEBUG (Redis 7+,
# Valkey), so the sentinels find each other and the replicas within a fraction of a second.
_DEBUG_PERIODS = ("publish-period", 100, "info-period", 500, "ask-period", 200, "ping-period", 200)
# Diskless sync starts after 5 s by default (Redis 7), and Valkey finishes a disk-based load on
# its next 1 s cron tick: a replica here should sync at once, straight from the socket.
_DATA_ARGS = ("--repl-diskless-sync-delay", "0", "--repl-diskless-load", "on-empty-db")


class SentinelProcess(ServerProcess):
    """``<server> sentinel.conf --sentinel``: the config file is written into the process's own
    directory at each start (a sentinel rewrites it as it learns)."""

    def __init__(self, binary: str, *, kind: ServerKind, primary_port: int) -> None:
        super().__init__(binary, kind=kind, notify=False)
        self.primary_port = primary_port

    @property
    def name(self) -> str:
        return f"{self.kind}-sentinel"

    def _command(self, port: int, workdir: Path) -> list[str]:
        conf = workdir / "sentinel.conf"
        conf.write_text(
            f"sentinel monitor {MASTER_NAME} {HOST} {self.primary_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        binary, *options = super()._command(port, workdir)
        return [binary, str(conf), "--sentinel", *options]


class SentinelGroup:
    """One monitored primary (``master_name``), ``replicas`` replicas and three sentinels."""

    master_name = MASTER_NAME

    def __init__(self, binary: str, *, kind: ServerKind, notify: bool = True, replicas: int = 1):
        self.binary = binary
        self.kind: ServerKind = kind
        self.primary = ServerProcess(binary, kind=kind, notify=notify, extra_args=_DATA_ARGS)
        self.replicas: list[ServerProcess] = []
        self.sentinels: list[SentinelProcess] = []
        self._replica_count = replicas
        self._notify = notify
        self._clients: list[redis.asyncio.Redis] = []
        self._sentinel_clients: list[Sentinel] = []
        self.startup_seconds = 0.0
        self.failover_seconds = 0.0  # how long the last kill_primary_and_wait_failover took

    def __repr__(self) -> str:
        primary = self.primary.port if self.primary.running else None
        replicas = [r.port for r in self.replicas if r.running]
        return f"<SentinelGroup {self.kind} primary={primary} replicas={replicas}>"

    @property
    def replica(self) -> ServerProcess:
        """The (first) replica."""
        if not self.replicas:
            raise RuntimeError(f"{self!r} has no replica left")
        return self.replicas[0]

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(HOST, sentinel.port) for sentinel in self.sentinels]

    @property
    def primary_address(self) -> tuple[str, int]:
        return (HOST, self.primary.port)

    # -- start / stop -------------------------------------------------------------------------

    def start(self) -> SentinelGroup:
        """Start everything and wait until the sentinels know the replicas and each other."""
        began = time.monotonic()

        def remaining() -> float:
            return READY_TIMEOUT - (time.monotonic() - began)

        try:
            self.primary.start()
            replica_args = [*_DATA_ARGS, "--replicaof", HOST, str(self.primary.port)]
            self.replicas = [
                ServerProcess(
                    self.binary, kind=self.kind, notify=self._notify, extra_args=replica_args
                ).start()
                for _ in range(self._replica_count)
            ]
            for replica in self.replicas:
                LogWatch(replica, from_start=True).wait(SYNCED, remaining())
            self.sentinels = [
                SentinelProcess(self.binary, kind=self.kind, primary_port=self.primary.port)
                for _ in range(SENTINELS)
            ]
            for sentinel in self.sentinels:
                sentinel.start()
                with redis.Redis(host=HOST, port=sentinel.port) as client:
                    execute(client)("SENTINEL", "DEBUG", *_DEBUG_PERIODS)
            for sentinel in self.sentinels:
                watch = LogWatch(sentinel, from_start=True)
                watch.wait("+sentinel sentinel ", remaining(), count=SENTINELS - 1)
                for replica in self.replicas:
                    watch.wait(f"+slave slave {HOST}:{replica.port} ", remaining())
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        for server in (*self.sentinels, self.primary, *self.replicas):
            server.stop()

    # -- clients ------------------------------------------------------------------------------

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A ``redis.asyncio.sentinel.Sentinel`` over the three sentinels (closed by
        ``aclose_clients``)."""
        make: Callable[..., Sentinel] = Sentinel  # untyped upstream
        sentinel = make(self.sentinel_addresses, **kwargs)
        self._sentinel_clients.append(sentinel)
        return sentinel

    def master_for(self, **kwargs: Any) -> redis.asyncio.Redis:
        """A client that follows the primary through the sentinels (closed by
        ``aclose_clients``, together with the sentinel connections it used)."""
        client: redis.asyncio.Redis = self.sentinel().master_for(self.master_name, **kwargs)
        self._clients.append(client)
        return client

    async def aclose_clients(self) -> None:
        """Close every client made by ``sentinel()`` and ``master_for()`` (on their loop)."""
        clients, self._clients = self._clients, []
        sentinels, self._sentinel_clients = self._sentinel_clients, []
        for client in clients:
            await client.aclose()
        for sentinel in sentinels:
            await sentinel.aclose()

    # -- failover -----------------------------------------------------------------------------

    async def kill_primary_and_wait_failover(
        self, timeout: float = FAILOVER_WAIT
    ) -> tuple[str, int]:
        """SIGKILL the primary and wait until every sentinel announces ``+switch-master``.

        Returns the new primary's address; ``primary`` is then the promoted replica (which
        leaves ``replicas``).
        """
        began = time.monotonic()
        clients = [redis.asyncio.Redis(host=HOST, port=s.port) for s in self.sentinels]
        pubsubs = [client.pubsub(ignore_subscribe_messages=True) for client in clients]
        try:
            for pubsub in pubsubs:
                await pubsub.subscribe("+switch-master")
            old = self.primary
            os.kill(old.pid, signal.SIGKILL)
            try:
                addresses = await asyncio.wait_for(
                    asyncio.gather(*(_switched_to(pubsub) for pubsub in pubsubs)), timeout
                )
            except TimeoutError:
                raise AssertionError(
                    f"{self!r}: no +switch-master on every sentinel within {timeout:g}s\n"
                    + self._sentinel_logs()
                ) from None
        finally:
            for pubsub in pubsubs:
                close: Callable[[], Awaitable[None]] = pubsub.aclose  # untyped upstream
                await close()
            for client in clients:
                await client.aclose()
        if len(set(addresses)) != 1:
            raise AssertionError(f"sentinels disagree on the new primary: {addresses}")
        address = addresses[0]
        promoted = next((r for r in self.replicas if r.port == address[1]), None)
        if promoted is None:
            raise AssertionError(f"{self!r}: sentinels promoted unknown server {address}")
        old.stop()  # already dead: only reaps it and removes its directory
        self.primary = promoted
        self.replicas.remove(promoted)
        self.failover_seconds = time.monotonic() - began
        return address

    def _sentinel_logs(self) -> str:
        """The last lines of each sentinel's log, for a failover that did not happen."""
        parts = []
        for sentinel in self.sentinels:
            lines = sentinel.log().splitlines()[-25:]
            parts.append(f"--- {sentinel!r}:\n" + "\n".join(lines))
        return "\n".join(parts)


async def _switched_to(pubsub: redis.asyncio.client.PubSub) -> tuple[str, int]:
    """The new address from the first ``+switch-master`` message for our master."""
    while True:
        message = await pubsub.get_message(timeout=None)
        if message is None or message["type"] != "message":
            continue
        data = message["data"]
        text = data.decode() if isinstance(data, bytes) else str(data)
        name, _old_host, _old_port, host, port = text.split()
        if name == MASTER_NAME:
            return host, int(port)
