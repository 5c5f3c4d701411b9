"""Every `$ aiolocks ...` line of docs/cli.md runs, against a test server holding the locks
the examples show, and exits as documented (0, or the status after a `$ echo $?` line)."""

from __future__ import annotations

import contextlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _cli import cli
from _probes import QueueProbe
from _web import ONE_SERVER
from conftest import Tasks

from aiolocks import LockError, RedisMutex, RedisReadWriteLock, RedisRegistry, RedisSemaphore
from aiolocks._base import _clock

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

# The tokens of the acquisitions `hold_the_examples_locks` makes, in order: the ones the
# page shows, so that its `--token` examples name real holders.
TOKENS = [
    "186804a2d9be82ba4ee5222b31d5f5fb",  # orders:42, the holder
    "cc45f81cb939078333e944899b12be54",  # orders:42, first waiter
    "af9c372e760e78c2f1d0b5a6e3c47a19",  # orders:42, second waiter
    "7d2e5b90c1f34a68b0e9d3c2a1f5e8b4",  # orders:7, held and released
    "0e332a3f115ff5ba654fc4adab23e9cf",  # paid-api, two holders
    "4ff4b646ef6a65291242b6f085c3029d",
    "b5fde2fdb2260e3c91a7e4d0c8f3b216",  # catalog, two readers
    "56ffcdab8b8c229f3e0d7a1b9c4e6f85",
    "3bb72b1242d5a64f8e9c0d1a2b3c4d5e",  # catalog, a writer waiting
]


@dataclass(frozen=True)
class Example:
    argv: list[str]
    status: int  # documented by a following `$ echo $?`, else 0
    answer: str | None  # typed at the prompt the example shows


def examples(url: str) -> list[Example]:
    found = []
    for block in re.findall(r"```console\n(.*?)```", DOC.read_text(), flags=re.S):
        lines = block.replace("redis://localhost:6379", url).splitlines()
        for at, line in enumerate(lines):
            if not line.startswith("$ aiolocks "):
                continue
            rest = lines[at + 1 :]
            end = next((i for i, later in enumerate(rest) if later.startswith("$ ")), len(rest))
            status = 0
            if rest[end:][:1] == ["$ echo $?"]:
                status = int(rest[end + 1])
            answer = "y\n" if any("[y/N] y" in shown for shown in rest[:end]) else None
            found.append(Example(shlex.split(line[2:])[1:], status, answer))
    return found


async def hold_the_examples_locks(
    r: redis.asyncio.Redis, other: redis.asyncio.Redis, tasks: Tasks
) -> list[Any]:
    """The state the page's examples show; returns the locks held by this task."""
    probe = QueueProbe(other)
    holder = RedisMutex(r, "orders:42", local_handoff=0)  # its fence is the stored one
    assert await holder.acquire()
    for _ in range(2):
        await tasks.queued(probe, RedisMutex(other, "orders:42", local_handoff=0).acquire())
    free = RedisMutex(r, "orders:7")
    assert await free.acquire()
    await free.release()
    held: list[Any] = [holder]
    for lock in (
        *(RedisSemaphore(r, "paid-api", limit=3) for _ in range(2)),
        *(RedisReadWriteLock(r, "catalog").read() for _ in range(2)),
    ):
        assert await lock.acquire()
        held.append(lock)
    await tasks.queued(probe, RedisReadWriteLock(other, "catalog").write().acquire())
    await RedisRegistry(r, "users").register_many(["alice", "bob", "carol"])
    return held


@ONE_SERVER
@pytest.mark.slow
async def test_every_command_in_the_docs_runs_as_documented(
    url: str, r: redis.asyncio.Redis, tasks: Tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", url)  # the examples that give no --url
    other = redis.asyncio.Redis.from_url(url)
    try:
        scripted = iter(TOKENS)
        with monkeypatch.context() as patch:
            made = _clock.token_hex  # acquisitions' tokens scripted, clients' tags not
            patch.setattr(_clock, "token_hex", lambda n: next(scripted) if n == 16 else made(n))
            held = await hold_the_examples_locks(r, other, tasks)
        assert next(scripted, None) is None  # every documented token was used

        ran_any = {"inspect": 0, "list": 0, "release": 0, "demo": 0}
        for example in examples(url):
            ran = await cli(*example.argv, answer=example.answer)
            assert ran.code == example.status, (example, ran.out, ran.err)
            ran_any[example.argv[0]] += 1
        assert all(ran_any.values()), ran_any  # the page shows every command
        for lock in held:
            with contextlib.suppress(LockError):  # some were force-released by the page
                await lock.release()
    finally:
        await tasks.reap()  # the waiters still queued use `other` to withdraw
        await other.aclose()


def test_the_pages_claims_about_the_demo_and_the_extra_hold() -> None:
    """The demo's fences are the server clock (16 digits: test_cli's demo test sees them so),
    not numbers from 1; and the command comes with the package, the `cli` extra adds rich."""
    page = " ".join(DOC.read_text().split())
    assert "fences start at 1" not in page
    assert "Its fences are 16-digit server timestamps" in page
    assert "whatever extras you install" in page and "which the `cli` extra adds" in page
