"""`aiolocks inspect NAME`: kind, holders (token, fence, lease left), queue with ages."""

from __future__ import annotations

import argparse

from ._connect import connected, server_url
from ._io import Streams, write_json
from ._needs import require
from ._scan import resolve_kind
from ._view import view_of

__all__ = ["run"]


async def run(args: argparse.Namespace, io: Streams) -> int:
    if not args.json:
        require("rich", "cli", "a table")
    async with connected(server_url(args.url), args.connect_timeout) as client:
        kind = await resolve_kind(client, args.prefix, args.name, args.kind)
        view = await view_of(client, kind, args.name, args.prefix)
    if args.json:
        write_json(io.stdout, view.to_json())
    else:
        from ._render import show, view_tables

        show(io.stdout, view_tables(view))
    return 0
