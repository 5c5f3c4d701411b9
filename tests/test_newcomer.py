"""A newcomer's first hour (issue 25): the traps the names set, one version, the docs'
counts."""

from __future__ import annotations

import asyncio
import re
import tomllib
import warnings
from pathlib import Path

import pytest
import redis.asyncio
from _cli import cli

import aiolocks
from aiolocks import (
    RedisMultiLock,
    RedisMutex,
    RedisRateLimiter,
    RedisReadWriteLock,
    RedisSemaphore,
)

ROOT = Path(__file__).resolve().parent.parent


def _lockers(r: redis.asyncio.Redis) -> list[tuple[str, object]]:
    rw = RedisReadWriteLock(r, "catalog")
    return [
        ("RedisMutex", RedisMutex(r, "orders:42")),
        ("RedisSemaphore", RedisSemaphore(r, "slots", limit=2)),
        ("ReadLock", rw.read()),
        ("WriteLock", rw.write()),
        ("RedisMultiLock", RedisMultiLock(r, ["a", "b"])),
    ]


async def test_if_locked_without_await_is_a_type_error_that_says_what_to_write(
    fake_r: redis.asyncio.Redis,
) -> None:
    """redis-py's `Lock.locked()` is a plain call; here it asks Redis and is a coroutine,
    so `if m.locked():` would always be true. It raises at once instead, and creates no
    "never awaited" warning on top."""
    for kind, lock in _lockers(fake_r):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(TypeError, match=rf"{kind}\.locked\(\) is a coroutine.*await"):
                if lock.locked():  # type: ignore[attr-defined]
                    pytest.fail("a coroutine was taken for true")


@pytest.mark.slow
def test_mypy_flags_if_locked_without_await_with_truthy_bool(tmp_path: Path) -> None:
    """Where the type system allows: mypy's opt-in `truthy-bool` error code (named on the
    migration page) catches the mistake before it runs."""
    from mypy import api

    program = tmp_path / "trap.py"
    program.write_text(
        "import redis.asyncio as redis\n"
        "from aiolocks import RedisMutex\n\n\n"
        "async def main(r: redis.Redis) -> None:\n"
        "    m = RedisMutex(r, 'x')\n"
        "    if m.locked():\n"
        "        print('held')\n"
        "    if await m.locked():\n"
        "        print('held')\n"
    )
    out, _, status = api.run(
        ["--strict", "--enable-error-code", "truthy-bool", "--no-incremental", str(program)]
    )
    assert status == 1
    assert out.count("error:") == 1 and "trap.py:7: error:" in out and "[truthy-bool]" in out


async def test_with_without_async_is_a_type_error_that_says_what_to_write(
    fake_r: redis.asyncio.Redis,
) -> None:
    """`with RedisMutex(...):` (as with `threading.Lock`) says to write `async with`, and
    takes nothing: the lock is still free afterwards."""
    for kind, lock in _lockers(fake_r):
        expected = rf"^{kind} is an async context manager.*`async with`"
        with pytest.raises(TypeError, match=expected), lock:  # type: ignore[attr-defined]
            pytest.fail("the body ran")
        assert await lock.locked() is False  # type: ignore[attr-defined]
    limiter = RedisRateLimiter(fake_r, "paid-api", rate=10, per=1.0)
    expected = r"^RedisRateLimiter is an async context manager.*`async with`"
    with pytest.raises(TypeError, match=expected), limiter:  # type: ignore[attr-defined]
        pytest.fail("the body ran")
    assert await fake_r.keys("*") == []  # no permit taken


@pytest.mark.slow
def test_mypy_still_flags_with_without_async(tmp_path: Path) -> None:
    from mypy import api

    program = tmp_path / "trap.py"
    program.write_text(
        "import redis.asyncio as redis\n"
        "from aiolocks import RedisMutex\n\n\n"
        "async def main(r: redis.Redis) -> None:\n"
        "    with RedisMutex(r, 'x'):\n"
        "        print('held')\n"
        "    async with RedisMutex(r, 'x'):\n"
        "        print('held')\n"
    )
    out, _, status = api.run(["--strict", "--no-incremental", str(program)])
    assert status == 1
    assert "trap.py:6: error:" in out and "__enter__" in out and "trap.py:8" not in out, out


async def test_await_locked_works_as_ever(fake_r: redis.asyncio.Redis) -> None:
    mutex = RedisMutex(fake_r, "orders:42")
    assert await mutex.locked() is False
    async with mutex:
        assert await mutex.locked() is True
        assert await asyncio.create_task(mutex.locked()) is True  # a coroutine for asyncio
        assert await asyncio.wait_for(mutex.locked(), 5) is True
        assert list(await asyncio.gather(mutex.locked(), mutex.locked())) == [True, True]
    for _, lock in _lockers(fake_r):
        assert await lock.locked() is False  # type: ignore[attr-defined]


async def test_one_version_everywhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "aiolocks.__version__"}
    ran = await cli("--version")
    assert (ran.code, ran.out) == (0, f"aiolocks {aiolocks.__version__}\n")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", aiolocks.__version__)


def test_the_docs_count_the_primitives_there_are() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    primitives = ["RedisMutex", "RedisSemaphore", "RedisReadWriteLock", "RedisRegistry",
                  "RedisElection", "RedisMultiLock", "RedisRateLimiter"]  # fmt: skip
    assert all(f"`{name}`" in index for name in primitives)
    assert "seven primitives" in index.lower() and "six" not in index.lower()
