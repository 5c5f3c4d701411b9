"""Key and channel names: every key of one primitive shares one hash tag (one Cluster slot)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_NAME_BYTES",
    "KeySpace",
    "name_tag",
    "validate_name",
    "validate_prefix",
]

DEFAULT_PREFIX = "aiolocks"
# A name is part of every key and channel of its primitive (and of every grant message's
# routing); a longer one is almost surely a mistake, such as a payload passed as the name.
MAX_NAME_BYTES = 1024


def validate_name(name: object, what: str = "name") -> str:
    """Return `name` if it can be a primitive's name; raise `TypeError`/`ValueError` if not."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    return _checked_name(name, what)


# A handler makes a primitive per request, its name one of a few it uses again and again:
# a name found good is not checked again (an error is not cached: it raises each time).
@functools.lru_cache(maxsize=4096)
def _checked_name(name: str, what: str) -> str:
    if not name:
        raise ValueError(f"{what} must not be empty")
    if "{" in name or "}" in name:
        raise ValueError(
            f"{what} {name!r} must not contain '{{' or '}}' (they delimit the hash tag)"
        )
    try:
        size = len(name.encode())
    except UnicodeEncodeError as exc:
        reason = f"{exc.reason} at index {exc.start}"
        raise ValueError(f"{what} must be encodable as UTF-8: {reason}") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} is too long: {size} bytes in UTF-8, at most {MAX_NAME_BYTES}")
    return name


def validate_prefix(prefix: object) -> str:
    """Return `prefix` if it can start every key; raise if not."""
    return validate_name(prefix, "prefix")


@functools.lru_cache(maxsize=256)
def _opening(prefix: str, kind: str) -> bytes:
    """`<prefix>:<kind>:{`, encoded: the same for every name of a kind under a prefix."""
    return f"{prefix}:{kind}:{{".encode()


def name_tag(prefix: str, kind: str, name: str) -> bytes:
    """`<prefix>:<kind>:{<name>}:`, encoded: each key of the primitive is it and a part.
    (A primitive made per request builds its keys from it, the prefix's share cached.)"""
    return _opening(prefix, kind) + name.encode() + b"}:"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The keys of one primitive: `<prefix>:<kind>:{<name>}:<part>`, pre-encoded once."""

    prefix: str
    kind: str
    name: str

    def key(self, part: str) -> bytes:
        return name_tag(self.prefix, self.kind, self.name) + part.encode()


def parse_key(key: bytes) -> tuple[str, str, str]:
    """The (kind, name, part) of a key made by `KeySpace.key`: its inverse, for telemetry
    that sees only a key. A name has no `}`, so the last `}:` ends it."""
    head, _, rest = key.partition(b"{")
    name, _, part = rest.rpartition(b"}:")
    kind = head[:-1].rpartition(b":")[2]
    return kind.decode(), name.decode(), part.decode()
