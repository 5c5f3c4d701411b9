"""The engine's clock and its random tokens: every engine module reads them here, and only here.

`monotonic()` measures durations and deadlines in this process (never a wall clock: every
deadline in Redis is on the server's clock, `server_time()` in the scripts); `token_hex(n)`
makes acquisitions' tokens and clients' tags. The deterministic simulation (tests/sim)
replaces these two names for a run (virtual time, tokens from its seed).

Timers are armed relative to it (`loop.call_later(at - monotonic())`, `asyncio.timeout(...)`),
never at `loop.time() + ...`: the loop's clock may differ from this one (uvloop's does), and
a delay is the same on both.
"""

from __future__ import annotations

import secrets
import time

__all__ = ["monotonic", "token_hex"]

monotonic = time.monotonic
token_hex = secrets.token_hex
