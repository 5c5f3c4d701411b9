"""The client-configuration matrix (issue 34): every configuration teams give their clients,
crossed with the client releases of the compatibility matrix.

Configurations (tests/_client_configs_smoke.py): the defaults, decode_responses=True,
protocol=3, a unix socket, a BlockingConnectionPool of 2, single_connection_client=True,
health_check_interval=1, socket_timeout=1, a Retry policy, max_connections of 1, 2 and 3,
client_name. In each, every primitive (mutex, semaphore, RW lock, election) waits and is
woken by message, sends no command while it waits (the server's INFO commandstats across a
window longer than the socket timeout and the health-check interval), times out on a name
first subscribed after that idle window, is cancelled while queued and loses a lease, and
the user's own commands on the same clients still run. Per release, also a program that
cancels a queued waiter and returns from `main` leaves no queue entry (auto-pipelining on
and off) and writes nothing on stderr.

One process per release runs its configurations side by side (one idle window for all of
them), against a server of its own (the command counts are the server's), all releases side
by side: the matrix costs about as long as one configuration on its slowest release
(valkey-py's, whose 5 s default socket_timeout makes its window longer): about 15 s. A
release is installed once into the compat cache, as tests/test_compat.py does.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from _servers import ServerKind, ServerProcess, binary_path
from test_compat import _pip_target

from aiolocks import RedisMutex, ServerUnavailable
from aiolocks._base import _adapter
from aiolocks._base._errors import map_redis_errors
from aiolocks._engine._context import context_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "tests" / "_client_configs_smoke.py"
RUN_TIMEOUT = 420.0

# Each release: (the client library, the redis-py release to import instead of the
# installed one; None: the installed one).
RELEASES: dict[str, tuple[str, str | None]] = {
    "redis-py-5.0": ("redis", "redis==5.0.8"),
    "redis-py-6.x": ("redis", "redis==6.4.0"),
    "redis-py-7.x": ("redis", "redis==7.4.1"),
    "redis-py-8.x": ("redis", "redis==8.1.0"),
    "valkey-py": ("valkey", None),
}
CONFIGURATIONS = [
    "default",
    "decode_responses",
    "protocol=3",
    "unix socket",
    "BlockingConnectionPool(2)",
    "single_connection_client",
    "health_check_interval=1",
    "socket_timeout=1",
    "Retry",
    "max_connections=1",
    "max_connections=2",
    "max_connections=3",
    "client_name",
]
EXITS = ["autopipe=1", "autopipe=0"]


@dataclass
class _Run:
    process: subprocess.Popen[str] | None = None
    skipped: str | None = None
    result: dict[str, Any] | None = None
    server: ServerProcess | None = None
    directory: str = ""
    started: float = field(default_factory=time.monotonic)


class Matrix:
    """Starts every release's process at once, on first use; each test reads its own."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] | None = None

    def _start(self) -> dict[str, _Run]:
        redis_binary = binary_path("redis")
        kind: ServerKind = "redis" if redis_binary else "valkey"
        binary = redis_binary or binary_path("valkey")
        assert binary is not None
        runs: dict[str, _Run] = {}
        for name, (library, pin) in RELEASES.items():
            path = [str(ROOT)]
            try:
                if pin is not None:
                    path.insert(0, str(_pip_target(pin)))
                if library == "valkey":
                    __import__("valkey")
            except (pytest.skip.Exception, ImportError) as exc:
                runs[name] = _Run(skipped=str(exc))
                continue
            directory = tempfile.mkdtemp(prefix="aiolocks-cfg-")
            unix = os.path.join(directory, "s.sock")
            # "Kl": list events only, for the smoke's queue barrier; to the engine keyspace
            # events are off (it needs generic and expired ones), as on a default server.
            server = ServerProcess(
                binary, kind=kind, notify=False,
                extra_args=["--notify-keyspace-events", "Kl", "--unixsocket", unix,
                            "--unixsocketperm", "700"],
            ).start()  # fmt: skip
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
            process = subprocess.Popen(
                [sys.executable, str(SMOKE), server.url, unix, "--client", library],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            runs[name] = _Run(process, server=server, directory=directory)
        return runs

    def result(self, name: str) -> dict[str, Any]:
        if self._runs is None:
            self._runs = self._start()
        run = self._runs[name]
        if run.skipped is not None:
            pytest.skip(run.skipped)
        if run.result is None:
            assert run.process is not None
            try:
                out, err = run.process.communicate(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                run.process.kill()
                out, err = run.process.communicate()
                pytest.fail(f"{name}: no result within {RUN_TIMEOUT:g} s\n{err[-3000:]}")
            assert run.process.returncode == 0, f"{name} failed:\n{err[-4000:]}"
            run.result = json.loads(out.strip().splitlines()[-1])
            run.result["seconds"] = round(time.monotonic() - run.started, 1)
            print(f"\n{name}: {run.result['client']}, {run.result['seconds']} s")
        return run.result

    def stop(self) -> None:
        for run in (self._runs or {}).values():
            if run.process is not None and run.process.poll() is None:
                run.process.kill()
                run.process.communicate()
            if run.server is not None:
                run.server.stop()
            if run.directory:
                shutil.rmtree(run.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def matrix() -> Iterator[Matrix]:
    runs = Matrix()
    try:
        yield runs
    finally:
        runs.stop()


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
@pytest.mark.parametrize("release", list(RELEASES))
def test_every_primitive_in_each_client_configuration(
    matrix: Matrix, release: str, configuration: str
) -> None:
    result = matrix.result(release)
    library, pin = RELEASES[release]
    if pin is not None:
        assert result["client"] == f"redis {pin.partition('==')[2]}"  # the pinned release
    else:
        assert result["client"].startswith(f"{library} ")
    cell = result["configs"][configuration]
    assert cell["ok"], f"{release} / {configuration}: {cell.get('error')}\n{cell.get('trace')}"
    # Waiting sends nothing: not a health check, not a re-check after a read timeout.
    assert cell["commands_while_waiting"] == 0, cell


@pytest.mark.parametrize("exit_", EXITS)
@pytest.mark.parametrize("release", list(RELEASES))
def test_a_clean_exit_right_after_a_cancellation_withdraws_the_waiter(
    matrix: Matrix, release: str, exit_: str
) -> None:
    cell = matrix.result(release)["exits"][exit_]
    assert cell["queue_left"] == 0, cell  # the cancelled waiter's entry withdrawn
    assert cell["ok"], cell  # exit status 0, nothing on stderr ("never awaited")


@pytest.mark.parametrize("release", list(RELEASES))
def test_waits_survive_pubsub_kills_with_a_socket_timeout(matrix: Matrix, release: str) -> None:
    """Issue 40: with `socket_timeout`, redis-py 5.0.8 and 7.4.1 wrote a subscription on a
    pub/sub connection its reader had just dropped (AttributeError 'writelines' out of
    acquire()), or re-connected it beside the reader (RuntimeError)."""
    cell = matrix.result(release)["kill_race"]
    assert cell["ok"], cell


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_client_dropped_without_aclose_is_collected(matrix: Matrix, release: str) -> None:
    """Issue 40: the engine's background tasks held its context and so the client: 10
    clients dropped kept 10-20 connections open until the loop ended."""
    cell = matrix.result(release)["dropped"]
    assert cell["ok"], cell


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_client_closed_under_a_holding_and_a_waiter_stays_closed(
    matrix: Matrix, release: str
) -> None:
    """Issue 40: `aclose()` while a task held a lock and another waited on it: the waiter
    timed out (8 s, not an error), the holding was never reported lost, and the engine
    opened 3 connections after the close (renewals, the wait) that stayed open."""
    cell = matrix.result(release)["closed"]
    assert cell["ok"], cell


async def test_closing_the_client_closes_the_engines_connections(url: str) -> None:
    """The engine's connections are its own (not the pool's), yet `client.aclose()` closes
    them too, as it did when they were the pool's: a program that makes a client per job
    leaves no connection open."""
    client = redis.asyncio.Redis.from_url(url, max_connections=1)
    try:
        holder = RedisMutex(client, "cfg:closed")
        await holder.acquire()
        waiter = asyncio.create_task(RedisMutex(client, "cfg:closed").acquire(timeout=10))
        await asyncio.sleep(0.3)  # queued and subscribed (the release wakes it either way)
        await holder.release()
        assert await waiter
        engine = context_for(client).engine
        assert _adapter.holds_connections(engine)  # the link and pub/sub, at least
        assert await client.get("cfg:user") is None  # the user's one connection is free
        await client.aclose()
        assert not _adapter.holds_connections(engine)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "error",
    [
        redis.exceptions.ConnectionError("Too many connections"),  # redis-py before 6.0
        redis.exceptions.MaxConnectionsError("Too many connections"),
        redis.exceptions.ConnectionError("No connection available."),  # a blocking pool's
    ],
)
def test_a_pool_that_ran_out_is_not_called_unreachable(error: Exception) -> None:
    with pytest.raises(ServerUnavailable) as raised, map_redis_errors("m"):
        raise error
    text = str(raised.value)
    assert "max_connections" in text and "unreachable" not in text, text
