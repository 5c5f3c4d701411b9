"""examples/workers.py: the semaphore caps the API, the mutex stops doubles."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import redis.asyncio
from _web import EXAMPLES, ONE_SERVER, load_example


@ONE_SERVER
async def test_each_order_once_and_the_api_never_over_its_limit(
    r: redis.asyncio.Redis, url: str
) -> None:
    workers = load_example("workers")
    report = await workers.run(url, consumers=10, services=3, orders=25, redelivered=15)
    assert report.ok, report.summary()
    assert sorted(report.processed) == list(range(1, 26))
    assert set(report.processed.values()) == {1}
    assert report.skipped == 15  # every redelivery was recognised
    assert sum(report.api.calls.values()) == 25
    assert 1 <= report.api.most_at_once <= 3 and report.api.rejected == 0
    # 25 orders over 7 customers: each customer one id, the ids exactly 1..7.
    assert len(report.customer_ids) == 7
    assert sorted(id for ids in report.customer_ids.values() for id in ids) == list(range(1, 8))
    assert await r.dbsize() == 0  # the run removed its keys


@pytest.mark.slow
def test_the_script_on_its_embedded_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES.parent), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "workers.py"), "--orders", "12", "--api-limit", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "processed 12 orders, 0 more than once" in done.stdout
    calls = re.search(
        r"API calls (\d+), at most (\d+) at once \(limit 2\), 0 rejected", done.stdout
    )
    assert calls is not None, done.stdout
    assert int(calls[1]) == 12 and int(calls[2]) <= 2
    assert done.stdout.rstrip().endswith("OK")
