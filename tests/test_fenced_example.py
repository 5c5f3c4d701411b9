"""examples/fenced_write.py: the fencing token guarding a database write (SQLite), as the
example runs, and in the overlap a Redis restart without persistence makes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio
from _servers import ServerProcess
from _web import load_example

from aiolocks import LockLost, RedisMutex

ROOT = Path(__file__).resolve().parent.parent


def test_the_example_refuses_the_stale_writer(valkey_notify: ServerProcess) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fenced_write.py")],
        env={"REDIS_URL": valkey_notify.url, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines() == [
        "A holds the lock, then stalls",
        "B charges 30, balance 70",
        "A charges 70: refused, its fence is older than B's",
        "balance 70",
        "A's release: LockLost (its lease had ended)",
    ]


@pytest.mark.slow
async def test_after_a_restart_without_persistence_the_fence_refuses_the_stale_writer(
    server_factory: Callable[..., ServerProcess],
) -> None:
    example = load_example("fenced_write")
    db = example.open_db()
    with db:
        db.execute("INSERT INTO accounts (id, balance) VALUES ('alice', 100)")
    server = server_factory()  # persistence off, as the suite's servers are
    a_client = redis.asyncio.Redis.from_url(server.url)
    a = RedisMutex(a_client, "accounts:alice", ttl=30)
    try:
        await a.acquire()
        fence_a = a.fencing_token
        assert fence_a is not None
        server.restart()  # every key gone: the lock looks free
        b_client = redis.asyncio.Redis.from_url(server.url)
        async with b_client, RedisMutex(b_client, "accounts:alice", ttl=30) as b:
            assert b.fencing_token is not None and b.fencing_token > fence_a
            assert example.charge(db, "alice", 30, b.fencing_token) == 70  # the overlap
            with pytest.raises(example.StaleFence, match="older"):
                example.charge(db, "alice", 70, fence_a)  # A, still believing it holds
            assert example.charge(db, "alice", 5, b.fencing_token) == 65  # B goes on
        with pytest.raises(LockLost):
            await a.release()
    finally:
        await a_client.aclose()
    assert db.execute("SELECT balance FROM accounts").fetchone()[0] == 65
