"""Instructions per uncontended cycle, counted by callgrind (bench_cost.py --instructions):
the server's, and the client's.

`INFO cpu` per cycle moves with the machine's other work by more than the differences it
should show (one run saw 1.27x python-redis-lock, a quiet one 1.81x, for the same build),
and so does a client's process CPU time; callgrind counts the instructions a process
executes, which no load changes. Each library runs in a client process of its own: warmed
up, then the counters zeroed, `cycles` acquire + release cycles as a user writes them (an
aiolocks mutex made per cycle, with each build's default), then dumped; for aiolocks, then
`cycles` more on one instance made before them (the cycle alone). Two passes: the server
under callgrind, its clients not (a slowed client would let the server's timers run more
per cycle); then each client under callgrind, the server not. Network system calls are the
kernel's and are not counted; a client's count is its interpreter's whole work (the event
loop, redis-py, the garbage collector), and varies by a percent or two from run to run with
how its loop's iterations meet the replies: alternate rounds, and read the median.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _harness import free_loopback_port

_CLIENT = r"""
import asyncio, sys
root, port, cycles, library = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, root)
NAME = "bench:instructions"

def step(said):  # told the counters' owner, then wait until it has zeroed or dumped them
    print(said, flush=True); sys.stdin.readline()

async def asynchronous(cycle, made=None):
    import redis.asyncio
    client = redis.asyncio.Redis(port=port)
    for _ in range(200):
        await cycle(client)
    step("ready")
    for _ in range(cycles):
        await cycle(client)
    step("done")
    if made is not None:  # the cycle alone, on one instance
        lock = made(client)
        for _ in range(200):
            async with lock:
                pass
        step("ready")
        for _ in range(cycles):
            async with lock:
                pass
        step("done")
    await client.aclose()

def aiolocks_mutex(client):
    from aiolocks import RedisMutex
    return RedisMutex(client, NAME, ttl=30)

async def aiolocks_cycle(client):
    async with aiolocks_mutex(client):
        pass

async def redispy_cycle(client):
    async with client.lock(NAME, timeout=30, sleep=0.1):
        pass

def python_redis_lock():
    import redis, redis_lock
    client = redis.Redis(port=port)
    def cycle():
        lock = redis_lock.Lock(client, NAME, expire=30)
        lock.acquire()
        lock.release()
    for _ in range(200):
        cycle()
    step("ready")
    for _ in range(cycles):
        cycle()
    step("done")

if library == "aiolocks":
    asyncio.run(asynchronous(aiolocks_cycle, aiolocks_mutex))
elif library == "redis-py":
    asyncio.run(asynchronous(redispy_cycle))
else:
    python_redis_lock()
"""


def _valgrind() -> list[str]:
    valgrind = shutil.which("valgrind")
    if valgrind is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    return [valgrind, "--tool=callgrind"]


@contextlib.contextmanager
def _server(workdir: Path, counted: bool) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A redis-server on a free loopback port, under callgrind if `counted`."""
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("--instructions needs redis-server")
    port = free_loopback_port()
    under = [*_valgrind(), f"--callgrind-out-file={workdir}/server.%p"] if counted else []
    process = subprocess.Popen(
        [*under, server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        import redis as sync_redis

        for _ in range(300):  # valgrind takes seconds to start the server
            with contextlib.suppress(Exception):
                if sync_redis.Redis(port=port).ping():
                    break
            time.sleep(0.05)
        yield port, process
    finally:
        process.terminate()
        process.wait(30)


def _control(option: str, pid: int) -> None:
    subprocess.run(
        ["callgrind_control", option, str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _dumped(workdir: Path, pid: int) -> int:
    """Dump the callgrind counters of process `pid` (since their last zeroing) and read their
    total."""
    before = set(workdir.glob("*.*"))
    _control("-d", pid)
    dumps = sorted(set(workdir.glob(f"*.{pid}*")) - before, key=lambda path: path.stat().st_mtime)
    dump = dumps[-1]
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


class _Client:
    """One library's client process (under callgrind if `counted`), stepped through its
    phases."""

    def __init__(
        self, workdir: Path, port: int, cycles: int, library: str, root: Path, counted: bool
    ):
        under = [*_valgrind(), f"--callgrind-out-file={workdir}/client.%p"] if counted else []
        self.process = subprocess.Popen(
            [*under, sys.executable, "-c", _CLIENT, str(root), str(port), str(cycles), library],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dicts in every run
        )

    def said(self) -> str | None:
        """The client's next step ("ready", "done"), None when it has ended."""
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip() or None

    def go_on(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()


PHASES = ("per cycle", "one instance")  # a mutex made per cycle; the cycle alone


def _counted(
    column: str, library: str, root: Path, cycles: int, server_counted: bool
) -> dict[str, float]:
    """One pass of one library: {phase: instructions per cycle}, of the server if
    `server_counted` (the first phase only: the server's work is the same), else the
    client's."""
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as name:
        workdir = Path(name)
        with _server(workdir, server_counted) as (port, server):
            client = _Client(workdir, port, cycles, library, root, not server_counted)
            counted = server if server_counted else client.process
            try:
                for phase in PHASES:
                    if client.said() != "ready":
                        if phase == PHASES[0]:
                            raise RuntimeError(f"{column}: the client did not start")
                        break  # (a peer: one phase)
                    _control("-z", counted.pid)
                    client.go_on()
                    if client.said() != "done":
                        raise RuntimeError(f"{column}: the client did not finish")
                    if not (server_counted and figures):
                        figures[phase] = _dumped(workdir, counted.pid) / cycles
                    client.go_on()
            finally:
                client.process.wait(120)
    return figures


def instructions_per_cycle(
    clients: list[tuple[str, str, Path]], cycles: int, rounds: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]:
    """For each (column, library, checkout): {"server": ..., "client": ...} per cycle made as
    a user writes it, and for aiolocks "client, one instance": the cycle alone (the client's
    figures the median of `rounds`, the columns alternating); and the client's figures of
    every round. library is "aiolocks", "redis-py" or "python-redis-lock"."""
    counted: dict[str, dict[str, float]] = {}
    rounds_of: dict[str, dict[str, list[float]]] = {}
    for column, library, root in clients:
        server = _counted(column, library, root, cycles, server_counted=True)
        counted[column] = {"server": server[PHASES[0]]}
    runs: dict[str, dict[str, list[float]]] = {column: {} for column, _, _ in clients}
    for round_ in range(rounds):
        for column, library, root in clients if round_ % 2 == 0 else clients[::-1]:
            for phase, value in _counted(column, library, root, cycles, False).items():
                runs[column].setdefault(phase, []).append(value)
    for column, phases in runs.items():
        for phase, values in phases.items():
            figure = "client" if phase == PHASES[0] else f"client, {phase}"
            counted[column][figure] = statistics.median(values)
            rounds_of.setdefault(column, {})[figure] = values
    return counted, rounds_of
