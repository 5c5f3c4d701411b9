"""`aiolocks.sync`: the asyncio primitives for threads, on a real server (in this process;
tests/test_sync_processes.py has the multi-process, signal, exit and fork cases)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from _servers import ServerProcess

from aiolocks import Limit, LockLost, LockNotOwned, LockReentry, LockTimeout
from aiolocks._engine._leasedlock import DEFAULT_LOCAL_HANDOFF
from aiolocks.sync import (
    RedisMutex,
    RedisRateLimiter,
    RedisReadWriteLock,
    RedisRegistry,
    RedisSemaphore,
    _clients,
    _runner,
)

BOUND = 10.0  # longest wait for a thread's step


@pytest.fixture(autouse=True, scope="module")
def background_loop() -> Iterator[None]:
    """The sync door's loop ends with the module, before the session stops its servers
    (a server gone under an idle engine is not this module's subject)."""
    yield
    _runner.process().stop()


@pytest.fixture
def sync_r(valkey_notify: ServerProcess) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(valkey_notify.url)
    client.flushall()
    try:
        yield client
    finally:
        client.close()


def run_threads(count: int, target: object) -> None:
    threads = [threading.Thread(target=target) for _ in range(count)]  # type: ignore[arg-type]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND * 3)
        assert not thread.is_alive()


def test_threads_take_turns_counter_exact_fences_rising(sync_r: redis.Redis) -> None:
    mutex = RedisMutex(sync_r, "orders:42")
    fences: list[int] = []

    def work() -> None:
        for _ in range(30):
            with mutex:
                value = int(sync_r.get("counter") or 0)
                fences.append(mutex.fencing_token or 0)
                sync_r.set("counter", value + 1)

    run_threads(6, work)
    assert int(sync_r.get("counter") or 0) == 180
    assert fences == sorted(set(fences)) and len(fences) == 180
    assert not mutex.locked()


def test_same_keys_as_the_asyncio_mutex(sync_r: redis.Redis) -> None:
    with RedisMutex(sync_r, "orders:42") as mutex:
        assert sync_r.exists("aiolocks:mutex:{orders:42}:owner")
        info = mutex.inspect()
        # (the counter is at the top of the fence block the cohort's grant reserved)
        top = (mutex.fencing_token or 0) + DEFAULT_LOCAL_HANDOFF
        assert info.owner is not None and info.fence == top
    assert not sync_r.exists("aiolocks:mutex:{orders:42}:owner")


def test_another_threads_holding_is_never_released(sync_r: redis.Redis) -> None:
    mutex = RedisMutex(sync_r, "owned")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            mutex.release()
        except LockNotOwned as error:
            errors.append(error)

    with mutex:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(BOUND)
        assert mutex.held() and mutex.locked()
    assert len(errors) == 1 and "current thread does not hold it" in str(errors[0])
    with pytest.raises(LockNotOwned, match="current thread"):
        mutex.release()


def test_not_reentrant_per_thread(sync_r: redis.Redis) -> None:
    mutex = RedisMutex(sync_r, "again")
    with mutex, pytest.raises(LockReentry, match="current thread already holds it"):
        mutex.acquire()
    rw = RedisReadWriteLock(sync_r, "catalog")
    with rw.read(), pytest.raises(LockReentry, match="other side"):
        rw.write().acquire()


def test_busy_try_and_timeout(sync_r: redis.Redis) -> None:
    holder = RedisMutex(sync_r, "busy")
    waiter = RedisMutex(sync_r, "busy", timeout=0.3)
    with holder:
        results: list[object] = []

        def attempt() -> None:
            results.append(waiter.acquire(blocking=False))
            started = time.monotonic()
            try:
                with waiter:
                    results.append("entered")
            except LockTimeout:
                results.append(time.monotonic() - started)

        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join(BOUND)
    assert results[0] is False
    assert isinstance(results[1], float) and 0.25 <= results[1] < 3.0
    assert sync_r.llen("aiolocks:mutex:{busy}:queue") == 0


def test_lost_lease_sets_the_event_calls_on_lost_and_raises_at_exit(
    sync_r: redis.Redis,
) -> None:
    reports: list[LockLost] = []
    mutex = RedisMutex(sync_r, "lease", ttl=0.6, on_lost=reports.append)
    body_finished = False
    with pytest.raises(LockLost), mutex:
        sync_r.set("aiolocks:mutex:{lease}:owner", "someone-else", px=5000)
        # The renewal at ttl/3 finds another owner: reported well within the ttl.
        assert mutex.lost.wait(BOUND)
        body_finished = True  # a loss cannot cancel a thread's body
    assert body_finished
    assert len(reports) == 1 and reports[0].name == "lease"


def test_decorator(sync_r: redis.Redis) -> None:
    mutex = RedisMutex(sync_r, "decorated")

    @mutex
    def charge(amount: int) -> int:
        assert mutex.held()
        return amount * 2

    assert charge(21) == 42
    assert not mutex.held()


def test_bad_arguments_fail_before_any_redis_call(sync_r: redis.Redis) -> None:
    async_client = redis.asyncio.Redis.from_url("redis://127.0.0.1:1")
    with pytest.raises(TypeError, match=r"synchronous redis\.Redis"):
        RedisMutex(async_client, "x")
    with pytest.raises(ValueError):
        RedisMutex(sync_r, "")
    with pytest.raises(ValueError):
        RedisMutex(sync_r, "a{b}")
    with pytest.raises(ValueError):
        RedisMutex(sync_r, "x", ttl=0)
    with pytest.raises(ValueError):
        RedisSemaphore(sync_r, "x", limit=0)
    with pytest.raises(TypeError, match="on_lost"):
        RedisMutex(sync_r, "x", on_lost=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RedisMutex(sync_r, "x").acquire(timeout=-1)
    assert sync_r.dbsize() == 0


def test_a_url_is_a_client(valkey_notify: ServerProcess) -> None:
    with RedisMutex(valkey_notify.url, "by-url") as mutex:
        assert mutex.locked()


def test_semaphore_never_more_than_its_limit(sync_r: redis.Redis) -> None:
    semaphore = RedisSemaphore(sync_r, "gpu", limit=3)
    inside, most = [0], [0]
    guard = threading.Lock()

    def work() -> None:
        for _ in range(10):
            with semaphore:
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.002)
                with guard:
                    inside[0] -= 1

    run_threads(8, work)
    assert 1 <= most[0] <= 3
    assert semaphore.holders() == 0 and semaphore.limit == 3


def test_read_write_lock(sync_r: redis.Redis) -> None:
    rw = RedisReadWriteLock(sync_r, "catalog")
    tried: list[bool] = []
    with rw.read():
        assert rw.inspect().readers == 1
        thread = threading.Thread(target=lambda: tried.append(rw.write().acquire(blocking=False)))
        thread.start()
        thread.join(BOUND)
    assert tried == [False]
    with rw.write():
        assert rw.inspect().writer is not None


def test_rate_limiter_and_registry(sync_r: redis.Redis) -> None:
    slow = RedisRateLimiter(sync_r, "api", rate=1, per=60, burst=2)
    assert slow.acquire() and slow.acquire()
    assert not slow.acquire(blocking=False)
    assert not slow.acquire(timeout=0.1)  # the next slot is ~30 s away: refused at once
    assert slow.statistics().permits == 2
    fast = RedisRateLimiter(sync_r, "fast", rate=100, burst=1)
    with fast, fast:  # the second waits for its slot, about 10 ms
        pass
    assert fast.inspect().burst == 1
    # a live change from a thread: the other instance adopts it; several limits
    other = RedisRateLimiter(sync_r, "api", rate=1, per=60, burst=2)
    assert slow.set_limits(limits=[Limit(1, per=60, burst=3)]) == (Limit(1.0, 60.0, 2),)
    assert other.acquire(blocking=False) and other.limits == (Limit(1.0, 60.0, 3),)
    assert not other.acquire(blocking=False)  # the 2 taken before still count
    registry = RedisRegistry(sync_r, "users")
    assert registry.register("alice") == 1
    assert registry.register_many(["bob", "alice"]) == [2, 1]
    assert registry.name_of(2) == "bob" and registry.id_of("carol") is None
    assert dict(registry) == {"alice": 1, "bob": 2} and registry.count() == 2


def test_a_waiting_thread_sends_no_commands(sync_r: redis.Redis) -> None:
    """Waits never poll: a thread queued for 1 s costs its queueing and nothing more."""
    # Strict FIFO: the waiting thread queued on the server (a cohort's waits here, no
    # command at all).
    holder = RedisMutex(sync_r, "idle", local_handoff=0)
    waiter = RedisMutex(sync_r, "idle", local_handoff=0)
    pubsub = sync_r.pubsub()  # type: ignore[no-untyped-call]
    pubsub.subscribe("__keyspace@0__:aiolocks:mutex:{idle}:queue")
    assert pubsub.get_message(timeout=BOUND) is not None  # the subscription's confirmation
    got: list[bool] = []
    with holder:

        def wait() -> None:
            got.append(waiter.acquire(timeout=BOUND))
            waiter.release()

        thread = threading.Thread(target=wait)
        thread.start()
        event = pubsub.get_message(timeout=BOUND)
        assert event is not None and event["data"] == b"rpush"  # queued
        before = _calls(sync_r)
        time.sleep(1.0)
        during = _calls(sync_r) - before - 1  # the INFO of the first reading
    thread.join(BOUND)
    assert got == [True]
    assert during <= 2  # a heartbeat at most (ttl/3), no per-moment polling
    pubsub.close()


def _calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(value["calls"]) for value in stats.values())


