"""Finding primitives on the server: SCAN (never KEYS) with MATCH over the prefix, and which
kinds a name exists as. Keys are `<prefix>:<kind>:{<name>}:<part>` (see `aiolocks._keys`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis.asyncio
import redis.exceptions

from .._base._keys import KeySpace, validate_name
from ._errors import NotFound, Refused, UsageError

__all__ = [
    "KINDS",
    "LOCK_KINDS",
    "PARTS",
    "Found",
    "kinds_of",
    "resolve_kind",
    "scan",
    "scan_pattern",
]

# Every key each kind of primitive may have (a free mutex keeps only its fence counter).
PARTS: dict[str, tuple[str, ...]] = {
    "mutex": ("owner", "queue", "waiters", "fence"),
    "semaphore": ("holders", "queue", "waiters", "fence", "fences", "limit"),
    "rwlock": ("writer", "readers", "queue", "waiters", "fence", "fences"),
    "election": ("leader", "queue", "waiters", "fence", "candidates"),
    "registry": ("ids", "names", "counter"),
    "ratelimit": ("state",),
}
KINDS = tuple(PARTS)
# The kinds that are locks (something is held, and can be released).
LOCK_KINDS = ("mutex", "semaphore", "rwlock", "election")

# What follows "<prefix>:" in a key: braces cannot occur in a prefix or a name.
_REST = re.compile(r"(?P<kind>[a-z]+):\{(?P<name>[^{}]*)\}:(?P<part>[^:{}]+)")


@dataclass(frozen=True, order=True, slots=True)
class Found:
    """One primitive found on the server (sorted by name, then kind)."""

    name: str
    kind: str


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def scan_pattern(prefix: str, kind: str | None, pattern: str | None) -> str:
    """The SCAN MATCH pattern for `pattern` (a glob over names, default every name)."""
    return f"{_glob_escape(prefix)}:{kind or '*'}:{{{pattern or '*'}}}:*"


def _parse(prefix: str, key: bytes) -> Found | None:
    text = key.decode(errors="replace")
    if not text.startswith(prefix + ":"):
        return None
    match = _REST.fullmatch(text, len(prefix) + 1)
    if match is None or match["kind"] not in PARTS:
        return None
    try:
        validate_name(match["name"])
    except ValueError:
        return None  # not a name aiolocks would have written
    return Found(match["name"], match["kind"])


async def scan(
    client: redis.asyncio.Redis, prefix: str, kind: str | None, pattern: str | None, count: int
) -> list[Found]:
    """Every primitive with a key matching, one entry each, sorted. Refused on a Cluster
    node, whose SCAN sees only its own slots."""
    try:
        cluster = (await client.info("cluster")).get("cluster_enabled")
    except redis.exceptions.ResponseError:  # INFO denied (a least-privilege user)
        cluster = None
    if cluster:
        raise Refused("the server is a Redis Cluster node: list works with a single server only")
    found: set[Found] = set()
    match = scan_pattern(prefix, kind, pattern)
    async for key in client.scan_iter(match=match, count=count):
        primitive = _parse(prefix, key)
        if primitive is not None and (kind is None or primitive.kind == kind):
            found.add(primitive)
    return sorted(found)


async def kinds_of(client: redis.asyncio.Redis, prefix: str, name: str) -> list[str]:
    """The kinds `name` has keys as (one round trip; all share the name's hash tag)."""
    pipe = client.pipeline(transaction=False)
    for kind, parts in PARTS.items():
        keys = KeySpace(prefix, kind, name)
        pipe.exists(*(keys.key(part) for part in parts))
    counts = await pipe.execute()
    return [kind for kind, count in zip(PARTS, counts, strict=True) if int(count) > 0]


async def resolve_kind(
    client: redis.asyncio.Redis, prefix: str, name: str, kind: str | None
) -> str:
    """The kind `name` exists as: `kind` if given and present; else the only one found.
    `NotFound` if none, `UsageError` if several and `kind` is not given."""
    present = await kinds_of(client, prefix, name)
    if kind is not None:
        if kind not in present:
            raise NotFound(f"no {kind} named {name!r} under prefix {prefix!r}{_also(present)}")
        return kind
    if not present:
        raise NotFound(
            f"nothing named {name!r} under prefix {prefix!r} "
            f"(no {', '.join(KINDS[:-1])} or {KINDS[-1]} keys; see `aiolocks list`)"
        )
    if len(present) > 1:
        raise UsageError(f"{name!r} exists as {' and '.join(present)}: choose one with --kind")
    return present[0]


def _also(present: list[str]) -> str:
    return f" (it exists as {' and '.join(present)})" if present else ""
