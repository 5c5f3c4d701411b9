"""Run a Python program and report on stderr what it left behind when it ended.

    python _exitwatch.py [--uvloop] PROGRAM [ARGS...]

Runs PROGRAM as `__main__` (as `python PROGRAM ARGS` would) with an event loop policy
whose loops, when closed, print one `exit-watch:` line per task still pending and per timer
still armed; at the interpreter's exit (after a garbage collection) one per TCP connection
still open. Python's own reports of a task destroyed while pending, or of an exception
ignored in a coroutine, go to stderr as usual: a program that ends cleanly prints nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import os
import runpy
import signal
import sys
from typing import Any


def _say(what: str) -> None:
    print(f"exit-watch: {what}", file=sys.stderr, flush=True)


def _report(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        _say(f"pending task at loop close: {task!r}")
    for timer in getattr(loop, "_scheduled", ()):
        if not timer.cancelled():
            _say(f"timer armed at loop close: {timer!r}")


def _policy(uvloop: bool) -> asyncio.AbstractEventLoopPolicy:
    base: Any = asyncio.DefaultEventLoopPolicy
    if uvloop:
        import uvloop as uv

        base = uv.EventLoopPolicy

    class Watched(base):  # type: ignore[misc]
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            loop: asyncio.AbstractEventLoop = super().new_event_loop()
            close = loop.close

            def watched_close() -> None:
                if not loop.is_closed():
                    _report(loop)
                close()

            loop.close = watched_close  # type: ignore[method-assign]
            return loop

    policy: asyncio.AbstractEventLoopPolicy = Watched()
    return policy


def _open_connections() -> list[str]:
    """This process's TCP sockets that are connected (state ESTABLISHED or CLOSE_WAIT)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[9] in inodes and fields[3] in ("01", "08"):
                        found.append(f"{fields[1]} -> {fields[2]}")
        except OSError:
            continue
    return found


def _at_exit() -> None:
    gc.collect()
    for connection in _open_connections():
        _say(f"TCP connection open at exit: {connection}")


def main() -> None:
    args = sys.argv[1:]
    uvloop = args[:1] == ["--uvloop"]
    if uvloop:
        args = args[1:]
    # As in a terminal, whatever ran this: Ctrl-C raises KeyboardInterrupt (a process
    # started in the background by a shell inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    asyncio.set_event_loop_policy(_policy(uvloop))
    atexit.register(_at_exit)
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
