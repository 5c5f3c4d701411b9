"""Waiting for a line in a server's log: the harness's event source for what a server does on
its own (a cluster turning ok, a replica finishing its sync, a sentinel meeting its peers).

Reading the log file repeatedly is a bounded wait on the server's own report; it sends nothing
to the server, so it is not polling Redis.
"""

from __future__ import annotations

import time

from _servers import ServerProcess

__all__ = ["LogWatch", "LogWaitTimeout"]

_READ_INTERVAL = 0.01  # between reads of the log file while waiting


class LogWaitTimeout(AssertionError):
    """The expected log line did not appear in time (or the server died first)."""


class LogWatch:
    """Follows one server's log from a point on (its start, or now) and counts lines that
    contain a given text. Create it *before* the action whose outcome it waits for."""

    def __init__(self, server: ServerProcess, *, from_start: bool = False) -> None:
        path = server.log_path
        if path is None:
            raise RuntimeError(f"{server!r} is not started: it has no log to watch")
        self.server = server
        self._path = path
        self._offset = 0 if from_start else path.stat().st_size
        self._partial = ""  # an unterminated last line, completed by the next read
        self.lines: list[str] = []  # every complete line seen since the starting point

    def count(self, text: str) -> int:
        """How many lines seen so far contain ``text`` (reads what was appended since)."""
        self._read()
        return sum(text in line for line in self.lines)

    def wait(self, text: str, timeout: float, *, count: int = 1) -> None:
        """Block until ``count`` lines contain ``text``; LogWaitTimeout after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self._done(text, count, deadline, timeout):
            time.sleep(_READ_INTERVAL)

    def _done(self, text: str, count: int, deadline: float, timeout: float) -> bool:
        if self.count(text) >= count:
            return True
        if not self.server.running:
            raise LogWaitTimeout(
                f"{self.server!r} exited before logging {text!r}; log:\n{self._tail()}"
            )
        if time.monotonic() >= deadline:
            raise LogWaitTimeout(
                f"{self.server!r} did not log {text!r} {count}x within {timeout:g}s; "
                f"log:\n{self._tail()}"
            )
        return False

    def _read(self) -> None:
        try:
            with self._path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except OSError:
            return
        if not chunk:
            return
        self._offset += len(chunk)
        *complete, self._partial = (self._partial + chunk.decode(errors="replace")).split("\n")
        self.lines.extend(complete)

    def _tail(self) -> str:
        return "\n".join([*self.lines[-30:], self._partial])
