"""examples/celery_orders.py: a real Celery worker (prefork pool, Redis broker on loopback)
charges orders under the same lock as examples/fastapi_orders.py, running beside it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
from _faults import leftovers
from _servers import ServerProcess, free_port

pytest.importorskip("celery")
from celery import Celery

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BOUND = 60.0  # longest wait for a process to start, or for a task's result


class Process:
    """A child process whose output lines are collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._seen = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            self.lines.append(raw.decode(errors="replace").rstrip())
            self._seen.set()

    async def until(self, text: str) -> str:
        async def wait() -> str:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                if self._reader.done():
                    raise AssertionError(f"ended before {text!r}: {self.lines}")
                self._seen.clear()
                await self._seen.wait()

        try:
            return await asyncio.wait_for(wait(), BOUND)
        except TimeoutError:
            raise AssertionError(f"no {text!r} within {BOUND:g} s: {self.lines}") from None

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)  # both shut down gracefully on it
        try:
            await asyncio.wait_for(self.proc.wait(), BOUND)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        await self._reader
        return self.proc.returncode or 0


@contextlib.asynccontextmanager
async def started(*argv: str, env: dict[str, str]) -> AsyncIterator[Process]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=EXAMPLES,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    process = Process(proc)
    try:
        yield process
    finally:
        await process.stop()


async def test_a_celery_worker_and_the_web_app_charge_each_order_once(
    valkey_notify: ServerProcess,
) -> None:
    url = valkey_notify.url
    r = redis.asyncio.Redis.from_url(url)
    await r.flushall()
    env = dict(os.environ, REDIS_URL=url, ORDER_LOCK_TTL="0.6", PAYMENT_SECONDS="0.5")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(EXAMPLES)])
    port = free_port()
    worker_argv = [sys.executable, "-m", "celery", "-A", "celery_orders", "worker",
                   "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "--without-gossip",
                   "--without-mingle", "--without-heartbeat", "-n", "orders@%h"]  # fmt: skip
    web_argv = [sys.executable, str(EXAMPLES / "fastapi_orders.py"), str(port)]
    celery = Celery(broker=url, backend=url)
    try:
        async with (
            started(*worker_argv, env=env) as worker,
            started(*web_argv, env=env) as web,
        ):
            await worker.until("ready.")
            await web.until("orders service at")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                orders = [2001, 2002, 2003]
                results = await asyncio.gather(
                    *(charged_everywhere(celery, http, order) for order in orders)
                )
            for order, (web_status, tasks) in zip(orders, results, strict=True):
                outcomes = [task["outcome"] for task in tasks]
                charges = outcomes.count("charged") + (web_status == 200)
                assert charges == 1, (order, web_status, tasks)
                assert set(outcomes) <= {"charged", "already_charged"}, tasks
                record = await r.hgetall(f"order:{order}")
                assert record[b"amount"] == str(100 * order).encode()
                fences = [task["fence"] for task in tasks]
                assert len(set(fences)) == len(fences)  # each holding its own fence
                assert await leftovers(r, "mutex", f"orders:{order}") == {}
        assert worker.proc.returncode == 0
        # No error, no warning from the forked workers (the lease renewed at ttl/3 = 0.2 s
        # during each 0.5 s payment), nothing left behind.
        log = "\n".join(worker.lines)
        assert "Traceback" not in log and "ERROR" not in log and "WARNING" not in log, log
        assert "LockLost" not in log, log
    finally:
        celery.close()
        await r.aclose()


async def charged_everywhere(
    celery: Celery, http: httpx.AsyncClient, order: int
) -> tuple[int, list[dict[str, Any]]]:
    """Two worker tasks and one web request for `order` at once."""

    def tasks() -> list[dict[str, Any]]:
        sent = [celery.send_task("orders.charge", args=[order]) for _ in range(2)]
        return [result.get(timeout=BOUND) for result in sent]

    worker_results, response = await asyncio.gather(
        asyncio.to_thread(tasks), http.post(f"/orders/{order}/charge", timeout=BOUND)
    )
    return response.status_code, worker_results
