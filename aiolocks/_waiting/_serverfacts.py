"""What the notifier must know of the server before its first subscription, and how it asks.

Grants are published with SPUBLISH where the server has sharded pub/sub (the scripts
decide from its version), so they must be subscribed with SSUBSCRIBE there; keyspace
events wake waiters sooner where the server has them on (asked with CONFIG GET).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._base._clients import AnyRedis
from .._base._errors import RESPONSE_ERRORS
from .._scripts import Script, load

__all__ = ["RunScript", "ServerFacts", "ask"]

_PUBSUB_MODE = load("pubsub_mode")

RunScript = Callable[[Script, tuple[bytes, ...], tuple[Any, ...]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What the notifier must know of the server before its first subscription."""

    sharded: bool  # grants are SPUBLISHed: subscribe with SSUBSCRIBE
    keyspace: bool  # keyspace events for generic and expired keys are on


async def ask(client: AnyRedis, run: RunScript) -> ServerFacts:
    """Ask the server (through `run`, the client's script runner, and `client`)."""
    # The scripts decide SPUBLISH or PUBLISH from the server's version: ask them.
    sharded = bool(await run(_PUBSUB_MODE, (), ()))
    try:
        reply = await client.config_get("notify-keyspace-events")
    except RESPONSE_ERRORS:
        # CONFIG denied (a least-privilege ACL user, whose keyspace channels would be
        # denied too) or renamed away: treat notifications as off; waiters still wake on
        # grant messages and on their timers.
        return ServerFacts(sharded, keyspace=False)
    flags = str(next(iter(reply.values()), "") if reply else "")
    keyspace = "K" in flags and ("A" in flags or ("g" in flags and "x" in flags))
    return ServerFacts(sharded, keyspace)
