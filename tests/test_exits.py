"""A program using aiolocks ends quietly, however it ends, and gives back what it held.

Each test runs a real program as a process (`workers/exit_service.py`, the examples, the
command line) under `workers/_exitwatch.py`, which reports on stderr any task still pending
or timer still armed when its event loop closes, and any TCP connection still open at exit.
The test stops it at a point the program signals (a line on stdout), then asserts that
stderr is empty and that the server holds nothing beyond what docs/shutdown.md says: after
an end through `asyncio.run()`, no holder and no waiter (only fence counters and limits,
which expire); after a SIGTERM nobody handled, holdings that end by their ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
from _servers import ServerProcess, free_port
from _web import ONE_SERVER
from _workers import Spawn, Worker
from conftest import ServerPool

from aiolocks import RedisElection, RedisMutex

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).resolve().parent / "workers"
WATCH = WORKERS / "_exitwatch.py"
SERVICE = WORKERS / "exit_service.py"
# Keys that may stay after every holder and waiter left: counters and a semaphore's limit,
# for the idle window past the last lease (ttl + IDLE_MS, see docs/architecture.md).
_COUNTERS = ("fence", "limit")
_IDLE_MS = 1000
_FENCE_KEEP_MS = 5000  # FENCE_KEEP_MS in _prelude.lua


async def _service(spawn: Spawn, url: str, prefix: str, ttl: float, how: str, *loop: str) -> Worker:
    worker = await spawn(WATCH, *loop, SERVICE, url, prefix, ttl, how)
    await worker.expect("ready")
    return worker


async def _keys(url: str, prefix: str) -> dict[str, int]:
    """Every key under `prefix`, with its PTTL (-1: none)."""
    async with redis.asyncio.Redis.from_url(url) as client:
        return {
            key.decode(): await client.pttl(key)
            async for key in client.scan_iter(match=f"{prefix}:*")
        }


@pytest.fixture(params=["valkey-notify", "redis-plain"])
def server_of(request: pytest.FixtureRequest, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(request.param)


@pytest.mark.parametrize(
    ("how", "stop", "status"),
    [
        ("return", None, 0),
        ("wait", signal.SIGINT, 130),
        ("wait-term", signal.SIGTERM, 143),
        ("wait-term-as-int", signal.SIGTERM, 130),
    ],
    ids=["return", "ctrl-c", "sigterm-handled", "sigterm-as-ctrl-c"],
)
async def test_a_service_ends_quietly_and_gives_back_what_it_held(
    spawn: Spawn, server_of: ServerProcess, how: str, stop: signal.Signals | None, status: int
) -> None:
    prefix = f"exit-{secrets.token_hex(4)}"
    worker = await _service(spawn, server_of.url, prefix, 30, how)
    if stop is not None:
        worker.proc.send_signal(stop)
    assert await worker.finish() == status, worker.stderr
    assert worker.stderr == ""
    left = await _keys(server_of.url, prefix)
    assert {key.rsplit(":", 1)[1] for key in left} <= set(_COUNTERS), left
    assert all(0 < pttl <= 30_000 + _IDLE_MS for pttl in left.values()), left


async def test_a_service_that_closes_its_client_first_leaves_its_holdings_to_their_ttl(
    spawn: Spawn, valkey_notify: ServerProcess
) -> None:
    """Issue 40: a client closed under holdings and a waiter stays closed. The holdings are
    reported lost (their `async with` bodies end with LockLost) and the wait ends with
    ClientClosed, at once; nothing is released on the closed client (the loop's end used to
    reconnect it to do so), so the leases end on the server by their ttl; nothing on stderr."""
    prefix = f"exit-{secrets.token_hex(4)}"
    worker = await _service(spawn, valkey_notify.url, prefix, 30, "close-return")
    assert await worker.expect("ended") == ["ended", "LockLost", "LockLost", "ClientClosed"]
    assert await worker.finish() == 0, worker.stderr
    assert worker.stderr == ""
    left = await _keys(valkey_notify.url, prefix)
    assert {"owner", "holders"} <= {key.rsplit(":", 1)[1] for key in left}, left
    assert all(0 < pttl <= 30_000 + _IDLE_MS for pttl in left.values()), left


@pytest.mark.parametrize("how", ["return", "wait"])
async def test_it_ends_quietly_on_uvloop_too(
    spawn: Spawn, valkey_notify: ServerProcess, how: str
) -> None:
    prefix = f"exit-{secrets.token_hex(4)}"
    worker = await _service(spawn, valkey_notify.url, prefix, 30, how, "--uvloop")
    if how == "wait":
        worker.proc.send_signal(signal.SIGINT)
    assert await worker.finish() == (130 if how == "wait" else 0), worker.stderr
    assert worker.stderr == ""
    left = await _keys(valkey_notify.url, prefix)
    assert {key.rsplit(":", 1)[1] for key in left} <= set(_COUNTERS), left


async def test_an_unhandled_sigterm_leaves_holdings_to_end_by_their_ttl(
    spawn: Spawn, valkey_notify: ServerProcess
) -> None:
    """Python's default SIGTERM ends the process at once, nothing run: the holdings and
    the queued waiter stay on the server until their ttl. The lock may be handed to the
    dead waiter as the holder's lease ends, and that grant ends by its ttl: the name is
    free again within 2 x ttl."""
    prefix, ttl = f"exit-{secrets.token_hex(4)}", 1.0
    worker = await _service(spawn, valkey_notify.url, prefix, ttl, "wait")
    worker.proc.send_signal(signal.SIGTERM)
    assert await worker.finish() == -signal.SIGTERM
    assert worker.stderr == ""
    left = await _keys(valkey_notify.url, prefix)
    kinds = {key.rsplit(":", 1)[1] for key in left}
    assert {"owner", "holders", "waiters"} <= kinds, left
    # a fence counter is kept max(ttl + 1 s, FENCE_KEEP_MS) after its last grant
    assert all(
        0
        < pttl
        <= (
            max(ttl * 1000 + _IDLE_MS, _FENCE_KEEP_MS)
            if key.endswith(":fence")
            else ttl * 1000 + _IDLE_MS
        )
        for key, pttl in left.items()
    ), left
    async with redis.asyncio.Redis.from_url(valkey_notify.url) as client:
        started = time.monotonic()
        mutex = RedisMutex(client, "exit:mutex", ttl=5, prefix=prefix)
        assert await mutex.acquire(timeout=5)
        assert time.monotonic() - started <= 2 * ttl + 0.5
        await mutex.release()


# -- the examples and the command line, as a user runs them --------------------------------

ROOT = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def _program(*argv: object, env: dict[str, str] | None = None) -> AsyncIterator[Worker]:
    """`argv` as a process in a session of its own (as a terminal runs a command: a Ctrl-C
    is sent to its whole process group), with this checkout importable; killed at the end."""
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    for name, value in (env or {}).items():
        if value == "":
            environ.pop(name, None)
    proc = await asyncio.create_subprocess_exec(
        *map(str, argv),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=environ, start_new_session=True,
    )  # fmt: skip
    worker = Worker(proc, f"{Path(str(argv[1])).name} (pid {proc.pid})")
    try:
        yield worker
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await worker.finish()


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


async def _all_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    """Wait (bounded) for every process of `pids` to end; those still running after it."""
    loop = asyncio.get_running_loop()
    waits: list[asyncio.Future[None]] = []
    fds = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds.append(fd)
        ended: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _settle, ended)
        waits.append(ended)
    try:
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        return {pid for pid in pids if not _ended(pid)}
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _ended(pid: int) -> bool:
    """Gone, or a zombie (ended, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def _at_least(pid: int, count: int, timeout: float = 10.0) -> set[int]:
    """The processes below `pid` once there are `count` (bounded): a process tells nobody
    when it has started its own, so /proc is looked at (not a server) every 20 ms."""
    async with asyncio.timeout(timeout):
        while len(found := _descendants(pid)) < count:  # noqa: ASYNC110 (no event: see above)
            await asyncio.sleep(0.02)
    return found


async def _lines_until(worker: Worker, text: str, timeout: float = 60.0) -> list[str]:
    """Read `worker`'s stdout until a line containing `text`; every line read."""
    stdout = worker.proc.stdout
    assert stdout is not None

    async def read() -> list[str]:
        lines: list[str] = []
        while True:
            raw = await stdout.readline()
            assert raw, f"{worker.name} ended before {text!r}: {lines}"
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            if text in lines[-1]:
                return lines

    return await asyncio.wait_for(read(), timeout)


@ONE_SERVER
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_the_scheduler_example_stopped_as_leader_resigns_quietly(
    r: redis.asyncio.Redis, url: str, stop: signal.Signals
) -> None:
    """Ctrl-C (to the process group, as a terminal sends it) or a SIGTERM (`kill`, a
    container's stop): the leader resigns on the way out and says nothing."""
    example = ROOT / "examples" / "singleton_scheduler.py"
    async with _program(sys.executable, WATCH, example, "replica-a", env={"REDIS_URL": url}) as app:
        await _lines_until(app, "elected replica-a")
        _stop(app, stop)
        assert await app.finish() == 0
        assert app.stderr == ""
    assert await RedisElection(r, "scheduler").leader() is None  # resigned on the way out


@ONE_SERVER
async def test_the_scheduler_example_resigns_when_a_cancellation_is_lost(
    r: redis.asyncio.Redis, url: str
) -> None:
    """The flake of the test above (issue 40 item 3). On Python 3.11, `asyncio.wait_for`,
    which redis-py uses for a new connection's handshake, returns the call's result and
    drops a cancellation that comes as the call completes. The example's first job call
    opens its client's first connection, so both cancellations of a stop (the gather's and
    its own) could be lost there: the leader led on, the example's 5 s wait for it ran out,
    and it closed the client under the holding (left to its ttl: the leader still elected).
    Here the first job call loses every cancellation that comes while it runs, 0.3 s."""
    scheduler = _example("singleton_scheduler")
    loop = asyncio.get_running_loop()
    elected = asyncio.Event()
    calls = 0

    async def job(client: redis.asyncio.Redis, replica: str, fence: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            elected.set()
            until = loop.time() + 0.3
            while loop.time() < until:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(until - loop.time())  # (the model of a lost cancel)

    client = redis.asyncio.Redis.from_url(url)
    serving = asyncio.create_task(scheduler.serve(client, "replica-a", job=job, say=str))
    await asyncio.wait_for(elected.wait(), 10)
    serving.cancel()  # as Ctrl-C does (asyncio.run cancels its main task)
    with pytest.raises(asyncio.CancelledError):
        await serving
    await client.aclose()
    assert await RedisElection(r, "scheduler").leader() is None  # resigned before the close


def _example(name: str) -> Any:
    """An example program, imported as a module (its `__main__` part not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stop(app: Worker, how: signal.Signals) -> None:
    """Ctrl-C goes to the whole process group, as a terminal sends it; other signals to the
    program alone, as `kill` does."""
    if how == signal.SIGINT:
        os.killpg(app.proc.pid, how)
    else:
        app.proc.send_signal(how)


@ONE_SERVER
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("name", ["fastapi_orders", "aiohttp_orders"])
async def test_the_web_examples_stop_quietly_on_ctrl_c_and_sigterm(
    url: str, name: str, stop: signal.Signals
) -> None:
    """Each says "Ctrl-C stops it": a Ctrl-C (to the process group, as a terminal sends it)
    or a SIGTERM ends it with no traceback and nothing on stderr but the web server's log."""
    port = free_port()
    example = ROOT / "examples" / f"{name}.py"
    async with _program(sys.executable, example, port, env={"REDIS_URL": url}) as app:
        said = await _lines_until(app, "Ctrl-C stops it")
        assert f"orders service at http://127.0.0.1:{port}" in said
        _stop(app, stop)
        status = await app.finish()
    # uvicorn raises a SIGTERM again once it has shut down, as the signal would end it.
    assert status in ((0, -signal.SIGTERM) if stop == signal.SIGTERM else (0,)), app.stderr
    noise = [line for line in app.stderr.splitlines() if not line.startswith("INFO:")]
    assert noise == [], app.stderr


async def test_the_scheduler_example_runs_alone_on_an_embedded_server() -> None:
    with contextlib.suppress(OSError), socket.create_connection(("localhost", 6379), 0.5):
        pytest.skip("a server listens on localhost:6379: the example would use it")
    example = ROOT / "examples" / "singleton_scheduler.py"
    async with _program(sys.executable, WATCH, example, "replica-a", env={"REDIS_URL": ""}) as app:
        said = await _lines_until(app, "elected replica-a")
        assert said[0].startswith("started an embedded Valkey at redis://127.0.0.1:")
        assert said[1].strip().startswith("REDIS_URL=redis://127.0.0.1:")
        below = _descendants(app.proc.pid)
        assert below  # its server
        os.killpg(app.proc.pid, signal.SIGINT)
        assert await app.finish() == 0
        assert app.stderr == ""
        assert await _all_gone(below) == set()


@ONE_SERVER
async def test_a_web_servers_graceful_shutdown_finishes_the_request_and_the_lock(
    r: redis.asyncio.Redis, url: str
) -> None:
    """uvicorn, SIGTERM while a request holds its order's lock: the request is answered,
    the lifespan closes the client, the loop ends; nothing from aiolocks on stderr."""
    example = ROOT / "examples" / "fastapi_orders.py"
    port = free_port()
    owner = "aiolocks:mutex:{orders:7}:owner"
    pubsub = r.pubsub()
    await pubsub.subscribe(f"__keyspace@0__:{owner}")
    async with _program(sys.executable, example, port, env={"REDIS_URL": url}) as app:
        await _lines_until(app, "orders service at")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            charge = asyncio.ensure_future(http.post("/orders/7/charge", timeout=30))
            async with asyncio.timeout(20):  # the lock taken: the request is in the gateway
                async for message in pubsub.listen():
                    if message["type"] == "message" and message["data"] == b"set":
                        break
            app.proc.send_signal(signal.SIGTERM)
            answered = await charge
        assert answered.status_code == 200 and answered.json()["order"] == 7
        # uvicorn raises the signal again once it has shut down, as a signal would end it.
        assert await app.finish() in (0, -signal.SIGTERM)
    await pubsub.aclose()  # type: ignore[no-untyped-call]
    noise = [
        line
        for line in app.stderr.splitlines()
        if not line.startswith("INFO:")  # uvicorn's own log
    ]
    assert noise == [], app.stderr
    assert await r.exists(owner) == 0


async def test_ctrl_c_of_the_cli_demo_says_one_line_and_leaves_no_process() -> None:
    async with _program(sys.executable, "-m", "aiolocks", "demo", env={"REDIS_URL": ""}) as demo:
        await _lines_until(demo, "under RedisMutex")
        below = await _at_least(demo.proc.pid, 5)  # its server and 4 workers
        os.killpg(demo.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        assert await demo.finish() == 130
        assert demo.stderr == "aiolocks: interrupted\n"
        assert await _all_gone(below) == set()


@pytest.mark.parametrize("how", ["closed-pipe", "sigkill"])
async def test_no_child_of_the_demo_example_outlives_it(how: str) -> None:
    example = ROOT / "examples" / "demo.py"
    async with _program(sys.executable, example, env={"REDIS_URL": ""}) as demo:
        await _lines_until(demo, "without a lock")  # `python examples/demo.py | head -2`
        below = _descendants(demo.proc.pid)
        assert len(below) >= 1
        if how == "closed-pipe":
            demo.proc._transport.get_pipe_transport(1).close()  # type: ignore[attr-defined]
            assert await asyncio.wait_for(demo.proc.wait(), 60) == 141
            assert demo.proc.stderr is not None
            assert await demo.proc.stderr.read() == b""
        else:
            demo.proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(demo.proc.wait(), 30)
        assert await _all_gone(below) == set()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
async def test_aiolocks_server_serves_until_stopped_and_dies_with_its_command(
    how: signal.Signals,
) -> None:
    port = free_port()
    async with _program(sys.executable, "-m", "aiolocks", "server", "--port", port) as server:
        said = await _lines_until(server, "Valkey at")
        assert said == [f"Valkey at redis://127.0.0.1:{port} (no persistence): stop it with Ctrl-C"]
        async with redis.asyncio.Redis(port=port) as client:
            assert await client.ping()
        below = _descendants(server.proc.pid)
        assert len(below) == 1
        os.killpg(server.proc.pid, how) if how == signal.SIGINT else server.proc.send_signal(how)
        status = await server.finish()
        if how != signal.SIGKILL:
            assert (status, server.stderr, server.lines[-1:]) == (0, "", ["stopped"])
        assert await _all_gone(below) == set()


async def test_aiolocks_server_says_so_when_its_port_is_taken(valkey_notify: ServerProcess) -> None:
    async with _program(
        sys.executable, "-m", "aiolocks", "server", "--port", valkey_notify.port
    ) as server:
        assert await server.finish() == 1
        assert server.stderr == (
            f"aiolocks: port {valkey_notify.port} of 127.0.0.1 is in use "
            "(a server running there already?)\n"
        )
