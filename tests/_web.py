"""Shared by the web integration tests: a gate that holds a request inside its handler."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from aiolocks import RedisMutex

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The HTTP layer does not depend on the server variant: one real server is enough.
ONE_SERVER = pytest.mark.parametrize("server", ["valkey-notify"], indirect=True)


class Gate:
    """Per key: `entered` is set when a handler gets in, `opened` lets it finish."""

    def __init__(self) -> None:
        self.entered: defaultdict[object, asyncio.Event] = defaultdict(asyncio.Event)
        self.opened: defaultdict[object, asyncio.Event] = defaultdict(asyncio.Event)
        self.cancelled: list[object] = []

    async def pass_through(self, key: object) -> None:
        """Called by a handler: say it is in, then wait to be let out."""
        self.entered[key].set()
        try:
            await self.opened[key].wait()
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise

    async def wait_entered(self, key: object) -> None:
        await asyncio.wait_for(self.entered[key].wait(), 10)


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` (the examples are scripts, not a package, and import
    their shared `_orders` module from their own directory)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pydantic look the module up
    spec.loader.exec_module(module)
    return module


async def is_free(r: redis.asyncio.Redis, name: str) -> bool:
    """Nobody holds the mutex `name` and nobody is queued for it (asks the server)."""
    info = await RedisMutex(r, name).inspect()
    return info.owner is None and info.queue_length == 0


def unreachable_client() -> redis.asyncio.Redis:
    """A client of a loopback port nobody listens on, failing at once (no retries, not
    after redis-py's back-off)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return redis.asyncio.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