def test_the_clients_database_and_name_are_the_engines(valkey_notify: ServerProcess) -> None:
    """The engine's client is made from the sync client's settings: same database, same
    client name on its connections."""
    server = valkey_notify.url.rsplit("/", 1)[0]
    client = redis.Redis.from_url(server + "/3", client_name="billing-worker")
    client.flushdb()
    other_db = redis.Redis.from_url(server + "/0")
    with RedisMutex(client, "orders:7"):
        assert client.exists("aiolocks:mutex:{orders:7}:owner")
        assert not other_db.exists("aiolocks:mutex:{orders:7}:owner")
        names = [entry["name"] for entry in client.client_list()]
        assert names.count("billing-worker") >= 2  # the user's connection and the engine's
    client.close()
    other_db.close()


def test_a_valkey_py_client(valkey_notify: ServerProcess) -> None:
    valkey = pytest.importorskip("valkey")
    client = valkey.Valkey.from_url(valkey_notify.url)
    client.flushall()
    mutex = RedisMutex(client, "orders:8")
    with mutex:
        assert mutex.inspect().owner is not None
    assert not mutex.locked()
    client.close()


def test_a_cluster_client(cluster: Any) -> None:
    """A sync RedisCluster: the engine runs on an asyncio RedisCluster of the same nodes."""
    asyncio.run(cluster.flushall())
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    mutex = RedisMutex(client, "orders:9")
    counter = "{orders:9}:counter"

    def work() -> None:
        for _ in range(10):
            with mutex:
                client.set(counter, int(client.get(counter) or 0) + 1)

    run_threads(4, work)
    assert int(client.get(counter) or 0) == 40
    assert not mutex.locked()
    client.close()


def test_sync_clients_with_the_same_settings_share_one_engine(
    valkey_notify: ServerProcess,
) -> None:
    """A client made per task (a common Celery habit) costs no new engine client."""
    first = redis.Redis.from_url(valkey_notify.url)
    again = redis.Redis.from_url(valkey_notify.url)
    other = redis.Redis.from_url(valkey_notify.url, client_name="other")
    assert _clients.async_client(first) is _clients.async_client(again)
    assert _clients.async_client(first) is not _clients.async_client(other)
    for client in (first, again, other):
        client.close()
