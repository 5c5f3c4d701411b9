"""One client, one event loop: aiolocks refuses, with a clear error and before any Redis
call, a client whose connections belong to another event loop; a client closed before its
loop ended, or whose loop ended through `asyncio.run()` (aiolocks then closes its idle
connections), may be used again by the next one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis.asyncio
from _web import ONE_SERVER

from aiolocks import RedisMutex

ROOT = Path(__file__).resolve().parent.parent

# Two asyncio.run() calls on one client, as a script would make them.
_TWO_RUNS = """
import asyncio, sys
import redis.asyncio as redis
from aiolocks import RedisMutex

r = redis.Redis.from_url(sys.argv[1])

async def take(close):
    async with RedisMutex(r, "job", local_handoff=0) as mutex:
        fence = mutex.fencing_token
        await r.incr("runs")  # the app's own command: a pooled connection on this loop
    if close:
        await r.aclose()
    return fence

print(asyncio.run(take(close=True)))  # closed before its loop ended: fine to use again
print(asyncio.run(take(close=False)))  # left open: aiolocks closes them as the loop ends
loop = asyncio.new_event_loop()  # a loop closed without asyncio.run's clean-up
print(loop.run_until_complete(take(close=False)))  # left open: they belong to a dead loop
loop.close()
try:
    asyncio.run(take(close=True))
except RuntimeError as error:
    print("refused:", error)
"""


@ONE_SERVER
async def test_a_client_in_use_on_a_running_loop_is_refused_on_another(
    r: redis.asyncio.Redis,
) -> None:
    mutex = RedisMutex(r, "job", local_handoff=0)  # its fence is the stored one
    assert await mutex.acquire()

    async def from_another_loop() -> bool:
        return await RedisMutex(r, "job", local_handoff=0).acquire(blocking=False)

    with pytest.raises(RuntimeError, match=r"in use on another event loop.*one client per"):
        await asyncio.to_thread(asyncio.run, from_another_loop())
    info = await mutex.inspect()  # nothing was sent: still ours, nobody queued
    assert (info.fence, info.queue_length) == (mutex.fencing_token, 0)
    await mutex.release()


@ONE_SERVER
async def test_a_client_left_open_by_an_ended_loop_is_refused_one_closed_is_not(
    url: str, r: redis.asyncio.Redis
) -> None:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _TWO_RUNS, url],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second, third, refused = done.stdout.splitlines()
    assert 0 < int(first) < int(second) < int(third)
    assert refused.startswith("refused: this Redis client was used on an event loop that has ended")
    assert "`await client.aclose()` before the loop ends" in refused
    info = await RedisMutex(r, "job").inspect()  # the refused run sent nothing
    assert (info.fence, info.owner) == (int(third), None)
    assert await r.get("runs") == b"3"


# The engine's tests that matter on another loop: the auto-pipeline (its direct reads swap
# the transport's protocol), the mutex (waiting, hand-off, timeouts), wakes, cancellation
# at every await, and lease renewal and loss. `nox -s compat` runs more of them.
UVLOOP_TESTS = [
    "tests/test_autopipe.py",
    "tests/test_mutex.py",
    "tests/test_waitqueue_wakes.py",
    "tests/test_cancellation.py",
    "tests/test_keeper.py",
]


@pytest.mark.slow
def test_the_engine_tests_pass_on_uvloop() -> None:
    """Those tests again, in a pytest process whose loops are uvloop's (what `uvicorn
    [standard]` runs): the conftest sets uvloop's policy when AIOLOCKS_TEST_LOOP=uvloop."""
    pytest.importorskip("uvloop", reason="uvloop is not installed")
    env = {**os.environ, "AIOLOCKS_TEST_LOOP": "uvloop"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow",
         "-rfEs", *UVLOOP_TESTS],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "aiolocks tests event loop: uvloop" in done.stdout  # the conftest's header
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
