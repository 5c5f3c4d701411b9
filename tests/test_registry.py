"""`RedisRegistry`: idempotent, dense, batched name -> id registration.

Real servers (and fakeredis for the logic), concurrent tasks in one process and real
worker processes (``tests/workers/registry_user.py``) registering at the same time.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _servers import ServerProcess, command_count
from _workers import Spawn
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from aiolocks import RedisRegistry, RegistryStatistics, ServerUnavailable
from aiolocks._engine._context import context_for
from aiolocks.registry import MAX_NAME_BYTES, Coalescer

WORKER = Path(__file__).resolve().parent / "workers" / "registry_user.py"


def _dead_client() -> redis.asyncio.Redis:
    """A client for a port nothing listens on: any Redis call would fail differently.
    It does not retry, so a call that does reach for Redis fails fast."""
    return redis.asyncio.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))


async def _maps(
    client: redis.asyncio.Redis, registry: str
) -> tuple[dict[bytes, int], dict[int, bytes], int]:
    """The forward map, the reverse map and the counter, straight from the server."""
    forward: dict[Any, Any] = await client.hgetall(f"aiolocks:registry:{{{registry}}}:ids")
    reverse: dict[Any, Any] = await client.hgetall(f"aiolocks:registry:{{{registry}}}:names")
    counter = await client.get(f"aiolocks:registry:{{{registry}}}:counter")
    return (
        {name: int(id) for name, id in forward.items()},
        {int(id): name for id, name in reverse.items()},
        int(counter or 0),
    )


def _assert_bijective(forward: dict[bytes, int], reverse: dict[int, bytes], counter: int) -> None:
    assert sorted(forward.values()) == list(range(1, counter + 1))
    assert reverse == {id: name for name, id in forward.items()}


# --- the contract, on every backend ---------------------------------------------------


async def test_same_name_same_id_and_ids_are_dense(any_r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(any_r, "users")
    assert await reg.count() == 0
    assert await reg.register("alice") == 1
    assert await reg.register("alice") == 1
    assert await reg.register_many(["bob", "carol"]) == [2, 3]
    assert await reg.register_many(["carol", "dave", "alice", "dave", "erin"]) == [3, 4, 1, 4, 5]
    assert await reg.register("erin") == 5
    assert await reg.count() == 5
    assert await reg.id_of("bob") == 2
    assert await reg.id_of("nobody") is None
    assert await reg.name_of(2) == "bob"
    assert await reg.name_of(6) is None
    assert await reg.ids_of(["erin", "zed", "alice"]) == [5, None, 1]
    assert await reg.names_of([5, 99, 1]) == ["erin", None, "alice"]
    assert await reg.register_many([]) == []
    assert await reg.ids_of([]) == [] and await reg.names_of([]) == []
    # Lookups register nothing.
    assert await reg.count() == 5
    _assert_bijective(*await _maps(any_r, "users"))


async def test_registries_and_prefixes_are_separate(any_r: redis.asyncio.Redis) -> None:
    users, teams = RedisRegistry(any_r, "users"), RedisRegistry(any_r, "teams")
    other = RedisRegistry(any_r, "users", prefix="elsewhere")
    assert await users.register_many(["a", "b"]) == [1, 2]
    assert await teams.register_many(["b", "a"]) == [1, 2]
    assert await other.register("b") == 1
    assert await users.id_of("b") == 2


async def test_iteration_walks_every_pair_in_id_order(any_r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(any_r, "users")
    assert [pair async for pair in reg] == []
    names = [f"n{i}" for i in range(10)]
    await reg.register_many(names)
    expected = [(name, id) for id, name in enumerate(names, start=1)]
    assert [pair async for pair in reg] == expected
    for batch in (1, 3, 10, 11):
        assert [pair async for pair in reg.items(batch=batch)] == expected
    # Names registered while iterating are seen, exactly once.
    seen = []
    async for name, id in reg.items(batch=4):
        seen.append((name, id))
        if id == 4:
            await reg.register_many(["late-1", "late-2", "n0"])
    assert seen == [*expected, ("late-1", 11), ("late-2", 12)]


async def test_iteration_costs_one_round_trip_per_batch(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "users")
    await reg.register_many([f"n{i}" for i in range(2500)])
    before = await command_count(r, ["hmget"])
    assert len([pair async for pair in reg.items(batch=1000)]) == 2500
    assert await command_count(r, ["hmget"]) - before == 3


async def test_names_round_trip(any_r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(any_r, "names")
    longest = "é" * (MAX_NAME_BYTES // 2)  # 2 bytes each in UTF-8: exactly the limit
    names: list[str | bytes] = ["Zoë 🦊 日本", "x", b"raw\x00bytes", longest, b"\xff\xfe"]
    ids = await reg.register_many(names)
    assert ids == [1, 2, 3, 4, 5]
    assert await reg.name_of(1) == "Zoë 🦊 日本"
    assert await reg.name_of(2) == "x"
    assert await reg.name_bytes_of(3) == b"raw\x00bytes"
    assert await reg.name_of(4) == longest
    # Bytes that are not UTF-8 come back as surrogate escapes, which register as the
    # same bytes again.
    assert await reg.name_bytes_of(5) == b"\xff\xfe"
    undecodable = await reg.name_of(5)
    assert undecodable == "\udcff\udcfe"
    assert await reg.register(undecodable) == 5
    # A str and its UTF-8 bytes are one name.
    assert await reg.register("Zoë 🦊 日本".encode()) == 1
    assert await reg.id_of(b"x") == 2
    assert [name async for name, _ in reg] == [
        "Zoë 🦊 日本",
        "x",
        "raw\x00bytes",
        longest,
        "\udcff\udcfe",
    ]


async def test_a_smaller_max_name_bytes_is_enforced(any_r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(any_r, "short", max_name_bytes=4)
    assert await reg.register("abcd") == 1
    with pytest.raises(ValueError, match="5 bytes long, more than max_name_bytes=4"):
        await reg.register("abcde")
    with pytest.raises(ValueError, match="max_name_bytes=4"):
        await reg.register("ééé")  # 3 characters, 6 bytes


async def test_works_with_a_decoding_client(server: ServerProcess) -> None:
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        await client.flushall()
        reg = RedisRegistry(client, "users")
        assert await reg.register_many(["alice", b"\xff"]) == [1, 2]
        assert await reg.name_bytes_of(2) == b"\xff"
        assert await reg.name_of(1) == "alice"
        assert [pair async for pair in reg] == [("alice", 1), ("\udcff", 2)]
    finally:
        await client.aclose()


async def test_every_key_shares_one_cluster_slot(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "users:eu")
    await reg.register_many(["a", "b"])
    keys = [key async for key in r.scan_iter(match="aiolocks:*")]
    assert len(keys) == 3
    assert {key_slot(key) for key in keys} == {key_slot(b"users:eu")}


# --- bad input: rejected before any Redis call ------------------------------------------

BAD_NAMES: list[tuple[Any, type[Exception], str]] = [
    ("", ValueError, "must not be empty"),
    (b"", ValueError, "must not be empty"),
    ("x" * (MAX_NAME_BYTES + 1), ValueError, f"more than max_name_bytes={MAX_NAME_BYTES}"),
    ("é" * (MAX_NAME_BYTES // 2) + "x", ValueError, "more than max_name_bytes"),
    ("\ud800", ValueError, "cannot be encoded as UTF-8"),
    (None, TypeError, "str or bytes, not NoneType"),
    (42, TypeError, "str or bytes, not int"),
    (bytearray(b"x"), TypeError, "str or bytes, not bytearray"),
]


@pytest.mark.parametrize(("name", "error", "message"), BAD_NAMES)
async def test_bad_names_are_refused_before_any_call(
    name: Any, error: type[Exception], message: str
) -> None:
    reg = RedisRegistry(_dead_client(), "users")
    for call in (reg.register, reg.id_of):
        with pytest.raises(error, match=message) as info:
            await call(name)
        assert "'users'" in str(info.value)
    # One bad name anywhere in a batch refuses the whole batch, naming its position.
    for batch_call in (reg.register_many, reg.ids_of):
        with pytest.raises(error, match=r"names\[1\]"):
            await batch_call(["fine", name])


@pytest.mark.parametrize(
    ("call", "arg", "error", "message"),
    [
        ("name_of", 0, ValueError, "ids start at 1"),
        ("name_of", -3, ValueError, "ids start at 1"),
        ("name_of", True, TypeError, "must be an int, not bool"),
        ("name_of", "1", TypeError, "must be an int, not str"),
        ("name_bytes_of", 1.0, TypeError, "must be an int, not float"),
        ("names_of", [1, 0], ValueError, "ids start at 1"),
        ("names_of", "12", TypeError, "iterable"),
        ("register_many", "alice", TypeError, "iterable"),
        ("register_many", b"alice", TypeError, "iterable"),
        ("ids_of", 7, TypeError, "iterable"),
    ],
)
async def test_bad_ids_and_batches_are_refused_before_any_call(
    call: str, arg: Any, error: type[Exception], message: str
) -> None:
    reg = RedisRegistry(_dead_client(), "users")
    with pytest.raises(error, match=message):
        await getattr(reg, call)(arg)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": ""}, ValueError),
        ({"name": "a{b}"}, ValueError),
        ({"name": 3}, TypeError),
        ({"prefix": ""}, ValueError),
        ({"max_name_bytes": 0}, ValueError),
        ({"max_name_bytes": True}, TypeError),
        ({"max_name_bytes": 10.0}, TypeError),
    ],
)
def test_bad_construction(kwargs: dict[str, Any], error: type[Exception]) -> None:
    args: dict[str, Any] = {"name": "users", **kwargs}
    with pytest.raises(error):
        RedisRegistry(_dead_client(), **args)


def test_a_sync_client_is_refused() -> None:
    with pytest.raises(TypeError, match=r"redis\.asyncio"):
        RedisRegistry(redis.Redis(host="127.0.0.1", port=1), "users")  # type: ignore[arg-type]


async def test_iteration_batch_is_validated() -> None:
    reg = RedisRegistry(_dead_client(), "users")
    with pytest.raises(ValueError, match="batch"):
        await reg.items(batch=0).__anext__()
    with pytest.raises(TypeError, match="batch must be an int, not str"):
        await reg.items(batch="10").__anext__()  # type: ignore[arg-type]


async def test_an_unreachable_server_fails_every_coalesced_caller() -> None:
    reg = RedisRegistry(_dead_client(), "users")
    results = await asyncio.gather(
        *(reg.register(f"n{i}") for i in range(5)), reg.register("n0"), return_exceptions=True
    )
    assert all(isinstance(result, ServerUnavailable) for result in results), results
    assert all(
        result.name == "users" for result in results if isinstance(result, ServerUnavailable)
    )


async def test_a_cancelled_coalescer_cancels_its_batch_in_flight_and_the_keys_left() -> None:
    # The runner cancelled (its loop or client going away) while a batch is sent and more
    # keys wait: every caller's future is cancelled, none is left pending for ever.
    sent = asyncio.Event()

    async def flush(keys: list[str]) -> list[int]:
        sent.set()
        await asyncio.Event().wait()
        raise AssertionError("never answered")

    coalescer: Coalescer[str, int] = Coalescer(flush, max_batch=2)
    callers = [asyncio.ensure_future(coalescer.submit(f"n{i}")) for i in range(5)]
    await asyncio.wait_for(sent.wait(), 5)
    assert coalescer._runner is not None
    coalescer._runner.cancel()
    results = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 5)
    assert all(isinstance(result, asyncio.CancelledError) for result in results), results
    assert coalescer._runner is None and not coalescer._pending


async def test_a_wrong_key_type_is_reported_and_changes_nothing(r: redis.asyncio.Redis) -> None:
    await r.set("aiolocks:registry:{users}:ids", "not a hash")
    reg = RedisRegistry(r, "users")
    with pytest.raises(ServerUnavailable, match="WRONGTYPE"):
        await reg.register("alice")
    assert sorted(await r.keys("*")) == [b"aiolocks:registry:{users}:ids"]
    assert await r.get("aiolocks:registry:{users}:ids") == b"not a hash"


# --- concurrency in one process ---------------------------------------------------------


async def test_concurrent_registrations_of_one_name_are_coalesced(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "users")
    context = context_for(r)
    before = context.commands_sent
    ids = await asyncio.gather(*(reg.register("user-0000") for _ in range(10_000)))
    assert set(ids) == {1}
    # Without coalescing this would be 10,000 script calls (and "Too many connections").
    assert context.commands_sent - before <= 5
    assert await _maps(r, "users") == ({b"user-0000": 1}, {1: b"user-0000"}, 1)


@pytest.mark.slow
async def test_concurrent_distinct_names_get_dense_ids(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "users")
    # Two instances for one registry on one client share their batches too.
    twin = RedisRegistry(r, "users")
    names = [f"user-{i:05d}" for i in range(10_000)]
    order = random.Random(7).sample(range(len(names)), len(names))
    context = context_for(r)
    before = context.commands_sent
    ids = await asyncio.gather(*((reg if i % 2 else twin).register(names[i]) for i in order))
    assert sorted(ids) == list(range(1, 10_001))
    got = dict(zip((names[i] for i in order), ids, strict=True))
    assert await reg.ids_of(names) == [got[name] for name in names]
    # At most 1,000 names per script call: at least 10 calls, far fewer than 10,000.
    assert 10 <= context.commands_sent - before <= 100
    _assert_bijective(*await _maps(r, "users"))


async def test_a_cancelled_caller_does_not_disturb_the_others(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "users")
    first = asyncio.create_task(reg.register("alice"))
    second = asyncio.create_task(reg.register("alice"))
    third = asyncio.create_task(reg.register("bob"))
    await asyncio.sleep(0)  # all three have joined the batch
    first.cancel()
    assert await second == 1 and await third == 2
    with pytest.raises(asyncio.CancelledError):
        await first
    # The batch had already left: "alice" is registered anyway (register is idempotent).
    assert await reg.id_of("alice") == 1


@pytest.mark.slow
async def test_register_many_is_one_round_trip(r: redis.asyncio.Redis) -> None:
    reg = RedisRegistry(r, "big")
    names = [f"name-{i:06d}" for i in range(100_000)]
    context = context_for(r)
    before_sent, before_server = context.commands_sent, await command_count(r, ["evalsha", "eval"])
    ids = await reg.register_many(names)
    assert context.commands_sent - before_sent == 1
    assert await command_count(r, ["evalsha", "eval"]) - before_server == 1
    assert ids == list(range(1, 100_001))
    # Again, half known, half new, with duplicates inside the batch: still one call.
    again = names[50_000:] + [f"new-{i:06d}" for i in range(50_000)] + names[:10]
    before_sent = context.commands_sent
    ids = await reg.register_many(again)
    assert context.commands_sent - before_sent == 1
    assert ids == [*range(50_001, 100_001), *range(100_001, 150_001), *range(1, 11)]
    assert await reg.count() == 150_000
    _assert_bijective(*await _maps(r, "big"))


# --- concurrency across processes -------------------------------------------------------


async def _run_workers(spawn: Spawn, url: str, registry: str, mode: str, count: int) -> list[int]:
    workers = [await spawn(WORKER, url, registry, w, 4, mode, count, 30) for w in range(4)]
    done = [await worker.expect("done", timeout=60) for worker in workers]
    for worker in workers:
        assert await worker.finish() == 0, worker.stderr
    return [int(fields[2]) for fields in done]


@pytest.mark.slow
async def test_one_name_from_four_processes_gets_one_id(
    r: redis.asyncio.Redis, url: str, spawn: Spawn
) -> None:
    calls = await _run_workers(spawn, url, "same", "same", 2_500)
    for worker in range(4):
        seen = await r.lrange(f"test:{{same}}:seen:{worker}", 0, -1)
        assert len(seen) == 2_500 and set(seen) == {b"1"}
    assert await RedisRegistry(r, "same").count() == 1
    assert await _maps(r, "same") == ({b"user-0000": 1}, {1: b"user-0000"}, 1)
    assert all(sent <= 10 for sent in calls), calls


@pytest.mark.slow
async def test_distinct_names_from_four_processes_get_ids_1_to_n(
    r: redis.asyncio.Redis, url: str, spawn: Spawn
) -> None:
    # Every process registers all 10,000 names, each in its own order, at the same time.
    await _run_workers(spawn, url, "all", "all", 10_000)
    forward, reverse, counter = await _maps(r, "all")
    assert counter == 10_000
    _assert_bijective(forward, reverse, counter)
    expected = [str(forward[f"user-{i:05d}".encode()]).encode() for i in range(10_000)]
    for worker in range(4):
        assert await r.lrange(f"test:{{all}}:seen:{worker}", 0, -1) == expected


async def test_statistics_count_requests_and_waiting_calls(fake_r: redis.asyncio.Redis) -> None:
    registry = RedisRegistry(fake_r, "stats")
    assert registry.statistics() == RegistryStatistics(name="stats", requested=0, waiting=0)
    calls = [asyncio.create_task(registry.register(f"n{i % 4}")) for i in range(10)]
    await asyncio.sleep(0)  # each call has run up to its wait for the batch's reply
    assert registry.statistics().waiting == 10
    assert sorted(set(await asyncio.gather(*calls))) == [1, 2, 3, 4]
    assert await registry.register_many(["a", "b", "a"]) == [5, 6, 5]
    assert registry.statistics() == RegistryStatistics(name="stats", requested=13, waiting=0)
