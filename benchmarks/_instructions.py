"""The server's instructions per uncontended cycle, counted by callgrind (bench_cost.py
--instructions).

`INFO cpu` per cycle moves with the machine's other work by more than the differences it
should show (one run saw 1.27x python-redis-lock, a quiet one 1.81x, for the same build);
redis-server run under valgrind's callgrind counts the instructions it executes for the
same client traffic, which no load changes. One redis-server under callgrind; each library
in a client process of its own: warmed up, then the counters zeroed, `cycles` acquire +
release cycles as a user writes them (an aiolocks mutex made per cycle, with each build's
default), then dumped. Network system calls are the kernel's and are not counted.
"""

from __future__ import annotations

import contextlib
import shutil
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

async def asynchronous(cycle):
    import redis.asyncio
    client = redis.asyncio.Redis(port=port)
    for _ in range(200):
        await cycle(client)
    print("ready", flush=True); sys.stdin.readline()
    for _ in range(cycles):
        await cycle(client)
    print("done", flush=True); sys.stdin.readline()
    await client.aclose()

async def aiolocks_cycle(client):
    from aiolocks import RedisMutex
    async with RedisMutex(client, NAME, ttl=30):
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
    print("ready", flush=True); sys.stdin.readline()
    for _ in range(cycles):
        cycle()
    print("done", flush=True); sys.stdin.readline()

if library == "aiolocks":
    asyncio.run(asynchronous(aiolocks_cycle))
elif library == "redis-py":
    asyncio.run(asynchronous(redispy_cycle))
else:
    python_redis_lock()
"""


@contextlib.contextmanager
def _server_under_callgrind(workdir: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    valgrind, server = shutil.which("valgrind"), shutil.which("redis-server")
    if valgrind is None or server is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind), redis-server")
    port = free_loopback_port()
    process = subprocess.Popen(
        [valgrind, "--tool=callgrind", f"--callgrind-out-file={workdir}/out.%p", server,
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
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


def _dumped(workdir: Path, pid: int) -> int:
    """Dump callgrind's counters (since the last zeroing) and read their total."""
    before = set(workdir.glob("out.*"))
    subprocess.run(
        ["callgrind_control", "-d", str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    dumps = sorted(set(workdir.glob("out.*")) - before, key=lambda path: path.stat().st_mtime)
    dump = dumps[-1]
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def instructions_per_cycle(clients: list[tuple[str, str, Path]], cycles: int) -> dict[str, float]:
    """{column: server instructions per cycle} for each (column, library, checkout); library
    is "aiolocks", "redis-py" or "python-redis-lock"."""
    counted: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as name:
        workdir = Path(name)
        with _server_under_callgrind(workdir) as (port, server):
            for column, library, root in clients:
                client = subprocess.Popen(
                    [sys.executable, "-c", _CLIENT, str(root), str(port), str(cycles), library],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert client.stdin is not None and client.stdout is not None
                try:
                    if client.stdout.readline().strip() != "ready":
                        raise RuntimeError(f"{column}: the client did not start")
                    subprocess.run(
                        ["callgrind_control", "-z", str(server.pid)],
                        check=True,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    client.stdin.write("\n")
                    client.stdin.flush()
                    if client.stdout.readline().strip() != "done":
                        raise RuntimeError(f"{column}: the client did not finish")
                    counted[column] = _dumped(workdir, server.pid) / cycles
                    client.stdin.write("\n")
                    client.stdin.flush()
                finally:
                    client.wait(30)
    return counted
