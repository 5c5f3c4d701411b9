"""`aiolocks list [PATTERN]`: every primitive under the prefix, one row each, found by SCAN."""

from __future__ import annotations

import argparse
import asyncio

import redis.asyncio

from ._connect import connected, server_url
from ._io import Streams, write_json
from ._needs import require
from ._scan import Found, scan, scan_pattern
from ._view import Info, info_of, state_of, summary

__all__ = ["run"]

# Primitives inspected at once (each is a round trip or two on the one client).
_CONCURRENCY = 16


async def run(args: argparse.Namespace, io: Streams) -> int:
    if not args.json:
        require("rich", "cli", "a table")
    async with connected(server_url(args.url), args.connect_timeout) as client:
        found = await scan(client, args.prefix, args.kind, args.pattern, args.count)
        infos = await _inspect_all(client, found, args.prefix)
    rows = [(primitive.kind, info) for primitive, info in zip(found, infos, strict=True)]
    if args.json:
        write_json(
            io.stdout,
            [
                {"kind": kind, "name": info.name, "state": state_of(info), "summary": summary(info)}
                for kind, info in rows
            ],
        )
    else:
        from ._render import list_table, show

        match = scan_pattern(args.prefix, args.kind, args.pattern)
        show(io.stdout, list_table(rows, match))
    return 0


async def _inspect_all(client: redis.asyncio.Redis, found: list[Found], prefix: str) -> list[Info]:
    at_once = asyncio.Semaphore(_CONCURRENCY)

    async def one(primitive: Found) -> Info:
        async with at_once:
            return await info_of(client, primitive.kind, primitive.name, prefix)

    return list(await asyncio.gather(*(one(primitive) for primitive in found)))
