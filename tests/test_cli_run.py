"""`aiolocks run NAME -- CMD`, as a real process (signals need one): exit statuses, the lock
held exactly while CMD runs, signal forwarding, SIGTERM then SIGKILL on a lost lease,
`--limit`, and CMD killed with `aiolocks run` itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from _web import ONE_SERVER
from _workers import ROOT

from aiolocks import RedisMutex, RedisSemaphore
from aiolocks.testing import expire_leases

pytestmark = pytest.mark.slow

CHILD = ROOT / "tests" / "workers" / "run_child.py"
BOUND = 10.0  # the longest any expected line or exit may take here


class Run:
    """One `aiolocks run` process, its CMD's stdout read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out = ""

    async def line(self) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), BOUND)
        assert raw, f"no more output (status {self.proc.returncode})"
        return raw.decode().strip()

    async def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self) -> tuple[int, str]:
        """Its exit status and its stderr (the rest of stdout goes to `out`)."""
        out, err = await asyncio.wait_for(self.proc.communicate(), BOUND)
        self.out = out.decode()
        assert self.proc.returncode is not None
        return self.proc.returncode, err.decode()


@pytest.fixture
async def start(url: str) -> AsyncIterator[Callable[..., Any]]:
    """`await start(*run_options, cmd=[...])`: start `aiolocks run` on the test server."""
    started: list[Run] = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    async def make(*options: str, cmd: list[str]) -> Run:
        argv = ["-m", "aiolocks.cli", "run", *options, "--url", url, "--", *cmd]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        started.append(Run(proc))
        return started[-1]

    try:
        yield make
    finally:
        for run in started:
            if run.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    run.proc.kill()
            await run.proc.communicate()


