"""`LockHandle`: a holding detached from its process, as a short string for a job payload.

`str(handle)` is `aiolocks-handle:1:<kind>:<prefix>:<name>:<token>:<fence>`, the prefix and
name percent-encoded (they may contain `:`); `LockHandle.parse` reads it back. The token is
the holding's secret: whoever has the handle can take the holding over, so treat it like a
credential of the lock (it grants nothing else).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import final
from urllib.parse import quote, unquote

from ._keys import validate_name, validate_prefix

__all__ = ["KINDS", "LockHandle"]

_MAGIC = "aiolocks-handle"
_VERSION = "1"
# The kinds of holding that can be handed over, one per lock class (or side).
KINDS = ("mutex", "semaphore", "rwlock-read", "rwlock-write")
_TOKEN = re.compile(r"[0-9a-f]{32}(\+[0-9]+)?")  # "+N": a local hand-off cohort's


@final
@dataclass(frozen=True, slots=True)
class LockHandle:
    """A holding handed from one process to another: made by `detach()`, taken over by
    `adopt()` (once). `str()` gives a short string to put in a job; `parse()` reads it."""

    kind: str  # "mutex", "semaphore", "rwlock-read" or "rwlock-write"
    name: str
    token: str  # the holding's secret token
    fencing_token: int
    prefix: str = "aiolocks"

    def __str__(self) -> str:
        prefix, name = quote(self.prefix, safe=""), quote(self.name, safe="")
        return f"{_MAGIC}:{_VERSION}:{self.kind}:{prefix}:{name}:{self.token}:{self.fencing_token}"

    def __repr__(self) -> str:  # the token stays out of logs
        return f"<LockHandle {self.kind} {self.name!r} fence={self.fencing_token}>"

    @classmethod
    def parse(cls, text: str) -> LockHandle:
        """Read a handle back from `str(handle)`; `ValueError` if `text` is not one."""
        if not isinstance(text, str):
            raise TypeError(f"a lock handle is a str, not {type(text).__name__}")
        fields = text.split(":")
        if len(fields) != 7 or fields[0] != _MAGIC:
            raise ValueError(f"not an aiolocks lock handle: {text[:60]!r}")
        _, version, kind, prefix, name, token, fence = fields
        if version != _VERSION:
            raise ValueError(f"lock handle version {version!r} is not supported (expected 1)")
        if kind not in KINDS:
            raise ValueError(f"lock handle of unknown kind {kind!r}")
        if not _TOKEN.fullmatch(token):
            raise ValueError("lock handle with a malformed token")
        if not (fence.isascii() and fence.isdigit()):
            raise ValueError(f"lock handle with a malformed fencing token {fence!r}")
        return cls(
            kind=kind,
            name=validate_name(unquote(name, errors="strict")),
            token=token,
            fencing_token=int(fence),
            prefix=validate_prefix(unquote(prefix, errors="strict")),
        )
