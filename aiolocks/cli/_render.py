"""Rich tables for `inspect`, `list` and the demo (import only after `require("rich", ...)`)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..election import ElectionInfo
from ..mutex import MutexInfo
from ..ratelimit import RateLimiterInfo
from ..rwlock import RWLockInfo
from ..semaphore import SemaphoreInfo
from ._view import SHORT_TOKEN, Info, View, state_of

__all__ = ["console", "duration", "list_table", "show", "view_tables"]

_SIDES = {"x": "", "r": "read", "w": "write"}


def console(out: TextIO) -> Console:
    """A console on `out`: colours and live updates only when it is a terminal."""
    return Console(file=out, highlight=False, soft_wrap=False)


# Piped out (`aiolocks list | grep held`), lines are as long as their content: no terminal
# width to fit, so none of rich's 80-column default.
_PIPED_WIDTH = 1000


def show(out: TextIO, renderable: RenderableType) -> None:
    """Print `renderable` on `out`. On a terminal as rich lays it out; piped, as plain lines
    for other programs: no colours, no padding to the width, nothing wrapped at 80 columns."""
    terminal = console(out)
    if terminal.is_terminal:
        terminal.print(renderable)
        return
    buffer = io.StringIO()
    plain = Console(
        file=buffer, width=_PIPED_WIDTH, highlight=False, soft_wrap=False, color_system=None
    )
    plain.print(renderable)
    out.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))


def duration(ms: int | None) -> str:
    """`ms` for people: "350 ms", "28.1 s", "ended" (<= 0), "-" (unknown)."""
    if ms is None:
        return "-"
    if ms <= 0:
        return "ended"
    return f"{ms} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def _facts(info: Info) -> list[tuple[str, str]]:
    if isinstance(info, MutexInfo):
        return [("queue", f"{info.queue_length} waiting"), ("fence", str(info.fence))]
    if isinstance(info, SemaphoreInfo):
        limit = "not stored" if info.limit is None else str(info.limit)
        return [
            ("limit", limit),
            ("holders", str(info.holders)),
            ("queue", f"{info.queue_length} waiting"),
            ("fence", str(info.fence)),
        ]
    if isinstance(info, ElectionInfo):
        return [
            ("term", "-" if info.term is None else str(info.term)),
            ("lease left", duration(info.lease_remaining_ms)),
            ("candidates", f"{info.candidates} waiting"),
            ("fence", str(info.fence)),
        ]
    if isinstance(info, RWLockInfo):
        return [
            ("readers", str(info.readers)),
            ("queue", f"{info.queue_length} waiting"),
            ("fence", str(info.fence)),
        ]
    if isinstance(info, RateLimiterInfo):
        if info.burst is None:
            return [("settings", "none stored (idle: the key expired)")]
        return [
            *(
                ("rate", f"{limit.rate:g} per {limit.per:g} s, burst {limit.burst}")
                for limit in info.limits
            ),
            ("free now", str(info.available)),
            (
                "next free slot",
                "now" if not info.next_free_ms else f"in {duration(info.next_free_ms)}",
            ),
            ("reserved until", "-" if not info.reserved_ms else f"in {duration(info.reserved_ms)}"),
        ]
    return [("names", str(info.names))]


def view_tables(view: View) -> RenderableType:
    """The summary, the holders and the queue of one primitive."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row(view.kind, f"{view.name!r} (prefix {view.prefix!r})")
    head.add_row("state", view.state)
    for label, value in _facts(view.info):
        head.add_row(label, value)
    parts: list[RenderableType] = [head]
    if view.kind in ("registry", "ratelimit"):
        return Group(*parts)

    sided = view.kind == "rwlock"  # the only kind whose holders and waiters differ in side
    valued = view.kind == "election"  # leader and candidates have values
    holders = Table(title="holders", title_justify="left")
    holders.add_column("token", no_wrap=True)
    if sided:
        holders.add_column("side")
    if valued:
        holders.add_column("value")
    holders.add_column("fence", justify="right")
    holders.add_column("lease left", justify="right", no_wrap=True)
    for holder in view.holders:
        side = [_SIDES.get(holder.side, holder.side)] if sided else []
        side += [holder.value or ""] if valued else []
        fence = "-" if holder.fence is None else str(holder.fence)
        holders.add_row(
            holder.token[:SHORT_TOKEN], *side, fence, duration(holder.lease_remaining_ms)
        )
    if not view.holders:
        holders.add_row("(none)", *[""] * (len(holders.columns) - 1))
    parts.append(holders)

    queue = Table(title="queue, first served first", title_justify="left")
    queue.add_column("#", justify="right")
    queue.add_column("token", no_wrap=True)
    if sided:
        queue.add_column("side")
    if valued:
        queue.add_column("value")
    queue.add_column("client", no_wrap=True)
    queue.add_column("seen", justify="right", no_wrap=True)  # its last heartbeat
    queue.add_column("expires", justify="right", no_wrap=True)
    for waiter in view.queue:
        side = [_SIDES.get(waiter.side, waiter.side)] if sided else []
        side += [waiter.value or ""] if valued else []
        seen = waiter.heartbeat_age_ms
        queue.add_row(
            str(waiter.position),
            waiter.token[:SHORT_TOKEN],
            *side,
            waiter.client_tag,
            "-" if seen is None else f"{duration(max(seen, 1))} ago",
            f"in {duration(waiter.expires_in_ms)}" if waiter.live else "dead",
        )
    if not view.queue:
        queue.add_row("", "(empty)", *[""] * (len(queue.columns) - 2))
    parts.append(queue)
    return Group(*parts)


def list_table(rows: Sequence[tuple[str, Info]], match: str) -> RenderableType:
    """One row per primitive: kind, name, state, holders, queue length, fence; then how many
    and the pattern, on a line of its own (a caption would wrap at the table's width)."""
    table = Table()
    for column in ("kind", "name", "state"):
        table.add_column(column)
    for column in ("holders", "queue", "fence"):
        table.add_column(column, justify="right")
    for kind, info in rows:
        table.add_row(kind, info.name, state_of(info), *_counts(info))
    footer = Text(f"{len(rows)} found (SCAN MATCH {match})", style="table.caption")
    return Group(table, footer)


def _counts(info: Info) -> tuple[str, str, str]:
    if isinstance(info, MutexInfo):
        return str(int(info.owner is not None)), str(info.queue_length), str(info.fence)
    if isinstance(info, ElectionInfo):
        return str(int(info.leader is not None)), str(info.candidates), str(info.fence)
    if isinstance(info, SemaphoreInfo):
        return str(info.holders), str(info.queue_length), str(info.fence)
    if isinstance(info, RWLockInfo):
        held = info.readers + int(info.writer is not None)
        return str(held), str(info.queue_length), str(info.fence)
    return "-", "-", "-"