async def _dead(pid: int) -> bool:
    """True once process `pid` has exited (a zombie included: its parent may be a PID 1 that
    does not reap), woken by its pidfd, within BOUND."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(exited, BOUND)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def child(mode: str = "polite") -> list[str]:
    return [sys.executable, str(CHILD), mode]


@ONE_SERVER
async def test_holds_the_lock_while_cmd_runs_and_exits_with_its_status(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    mutex = RedisMutex(r, "nightly")
    run = await start("nightly", cmd=child())
    assert (await run.line()).startswith("started")
    info = await mutex.inspect()
    assert info.owner is not None and info.lease_remaining_ms is not None
    await run.send("exit 7")
    assert await run.finish() == (7, "")
    assert not await mutex.locked()  # released once CMD exited


@ONE_SERVER
async def test_not_acquired_exits_75_without_starting_cmd(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    mutex = RedisMutex(r, "nightly", ttl=30)
    async with mutex:
        for timeout in ("0", "0.3"):
            run = await start("nightly", "--timeout", timeout, cmd=child())
            status, err = await run.finish()
            assert status == 75
            assert err.count("\n") == 1 and "mutex 'nightly' not acquired" in err, err
            assert run.out == ""  # CMD never started
        assert (await mutex.inspect()).queue_length == 0  # the timed-out one left the queue


@ONE_SERVER
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_signals_go_to_cmd_and_the_lock_is_released_after_it_exits(
    r: redis.asyncio.Redis, start: Callable[..., Any], signum: int
) -> None:
    run = await start("nightly", cmd=child())
    assert (await run.line()).startswith("started")
    run.proc.send_signal(signum)
    assert await run.line() == f"got {signum}"
    assert await run.finish() == (3, "")
    assert not await RedisMutex(r, "nightly").locked()


@ONE_SERVER
async def test_a_lost_lease_sends_sigterm_then_sigkill_and_exits_79(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    run = await start("nightly", "--ttl", "0.6", "--grace", "0.5", cmd=child("stubborn"))
    pid = int((await run.line()).split()[1])
    assert await expire_leases(RedisMutex(r, "nightly")) == 1  # from this other process
    assert await run.line() == "term"  # SIGTERM, ignored by this CMD...
    status, err = await run.finish()  # ... then SIGKILL after the grace
    assert status == 79
    assert err.count("\n") == 1 and "lost the lease of mutex 'nightly'" in err, err
    assert await _dead(pid)


@ONE_SERVER
async def test_limit_runs_that_many_at_once(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    runs = [await start("gpu", "--limit", "2", cmd=child()) for _ in range(2)]
    for run in runs:
        assert (await run.line()).startswith("started")
    assert await RedisSemaphore(r, "gpu", limit=2).holders() == 2
    third = await start("gpu", "--limit", "2", "--timeout", "0", cmd=child())
    status, err = await third.finish()
    assert status == 75 and "semaphore (limit 2) 'gpu'" in err
    mismatch = await start("gpu", "--limit", "3", "--timeout", "0", cmd=child())
    status, err = await mismatch.finish()
    assert status == 1
    assert err == (
        "aiolocks: semaphore 'gpu' is stored with limit 2, not 3: give --limit 2, or add "
        "--set-limit to store 3 (every user of the name must then give --limit 3)\n"
    )
    raised = await start("gpu", "--limit", "3", "--set-limit", "--timeout", "0", cmd=child())
    assert (await raised.line()).startswith("started")  # the third permit, of three now
    assert (await RedisSemaphore(r, "gpu", limit=3).inspect()).limit == 3
    runs.append(raised)
    for n, run in enumerate(runs):
        await run.send(f"exit {n}")
        assert await run.finish() == (n, "")
    assert await RedisSemaphore(r, "gpu", limit=3).holders() == 0


@ONE_SERVER
@pytest.mark.skipif(sys.platform != "linux", reason="CMD dies with its parent on Linux")
async def test_cmd_dies_with_aiolocks_run_and_the_lease_ends_by_its_ttl(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    run = await start("nightly", "--ttl", "1", cmd=child("stubborn"))
    pid = int((await run.line()).split()[1])
    run.proc.kill()
    status, _ = await run.finish()
    assert status == -signal.SIGKILL
    assert await _dead(pid)  # killed with its parent (its stdout, shared, was closed too)
    # Nobody released it: the lease ends by its ttl, and the next one gets it then.
    assert await RedisMutex(r, "nightly").acquire(timeout=1 + BOUND)


@ONE_SERVER
async def test_cmd_that_cannot_run_and_usage_errors(
    r: redis.asyncio.Redis, start: Callable[..., Any]
) -> None:
    run = await start("nightly", cmd=["/nonexistent/cmd"])
    status, err = await run.finish()
    assert status == 127 and "cannot run /nonexistent/cmd" in err
    assert not await RedisMutex(r, "nightly").locked()
    run = await start("nightly", cmd=[])
    status, err = await run.finish()
    assert status == 2 and "no command to run" in err
    run = await start("nightly", "--timeout", "-1", cmd=child())
    status, err = await run.finish()
    assert status == 2 and "--timeout" in err


@ONE_SERVER  # keyspace notifications on: the test sees the waiter queue up
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_while_waiting_ends_the_wait_and_leaves_no_entry(
    r: redis.asyncio.Redis, start: Callable[..., Any], signum: int
) -> None:
    mutex = RedisMutex(r, "nightly", ttl=30)
    async with mutex:
        pubsub = r.pubsub()
        await pubsub.subscribe("__keyspace@0__:aiolocks:mutex:{nightly}:queue")
        try:
            run = await start("nightly", cmd=child())

            async def queued() -> None:
                async for message in pubsub.listen():
                    if message["type"] == "message" and message["data"] == b"rpush":
                        return

            await asyncio.wait_for(queued(), BOUND)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
        run.proc.send_signal(signum)
        status, err = await run.finish()
        assert (status, err) == (128 + signum, "")
        assert run.out == ""  # CMD never started
        assert (await mutex.inspect()).queue_length == 0
