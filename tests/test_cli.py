"""The `aiolocks` command line, run in-process (`main(argv)` in a thread, with its own event
loop) and as the installed script, against the suite's real servers."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import shlex
import signal
import socket
import sys
import sysconfig
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _cli import cli
from _probes import QueueProbe
from _servers import ServerProcess
from _web import ONE_SERVER
from conftest import VARIANTS, Tasks

from aiolocks import LockLost, RedisMutex, RedisReadWriteLock, RedisRegistry, RedisSemaphore

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "cli.md"
PLAIN = [variant for variant in VARIANTS if variant.endswith("-plain")]  # no keyspace events


@pytest.fixture
async def client_for(url: str, r: redis.asyncio.Redis) -> AsyncIterator[Callable[[], Any]]:
    """Makes more clients on the (flushed) server: each its own engine context and tag."""
    made: list[redis.asyncio.Redis] = []

    def make() -> redis.asyncio.Redis:
        made.append(redis.asyncio.Redis.from_url(url))
        return made[-1]

    try:
        yield make
    finally:
        for client in made:
            await client.aclose()


# -- inspect -------------------------------------------------------------------------------


@ONE_SERVER
async def test_inspect_a_held_mutex_with_its_queue_in_order(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    holder = RedisMutex(r, "orders:42", ttl=30, local_handoff=0)  # its fence: the stored one
    assert await holder.acquire()
    other = client_for()
    probe = QueueProbe(other)
    waiters = RedisMutex(other, "orders:42", ttl=20, local_handoff=0)  # both queued in Redis
    for _ in range(2):
        await tasks.queued(probe, waiters.acquire())

    ran = await cli("inspect", "orders:42", "--url", url, "--json")
    assert ran.code == 0, ran.err
    view = ran.json()
    info = await holder.inspect()
    assert (view["kind"], view["name"], view["state"]) == ("mutex", "orders:42", "held")
    assert view["summary"] == {
        "owner": info.owner,
        "lease_remaining_ms": view["summary"]["lease_remaining_ms"],
        "queue_length": 2,
        "fence": holder.fencing_token,
    }
    [owner] = view["holders"]
    assert owner["token"] == info.owner and owner["fence"] == holder.fencing_token
    assert 0 < owner["lease_remaining_ms"] <= 30_000
    assert [waiter["token"] for waiter in view["queue"]] == probe.queued
    for position, waiter in enumerate(view["queue"], 1):
        assert waiter["position"] == position and waiter["live"] is True
        assert waiter["ttl_ms"] == 20_000 and waiter["side"] == "x"
        assert 0 <= waiter["heartbeat_age_ms"] <= 20_000
        assert waiter["heartbeat_age_ms"] + waiter["expires_in_ms"] == 20_000
    assert len({waiter["client_tag"] for waiter in view["queue"]}) == 1  # one client

    table = await cli("inspect", "orders:42", "--url", url)
    assert table.code == 0, table.err
    assert "state  held" in table.out and "queue  2 waiting" in table.out
    assert info.owner is not None and info.owner[:16] in table.out
    assert all(token[:16] in table.out for token in probe.queued)
    await holder.release()


@ONE_SERVER
async def test_inspect_a_semaphore_and_a_rwlock(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    other = client_for()
    probe = QueueProbe(other)
    permits = [RedisSemaphore(client_for(), "gpu", limit=2) for _ in range(2)]
    for permit in permits:
        assert await permit.acquire()
    await tasks.queued(probe, RedisSemaphore(other, "gpu", limit=2).acquire())
    catalog = RedisReadWriteLock(r, "catalog")
    readers = [RedisReadWriteLock(client_for(), "catalog").read() for _ in range(2)]
    for reader in readers:
        assert await reader.acquire()
    await tasks.queued(probe, RedisReadWriteLock(other, "catalog").write().acquire())

    gpu = (await cli("inspect", "gpu", "--url", url, "--json")).json()
    assert gpu["kind"] == "semaphore" and gpu["state"] == "2/2 held"
    fences = [permit.fencing_token for permit in permits]
    assert gpu["summary"] == {"limit": 2, "holders": 2, "queue_length": 1, "fence": fences[1]}
    assert sorted(holder["fence"] for holder in gpu["holders"]) == fences
    assert [waiter["token"] for waiter in gpu["queue"]] == probe.queued[:1]

    rw = (await cli("inspect", "catalog", "--url", url, "--json")).json()
    assert rw["kind"] == "rwlock" and rw["state"] == "read-held x2"
    assert [holder["side"] for holder in rw["holders"]] == ["r", "r"]
    assert [(w["token"], w["side"]) for w in rw["queue"]] == [(probe.queued[1], "w")]
    assert (await catalog.inspect()).readers == 2

    table = await cli("inspect", "catalog", "--url", url)
    assert table.code == 0 and "read-held x2" in table.out and "write" in table.out
    for lock in (*permits, *readers):
        await lock.release()


@ONE_SERVER
async def test_inspect_finds_the_kind_or_says_why_not(url: str, r: redis.asyncio.Redis) -> None:
    mutex = RedisMutex(r, "shared")
    assert await mutex.acquire()
    await mutex.release()  # a free mutex keeps its fence counter: it still exists
    await RedisRegistry(r, "shared").register("alice")

    both = await cli("inspect", "shared", "--url", url)
    assert both.code == 2 and "exists as mutex and registry" in both.err
    assert "--kind" in both.err

    chosen = await cli("inspect", "shared", "--kind", "mutex", "--url", url, "--json")
    assert chosen.code == 0 and chosen.json()["state"] == "free"
    registry = await cli("inspect", "shared", "--kind", "registry", "--url", url, "--json")
    assert registry.json()["summary"] == {"names": 1}

    missing = await cli("inspect", "nobody", "--url", url)
    assert missing.code == 1 and missing.out == ""
    assert "nothing named 'nobody' under prefix 'aiolocks'" in missing.err
    wrong_kind = await cli("inspect", "shared", "--kind", "semaphore", "--url", url)
    assert wrong_kind.code == 1 and "(it exists as mutex and registry)" in wrong_kind.err
    other_prefix = await cli("inspect", "shared", "--prefix", "elsewhere", "--url", url)
    assert other_prefix.code == 1 and "prefix 'elsewhere'" in other_prefix.err


# -- list ----------------------------------------------------------------------------------


@ONE_SERVER
async def test_list_scans_with_a_pattern_and_groups_keys(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    held = RedisMutex(r, "orders:1")
    assert await held.acquire()
    other = client_for()
    await tasks.queued(QueueProbe(other), RedisMutex(other, "orders:1").acquire())
    free = RedisMutex(r, "orders:2")
    assert await free.acquire()
    await free.release()
    api = RedisSemaphore(r, "paid-api", limit=3)
    assert await api.acquire()
    elsewhere = RedisMutex(r, "orders:3", prefix="other-app")
    assert await elsewhere.acquire()
    await r.set("aiolocks:not-a-lock", "x")  # under the prefix, but not a primitive's key

    orders = await cli("list", "orders:*", "--url", url, "--json", "--count", "2")
    assert orders.code == 0, orders.err
    assert [(row["kind"], row["name"], row["state"]) for row in orders.json()] == [
        ("mutex", "orders:1", "held"),
        ("mutex", "orders:2", "free"),
    ]
    assert orders.json()[0]["summary"]["queue_length"] == 1

    everything = (await cli("list", "--url", url, "--json")).json()
    assert [(row["kind"], row["name"]) for row in everything] == [
        ("mutex", "orders:1"),
        ("mutex", "orders:2"),
        ("semaphore", "paid-api"),
    ]
    assert everything[2]["state"] == "1/3 held"
    semaphores = (await cli("list", "--kind", "semaphore", "--url", url, "--json")).json()
    assert [row["name"] for row in semaphores] == ["paid-api"]
    prefixed = (await cli("list", "--prefix", "other-app", "--url", url, "--json")).json()
    assert [row["name"] for row in prefixed] == ["orders:3"]

    table = await cli("list", "orders:*", "--url", url)
    assert table.code == 0
    assert "orders:1" in table.out and "orders:2" in table.out and "paid-api" not in table.out
    assert "2 found (SCAN MATCH aiolocks:*:{orders:*}:*)" in table.out
    for lock in (held, api, elsewhere):
        await lock.release()


@ONE_SERVER
async def test_tables_piped_out_are_plain_lines(url: str, r: redis.asyncio.Redis) -> None:
    """`aiolocks list | grep ...`: no line padded with trailing spaces, no colour codes, and
    the footer on one line however long the pattern (a table caption wrapped at the table's
    width); `inspect` the same."""
    prefix = "an-application-with-a-rather-long-prefix-name"
    held = RedisMutex(r, "orders:1", prefix=prefix)
    assert await held.acquire()
    listed = await cli("list", "--url", url, "--prefix", prefix)
    inspected = await cli("inspect", "orders:1", "--url", url, "--prefix", prefix)
    await held.release()
    for ran in (listed, inspected):
        assert ran.code == 0, ran.err
        lines = ran.out.splitlines()
        assert lines and all(line == line.rstrip() for line in lines), ran.out
        assert "\x1b" not in ran.out
    assert listed.out.splitlines()[-1] == f"1 found (SCAN MATCH {prefix}:*:{{*}}:*)"
    assert any(line.startswith("mutex  'orders:1' (prefix") for line in inspected.out.splitlines())


# -- release -------------------------------------------------------------------------------


@pytest.mark.parametrize("server", PLAIN, indirect=True)
async def test_release_force_hands_the_mutex_to_a_waiter_of_another_client(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    # Without keyspace events and with a 30 s lease, only the grant message can wake it.
    holder = RedisMutex(r, "stuck", ttl=30, local_handoff=0)  # its fence is the stored one
    assert await holder.acquire()
    owner, first = (await holder.inspect()).owner, holder.fencing_token
    other = client_for()
    waiter = RedisMutex(other, "stuck", ttl=30, local_handoff=0)
    probe = QueueProbe(other)

    async def wait_and_hold() -> int | None:
        assert await waiter.acquire()
        return waiter.fencing_token

    waiting = await tasks.queued(probe, wait_and_hold())
    ran = await cli("release", "stuck", "--force", "--yes", "--url", url)
    assert ran.code == 0, ran.err
    assert f"released mutex 'stuck' held by {owner} (fence {first})" in ran.out
    handed = (await holder.inspect()).fence
    assert first is not None and handed > first
    assert f"handed to {probe.queued[0]} (fence {handed})" in ran.out
    assert await asyncio.wait_for(waiting, 10) == handed
    with pytest.raises(LockLost):
        await holder.release()  # the old holder learns it
    assert (await waiter.inspect()).owner == probe.queued[0]


@ONE_SERVER
async def test_release_force_one_semaphore_holder_by_token(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    victim = RedisSemaphore(r, "slots", limit=2, ttl=1.5)  # renewed every 0.5 s
    keeper = RedisSemaphore(client_for(), "slots", limit=2)
    assert await victim.acquire() and await keeper.acquire()
    lost = victim.lost
    view = (await cli("inspect", "slots", "--url", url, "--json")).json()
    victim_fence = victim.fencing_token
    victim_token = next(h["token"] for h in view["holders"] if h["fence"] == victim_fence)
    other = client_for()
    waiting = await tasks.queued(
        QueueProbe(other), RedisSemaphore(other, "slots", limit=2).acquire()
    )

    unknown = await cli("release", "slots", "--force", "--yes", "--token", "zz", "--url", url)
    assert unknown.code == 1 and "no holder of semaphore 'slots'" in unknown.err
    ran = await cli(
        "release", "slots", "--force", "--yes", "--token", victim_token[:8], "--url", url
    )
    assert ran.code == 0, ran.err
    assert f"released semaphore 'slots' holder {victim_token} (fence {victim_fence})" in ran.out
    assert await asyncio.wait_for(waiting, 10) is True
    await asyncio.wait_for(lost.wait(), 10)  # its next renewal found the permit gone
    assert (await keeper.inspect()).holders == 2  # the keeper's and the waiter's
    await keeper.release()


@ONE_SERVER
async def test_release_asks_first_and_refuses_without_a_terminal(
    url: str, r: redis.asyncio.Redis
) -> None:
    readers = [RedisReadWriteLock(r, "catalog").read() for _ in range(2)]
    for reader in readers:
        assert await reader.acquire()

    declined = await cli("release", "catalog", "--force", "--url", url, answer="n\n")
    assert declined.code == 1 and "nothing released: not confirmed" in declined.err
    assert "Release all 2 holders of rwlock 'catalog'" in declined.err  # the question
    piped = await cli("release", "catalog", "--force", "--url", url, stdin="y\n")
    assert piped.code == 1 and "stdin is not a terminal" in piped.err and "--yes" in piped.err
    unforced = await cli("release", "catalog", "--yes", "--url", url)
    assert unforced.code == 2 and "--force" in unforced.err
    assert (await RedisReadWriteLock(r, "catalog").inspect()).readers == 2  # untouched

    confirmed = await cli("release", "catalog", "--force", "--url", url, answer="y\n")
    assert confirmed.code == 0, confirmed.err
    assert confirmed.out.count("released rwlock 'catalog' reader") == 2
    assert (await RedisReadWriteLock(r, "catalog").inspect()).readers == 0
    again = await cli("release", "catalog", "--force", "--yes", "--url", url)
    assert again.code == 1 and "rwlock 'catalog' is not held" in again.err
    for reader in readers:
        with pytest.raises(LockLost):
            await reader.release()


# -- errors and options --------------------------------------------------------------------


async def test_a_least_privilege_user_with_the_documented_additions(
    server_factory: Callable[..., ServerProcess],
) -> None:
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"<!-- acl -->\s*```text\n(.+?)\n```", readme, re.S)
    extra = re.search(r"least-privilege user in the README:\n`([^`]+)`", DOCS.read_text())
    assert line is not None and extra is not None
    server = server_factory()
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        for name, additions in (("cli", extra[1]), ("plain", "")):
            command = line[1].replace("aiolocks on", f"{name} on") + " " + additions
            await admin.execute_command(*command.split())  # type: ignore[no-untyped-call]
        holder = RedisMutex(admin, "orders:42")
        assert await holder.acquire()
        cli_url = f"redis://cli:CHANGE-ME@127.0.0.1:{server.port}"
        listed = await cli("list", "--url", cli_url, "--json")
        assert [row["state"] for row in listed.json()] == ["held"], listed.err
        assert (await cli("inspect", "orders:42", "--url", cli_url)).code == 0
        released = await cli("release", "orders:42", "--force", "--yes", "--url", cli_url)
        assert released.code == 0, released.err
        denied = await cli("list", "--url", f"redis://plain:CHANGE-ME@127.0.0.1:{server.port}")
        assert denied.code == 1 and "refused: User plain has no permissions" in denied.err
        with pytest.raises(LockLost):
            await holder.release()
    finally:
        await admin.aclose()


async def test_an_unreachable_server_is_one_line_and_exit_3() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ran = await cli("list", "--url", f"redis://user:secret@127.0.0.1:{port}")
    assert ran.code == 3 and ran.out == ""
    shown = f"redis://user:***@127.0.0.1:{port}"  # the password is not printed
    assert ran.err == f"aiolocks: cannot reach {shown}: Connection refused\n"

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        ran = await cli(
            "inspect", "x", "--url", f"redis://127.0.0.1:{port}", "--connect-timeout", "0.2"
        )
    assert ran.code == 3 and "no answer within 0.2 s" in ran.err
    assert "Traceback" not in ran.err


async def test_bad_arguments_are_usage_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["inspect", "a{b}"], "must not contain '{' or '}'"),
        (["inspect", "x", "--kind", "queue"], "invalid choice: 'queue'"),
        (["list", "--count", "0"], "must be at least 1"),
        (["list", "--connect-timeout", "-1"], "must be a number of seconds > 0"),
        (["list", "--prefix", ""], "prefix must not be empty"),
        (["list", "--url", "http://localhost"], "invalid --url http://localhost"),
    ]
    for argv, message in cases:
        ran = await cli(*argv)
        assert (ran.code, ran.out) == (2, ""), (argv, ran)
        assert message in ran.err, (argv, ran.err)
    assert (await cli("--help")).code == 0
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")  # the default when --url is absent
    ran = await cli("list")
    assert ran.code == 3 and "redis://127.0.0.1:1" in ran.err


@ONE_SERVER
async def test_tables_need_rich_and_json_does_not(
    url: str, r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # as if not installed
    ran = await cli("list", "--url", url)
    assert ran.code == 1
    assert ran.err == "aiolocks: a table needs rich: pip install 'aiolocks[cli]'\n"
    assert (await cli("list", "--url", url, "--json")).json() == []


# -- demo, the installed script -----------------------------------------------------


@ONE_SERVER
async def test_demo_runs_workers_under_the_lock(url: str, r: redis.asyncio.Redis) -> None:
    ran = await cli(
        "demo", "--url", url, "--workers", "2", "--iterations", "3", "--hold", "0.01",
        "--no-show-race",
    )  # fmt: skip
    assert ran.code == 0, ran.out + ran.err
    assert "counter     6 of 6: EXACT" in ran.out
    assert re.search(r"fences      \d{16} \.\. \d{16} over 6 acquisitions, all distinct", ran.out)
    assert len(re.findall(r"^worker [01]  acquired  fence \d{16}  counter", ran.out, re.M)) == 6
    assert await r.dbsize() == 0  # its keys are gone


def _installed_script() -> list[str]:
    """The `aiolocks` console script the install made, or (where the install predates the
    CLI) the wrapper an installer writes for the entry point pyproject.toml declares."""
    declared = 'aiolocks = "aiolocks.cli:main"'
    assert declared in (ROOT / "pyproject.toml").read_text()
    script = Path(sysconfig.get_path("scripts")) / "aiolocks"
    if script.is_file() and "aiolocks.cli" in script.read_text(errors="replace"):
        return [str(script)]
    wrapper = "import sys; from aiolocks.cli import main; sys.exit(main())"
    return [sys.executable, "-c", wrapper]


@ONE_SERVER
@pytest.mark.slow
async def test_the_installed_script_releases_on_a_real_terminal(
    url: str, r: redis.asyncio.Redis, client_for: Callable[[], Any], tasks: Tasks
) -> None:
    holder = RedisMutex(r, "batch", ttl=30)
    assert await holder.acquire()
    owner = (await holder.inspect()).owner
    other = client_for()
    probe = QueueProbe(other)
    waiting = await tasks.queued(probe, RedisMutex(other, "batch").acquire())
    env = {**os.environ, "REDIS_URL": url}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    listed = await asyncio.create_subprocess_exec(
        *_installed_script(), "list", "--json", env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(listed.communicate(), 30)
    assert listed.returncode == 0
    assert [row["name"] for row in json.loads(out)] == ["batch"]

    keyboard, terminal = pty.openpty()  # the script's stdin is a real terminal
    try:
        proc = await asyncio.create_subprocess_exec(
            *_installed_script(), "release", "batch", "--force",
            env=env, stdin=terminal, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        os.write(keyboard, b"y\n")  # typed ahead; read once it has asked
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        os.close(keyboard)
        os.close(terminal)
    assert proc.returncode == 0, err
    assert f"Release mutex 'batch' held by {owner}? [y/N]" in err.decode()
    assert f"handed to {probe.queued[0]}" in out.decode()
    assert await asyncio.wait_for(waiting, 10) is True  # woken across processes
    with pytest.raises(LockLost):
        await holder.release()


# -- python -m aiolocks, a closed pipe, the demo's printed command ---------------------------


def _child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


async def _exec(*argv: str, env: dict[str, str], stdout: Any) -> tuple[int, bytes]:
    """Run argv with `stdout` as given; return its exit status and what it wrote to stderr."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, err


