"""The embedded Valkey server (`aiolocks._base._embedded`) ends with the process that started it,
however that process ends, and outlives the thread that started it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import redis.asyncio

ROOT = Path(__file__).resolve().parent.parent

# Starts a server from a thread that then ends, prints its pid and URL, and waits for a
# line on stdin: "exit" ends it normally (without stop()); otherwise the test signals it.
_PARENT = """
import sys, threading
from aiolocks._base._embedded import start_embedded_server
servers = []
starter = threading.Thread(target=lambda: servers.append(start_embedded_server()))
starter.start()
starter.join()
print(servers[0].pid, servers[0].connection_url, flush=True)
sys.stdin.readline()
"""

GONE_WITHIN = 10.0  # seconds; the kernel acts at once, the margin is for a loaded machine


async def _exited(pidfd: int, bound: float) -> bool:
    """Wait at most `bound` seconds for the process of `pidfd` to end; True if it did."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(ended, bound)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("end", ["SIGKILL", "SIGTERM", "exit"])
@pytest.mark.slow
async def test_the_server_ends_with_the_process_that_started_it(end: str) -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PARENT, env=env, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert parent.stdin is not None and parent.stdout is not None
    try:
        pid, url = (await asyncio.wait_for(parent.stdout.readline(), 30)).decode().split()
        async with redis.asyncio.Redis.from_url(url) as client:
            assert await client.ping()  # alive, although the thread that started it ended
        pidfd = os.pidfd_open(int(pid))  # before the parent ends: the pid cannot be reused now
        try:
            if end == "exit":
                parent.stdin.write(b"exit\n")
                await parent.stdin.drain()
            else:
                parent.send_signal(getattr(signal, end))
            assert await asyncio.wait_for(parent.wait(), 30) is not None
            assert await _exited(pidfd, GONE_WITHIN), f"the server outlived a parent ended by {end}"
        finally:
            os.close(pidfd)
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
