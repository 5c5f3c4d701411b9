"""Asking before doing something that cannot be undone; never without a person to ask."""

from __future__ import annotations

from ._errors import Refused
from ._io import Streams

__all__ = ["confirm"]


def confirm(io: Streams, question: str, *, assume_yes: bool, declined: str) -> None:
    """Return if `assume_yes` or the person at the terminal answers yes; raise `Refused`
    (with `declined`) otherwise, and at once when stdin is not a terminal."""
    if assume_yes:
        return
    if not io.stdin.isatty():
        raise Refused(f"{declined}: stdin is not a terminal to confirm on; pass --yes")
    io.stderr.write(f"{question} [y/N] ")
    io.stderr.flush()
    # A blocking read on purpose: nothing else runs meanwhile, and Ctrl-C interrupts it.
    answer = io.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        raise Refused(f"{declined}: not confirmed")
