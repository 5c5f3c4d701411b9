"""One script call on its way through the auto-pipeline: what to run, its caller's future,
and how a reply (or an error) settles it.

The pipeline (`_autopipe`) queues and writes calls; the link (`_pipelink`) settles them as
their replies come. Both share this small type, kept here, below them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._base._errors import CONNECTION_ERRORS, NOSCRIPT_ERRORS, TIMEOUT_ERRORS
from .._scripts import Script

__all__ = ["Call", "Staged", "command"]

# What a lost connection looks like; every engine script is idempotent, so a call cut off
# by one may be sent again (once, if the caller allows).
_LINK_ERRORS = (*CONNECTION_ERRORS, *TIMEOUT_ERRORS)

# A script call as the engine sends it: (script, keys, args).
Staged = tuple[Script, tuple[bytes, ...], tuple[Any, ...]]


def command(
    script: Script, keys: tuple[bytes, ...], args: tuple[Any, ...], *, by_source: bool
) -> tuple[Any, ...]:
    """One script call as a command: by SHA, or by its text (EVAL) after a NOSCRIPT."""
    if by_source:
        return ("EVAL", script.source, len(keys), *keys, *args)
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


class Call:
    """One script call on its way: what to run, and the caller's future."""

    __slots__ = ("by_source", "future", "retry", "sent", "staged")

    def __init__(
        self,
        staged: Staged,
        retry: bool,
        future: asyncio.Future[Any],
        sent: Callable[[float], None] | None = None,
    ) -> None:
        self.staged = staged
        self.retry = retry  # a lost connection may still send it again
        self.by_source = False  # EVAL, after the server answered NOSCRIPT
        self.future = future
        self.sent = sent  # told the monotonic time each time it is written

    def settle(self, result: Any, again: list[Call]) -> None:
        """Hand `result` to the caller, or keep the call (in `again`) for another try."""
        if self.future.done():
            return  # the caller left (cancelled)
        if isinstance(result, asyncio.CancelledError):
            self.future.cancel()
        elif isinstance(result, NOSCRIPT_ERRORS) and not self.by_source:
            self.by_source = True
            again.append(self)
        elif isinstance(result, _LINK_ERRORS) and self.retry:
            self.retry = False
            again.append(self)
        elif isinstance(result, BaseException):
            self.future.set_exception(result)
            self.future.exception()  # retrieved: a caller that left must not have it logged
        else:
            self.future.set_result(result)