async def test_python_m_aiolocks_is_the_aiolocks_command() -> None:
    env = _child_env()
    module = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolocks", "--help", env=env, stdout=asyncio.subprocess.PIPE
    )
    script = await asyncio.create_subprocess_exec(
        *_installed_script(), "--help", env=env, stdout=asyncio.subprocess.PIPE
    )
    (by_module, _), (by_script, _) = await asyncio.wait_for(
        asyncio.gather(module.communicate(), script.communicate()), 30
    )
    assert module.returncode == script.returncode == 0
    assert by_module.startswith(b"usage: aiolocks ") and by_module == by_script


@ONE_SERVER
@pytest.mark.slow
async def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(
    url: str, r: redis.asyncio.Redis
) -> None:
    mutexes = [RedisMutex(r, f"job:{i}", ttl=30) for i in range(200)]
    for mutex in mutexes:
        assert await mutex.acquire()
    env = _child_env(REDIS_URL=url)
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -1` that has already gone: every write finds no reader
    try:
        code, err = await _exec(
            sys.executable, "-m", "aiolocks", "list", "--json", env=env, stdout=write_end
        )
    finally:
        os.close(write_end)
    assert (code, err) == (141, b"")  # no traceback, the status a SIGPIPE'd command has
    # Wired as before when someone reads: every lock listed.
    code, err = await _exec(
        sys.executable, "-m", "aiolocks", "list", "--json", env=env, stdout=asyncio.subprocess.PIPE
    )
    assert code == 0, err
    for mutex in mutexes:
        await mutex.release()


@pytest.mark.slow
async def test_the_demo_prints_an_inspect_command_that_works_as_printed() -> None:
    env = _child_env()
    env.pop("REDIS_URL", None)  # the demo's own embedded server
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolocks", "demo", "--workers", "2", "--iterations", "40",
        "--hold", "0.02", "--no-show-race",
        env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert demo.stdout is not None
    try:
        printed = ""
        while "from another terminal:" not in printed:
            line = await asyncio.wait_for(demo.stdout.readline(), 60)
            assert line, "the demo ended without printing the command"
            printed = line.decode()
        argv = shlex.split(printed.split("from another terminal:", 1)[1].strip().rstrip(")"))
        assert argv[:2] == ["aiolocks", "inspect"] and "--url" in argv
        url, prefix = argv[argv.index("--url") + 1], argv[argv.index("--prefix") + 1]
        # Wait (on the embedded server's keyspace events) until the workers use the lock,
        # then freeze the demo: its server and keys stay (the workers may finish meanwhile).
        async with redis.asyncio.Redis.from_url(url) as watcher, watcher.pubsub() as events:
            await events.psubscribe(f"__keyspace@0__:{prefix}:*")
            message: dict[str, Any] | None = None
            while message is None or message["type"] != "pmessage":  # psubscribe's reply first
                message = await asyncio.wait_for(events.get_message(timeout=None), 60)
        demo.send_signal(signal.SIGSTOP)
        try:
            ran = await cli(*argv[1:], "--json")
        finally:
            demo.send_signal(signal.SIGCONT)
        assert ran.code == 0, ran.err
        assert ran.json()["name"] == "counter"
        await asyncio.wait_for(demo.wait(), 60)
        assert demo.returncode == 0
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
