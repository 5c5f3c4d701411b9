"""Shared helpers of the worker processes of ``tests/test_mutex_processes.py``.

Workers print machine-readable lines to stdout, one event per line: a word, then
space-separated fields (``queued <token>``, ``acquired <index> <fence> <monotonic>``...).
``time.monotonic()`` is CLOCK_MONOTONIC, shared by every process of the host, so times
printed by different workers (and the test) can be compared.

Every worker bounds its whole run with `run` and exits on its own: 0 on success,
``EXIT_TIMEOUT`` when its deadline passed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

from aiolocks._base._clients import AnyRedis
from aiolocks._engine._context import context_for
from aiolocks._scripts import Script

__all__ = [
    "CLUSTER_SCHEME",
    "EXIT_TIMEOUT",
    "connect",
    "emit",
    "on_queued",
    "queued_token",
    "report_queued",
    "run",
]

EXIT_TIMEOUT = 3
# A URL "cluster+redis://host:port" means: a RedisCluster client bootstrapped from there.
CLUSTER_SCHEME = "cluster+"


def connect(url: str) -> Any:
    """A client for ``url``: a ``RedisCluster`` for a ``cluster+redis://`` URL, else a plain
    ``redis.asyncio.Redis`` (typed ``Any``: workers use the methods both have)."""
    if url.startswith(CLUSTER_SCHEME):
        return RedisCluster.from_url(url.removeprefix(CLUSTER_SCHEME))
    return redis.asyncio.Redis.from_url(url)


def emit(*fields: object) -> None:
    """Print one event line and flush it at once (stdout is a pipe)."""
    print(" ".join(str(field) for field in fields), flush=True)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queued_token(args: tuple[Any, ...], reply: Any) -> str | None:
    """The token of an aiolocks acquire-script call that put its caller on the server's queue.

    The acquire script is called as ``EVALSHA sha numkeys *keys member mode channel ...``
    (member = ``token:ttl_ms:tag:kind``) and answers ``{0, wait_ms}`` when, in mode
    ``wait``, it queued the caller (see
    ``aiolocks/_base/_spec.py``). The reply arrives only after the script ran, so the caller
    is on the server's queue from then on.
    """
    if len(args) < 3 or _text(args[0]).upper() != "EVALSHA":
        return None
    argv = args[3 + int(args[2]) :]
    if len(argv) < 3 or _text(argv[1]) != "wait":
        return None
    if not isinstance(reply, list) or len(reply) < 2 or int(reply[0]) != 0:
        return None
    return _text(argv[0]).split(":", 1)[0]


def on_queued(client: AnyRedis, queued: Callable[[str], None]) -> None:
    """Call `queued(token)` once per token, as soon as the reply of an acquire call of
    `client` on this event loop says that waiter is queued.

    It wraps the engine's one script runner (`ClientContext.run`), so it sees every script
    call whether it went alone or in an auto-pipelined batch.
    """
    context = context_for(client)
    inner = context.run
    seen: set[str] = set()

    async def run(
        script: Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        retry: bool = True,
        sent: Any = None,
    ) -> Any:
        reply = await inner(script, keys, args, retry=retry, sent=sent)
        token = queued_token(("EVALSHA", script.sha, len(keys), *keys, *args), reply)
        if token is not None and token not in seen:
            seen.add(token)
            queued(token)
        return reply

    context.run = run  # type: ignore[method-assign]


def report_queued(client: AnyRedis) -> None:
    """Print ``queued <token>`` once per token of `client` (see `on_queued`)."""
    on_queued(client, lambda token: emit("queued", token))


def run(main: Coroutine[Any, Any, int], timeout: float) -> int:
    """Run ``main`` for at most ``timeout`` seconds; its exit status, or ``EXIT_TIMEOUT``."""

    async def bounded() -> int:
        try:
            return await asyncio.wait_for(main, timeout)
        except TimeoutError:
            emit("timeout", timeout)
            return EXIT_TIMEOUT

    status = asyncio.run(bounded())
    sys.stdout.flush()
    return status
