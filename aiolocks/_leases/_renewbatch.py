"""How `renew_batch.lua` is called: one script call renews (or heartbeats) many at once.

Each entry of its ARGV[1] names one of the operations the batch script embeds, its key
count and its arguments, each length-prefixed. A lease's entry is packed once, when it is
first renewed, and sent as it is every period after.
"""

from __future__ import annotations

from typing import Any

from .._scripts import load_batch

__all__ = ["OP", "RENEW_BATCH", "Entry", "pack"]

# The operations one batch call can run, by script name (their index in the batch script).
_OPERATIONS = ("renew_owner", "renew_member", "heartbeat", "election_renew")
OP = {name: index for index, name in enumerate(_OPERATIONS, start=1)}
RENEW_BATCH = load_batch("renew_batch", _OPERATIONS)


class Entry:
    """A lease's part of a batch call: its operation, keys and packed arguments."""

    __slots__ = ("keys", "op", "packed", "slot")

    def __init__(self, op: int, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> None:
        self.op = op
        self.keys = keys
        self.packed = pack(op, len(keys), args)
        self.slot = -1


def pack(op: int, key_count: int, args: tuple[Any, ...] | list[Any]) -> bytes:
    """One entry of `renew_batch.lua`'s ARGV[1]: its header, then each arg length-prefixed."""
    parts = [b"%d,%d,%d," % (op, key_count, len(args))]
    for arg in args:
        value = _encode(arg)
        parts.append(b"%d:%s" % (len(value), value))
    return b"".join(parts)


def _encode(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a lease argument must be bytes, str, int or float, not {value!r}")
    return repr(value).encode()
