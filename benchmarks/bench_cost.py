"""What one lock operation costs on the server and in the client, beside the peers (issues 32, 45).

    python benchmarks/bench_cost.py [--tree PATH:LABEL ...] [--label TEXT] [--rounds 1]
        [--cycles 2000] [--iterations 50] [--local-handoff 0,4,16] [--json PATH]

One run, on one `redis-server` (Debian's, on PATH) started here on a free 127.0.0.1 port,
for aiolocks' `RedisMutex` (this checkout, and the checkout of each `--tree`: the same
workload with another build's aiolocks, e.g. `git worktree add /tmp/base cf90146`; with
`--local-handoff 0,4,16`, also this checkout's mutex with `local_handoff=0` (strict FIFO),
`=4` and `=16`; each build's column names its default mutex: an older tree's, such as
785f6d6's, is strict FIFO, this one's `local_handoff=16`),
redis-py's asyncio `Lock` (sleep=0.1) and python-redis-lock (blocking: one thread per
worker, as in `bench_peers.py`), three phases each, every one in fresh worker processes of
`bench_peers.py` (`--worker`, the same contend loop) started together on one 'go':

- `uncontended`: one process, one task, `--cycles` x (acquire, release);
- `1x16`: one process x 16 tasks (threads), `--iterations` each, one name, a GET and a SET+1
  of a counter inside (the counter must come out exact);
- `4x4`: 4 processes x 4 tasks (threads), the same.

Per phase: the server's µs and commands per cycle (uncontended) or per acquisition
(contended), from `INFO commandstats` read before and after (the `usec` and `calls` of every
command summed: a script's `usec` includes its inner commands' time, and those are counted
again under their own names, as the issue measures it; the workload's GET and SET are
taken out, at their mean cost measured first on the same server); the server process's
CPU time per cycle or acquisition (`INFO cpu`, user + system: its network I/O included,
and, contended, the workload's GET and SET too; unlike `usec`, not inflated when the
machine's other work takes the server's core); the client's CPU µs per acquisition
(`time.process_time` inside each worker, all its threads, from its 'go' to its last
release, summed over the workers); acquisitions per second; the counter. Builds and
libraries alternate round by round; a µs figure is the lowest of the rounds, the others
the median. Then, for each aiolocks column, issue 45's targets as ratios to python-redis-lock
in the same run: server CPU (`INFO cpu`) per uncontended cycle and per contended acquisition at
most 1.0x, client CPU per contended acquisition at 4x4 at most 1.0x, throughput at 1x16 and 4x4
at least 1.2x. Results in `results/cost.json`.

With `--instructions`, instead: the server's and the client's instructions per uncontended
cycle, counted by callgrind (`_instructions.py`; needs valgrind), for each build and the two
peers, which the machine's load does not move as it moves `INFO cpu` and the client's CPU
time; for aiolocks, the client's count of a mutex made per cycle (as users write it) and of
the cycle alone (one instance). Results in `results/cost_instructions.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import RESULTS, fmt, loadavg, machine, ratio, server_calls, server_info, write_json
from _instructions import instructions_per_cycle
from bench_peers import contend_in_workers
from bench_scale import redis_server, trees

from aiolocks import __version__

HERE = Path(__file__).resolve().parent
REDISPY = "redispy_sleep_0.1"
PRL = "python_redis_lock"
LOCAL = {0: "aiolocks_fifo", 4: "aiolocks_local4", 16: "aiolocks_local16"}  # local_handoff=N
PHASES = {  # name: (processes, tasks per process, critical section)
    "uncontended": (1, 1, False),
    "1x16": (1, 16, True),
    "4x4": (4, 4, True),
}
METRICS = {  # field: (row label, digits)
    "server_us": ("server µs", 1),
    "server_cpu_us": ("server CPU µs", 1),
    "server_commands": ("server commands", 1),
    "client_cpu_us": ("client CPU µs", 0),
    "per_s": ("per second", 0),
}


async def workload_usec(url: str, pairs: int = 2000) -> float:
    """The server's mean µs for one GET plus one SET of the counter (the critical section),
    to take out of the contended phases' totals."""
    admin = redis.asyncio.Redis.from_url(url)
    try:
        before = await server_calls(admin)
        for i in range(pairs):
            await admin.get("bench:calibrate")
            await admin.set("bench:calibrate", i)
        after = await server_calls(admin)
        await admin.delete("bench:calibrate")
    finally:
        await admin.aclose()
    return sum((after[1][name] - before[1][name]) / pairs for name in ("get", "set"))


async def phase(
    url: str, peer: str, root: Path, name: str, cycles: int, iterations: int, get_set_us: float
) -> dict[str, Any]:
    """One phase of one library (with the aiolocks under `root`): its figures per acquisition."""
    processes, tasks, critical = PHASES[name]
    count = cycles if not critical else iterations
    specs = [
        {
            "role": "contend",
            "peer": peer,
            "url": url,
            "tasks": tasks,
            "iterations": count,
            "critical": critical,
            "warmup": 50,
            "cap": 120.0,
            "prefix": f"p{i}:",
        }
        for i in range(processes)
    ]
    result, _ = await contend_in_workers(url, specs, processes * tasks * count, 120.0, root)
    n = result["acquisitions"]
    usec = sum(result["commands"]["server_usec_by_command"].values())
    lock_usec = usec - result["increments_done"] * get_set_us
    return {
        "acquisitions": n,
        "server_us": round(lock_usec / n, 2) if n else None,
        "server_cpu_us": round(result["server_cpu_ms_per_acquisition"] * 1000, 1) if n else None,
        "server_commands": result["server_commands_per_acquisition"],
        "client_cpu_us": round(result["client_cpu_ms_per_acquisition"] * 1000, 1) if n else None,
        "per_s": result["acquisitions_per_s"],
        "counter": result.get("counter"),
        "counter_exact": result.get("counter_exact") if critical else None,
        "errors": result["errors"],
        "server_by_command": result["commands"]["server_by_command"],
    }


def of_rounds(rows: list[dict[str, Any]], field: str) -> float | None:
    """A figure over the rounds: the lowest for µs (load from other work on the machine only
    adds to them), the median for the rest."""
    values: list[float] = [row[field] for row in rows if row.get(field) is not None]
    if not values:
        return None
    return round(min(values) if field.endswith("_us") else statistics.median(values), 2)


def render(columns: list[str], table: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A Markdown table: a row per phase and figure, a column per library, then ratios of the
    first column to redis-py's uncontended cycle and to python-redis-lock's same figure."""
    head = ["phase", "figure", *columns, f"{columns[0]} / python-redis-lock"]
    if len(columns) > 3:
        head.append(f"{columns[0]} / {columns[1]}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in PHASES:
        for field, (label, digits) in METRICS.items():
            cells = [table[column][name].get(field) for column in columns]
            prl = table["python-redis-lock"][name].get(field)
            row = [name, label, *(fmt(cell, digits) for cell in cells)]
            row.append(fmt(ratio(cells[0], prl), 2) + "x")
            if len(columns) > 3:
                row.append(fmt(ratio(cells[0], cells[1]), 2) + "x")
            lines.append("| " + " | ".join(row) + " |")
        exact = [table[column][name].get("counter_exact") for column in columns]
        if any(value is not None for value in exact):
            lines.append("| " + " | ".join([name, "counter exact", *map(fmt, exact)]) + " | |")
    return "\n".join(lines)


def headline(columns: list[str], table: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The headline server figure: the server's CPU time (`INFO cpu`) per uncontended cycle
    and per contended acquisition, each column with its ratio to redis-py's `Lock` (no FIFO,
    no fences) and to python-redis-lock in the same run."""
    lines = ["server CPU (INFO cpu) per cycle (uncontended) or acquisition (contended):"]
    for name in PHASES:
        redispy = table["redis-py Lock"][name].get("server_cpu_us")
        prl = table["python-redis-lock"][name].get("server_cpu_us")
        for column in columns:
            value = table[column][name].get("server_cpu_us")
            lines.append(
                f"  {name:<11} {column:<48} {fmt(value, 1):>8} µs  "
                f"{fmt(ratio(value, redispy), 2)}x redis-py Lock, "
                f"{fmt(ratio(value, prl), 2)}x python-redis-lock"
            )
    return "\n".join(lines)


def targets(ours: dict[str, dict[str, Any]], table: dict[str, Any]) -> dict[str, Any]:
    """Issue 45's targets for one build, as ratios to python-redis-lock's figures in the same
    run (the value and whether it holds); server cost is the server's CPU (`INFO cpu`)."""
    prl = table["python-redis-lock"]

    def versus(phase: str, field: str) -> float | None:
        return ratio(ours[phase][field], prl[phase][field])

    checks = {
        "server CPU per uncontended cycle <= 1.0x python-redis-lock's": (
            versus("uncontended", "server_cpu_us"),
            1.0,
            "le",
        ),
        "server CPU per contended acquisition (1x16) <= 1.0x python-redis-lock's": (
            versus("1x16", "server_cpu_us"),
            1.0,
            "le",
        ),
        "server CPU per contended acquisition (4x4) <= 1.0x python-redis-lock's": (
            versus("4x4", "server_cpu_us"),
            1.0,
            "le",
        ),
        "client CPU per contended acquisition (4x4) <= 1.0x python-redis-lock's": (
            versus("4x4", "client_cpu_us"),
            1.0,
            "le",
        ),
        "throughput 1x16 >= 1.2x python-redis-lock's": (versus("1x16", "per_s"), 1.2, "ge"),
        "throughput 4x4 >= 1.2x python-redis-lock's": (versus("4x4", "per_s"), 1.2, "ge"),
    }
    return {
        name: {
            "ratio": value,
            "holds": None
            if value is None
            else (value <= target if way == "le" else value >= target),
        }
        for name, (value, target, way) in checks.items()
    }


def default_config(root: Path) -> str:
    """What `RedisMutex(client, name)` is in the aiolocks of the checkout at `root`: strict
    FIFO (an older tree's default, `local_handoff=0`) or its default local hand-off."""
    code = (
        "import inspect, aiolocks.mutex as m\n"
        "p = inspect.signature(m.RedisMutex).parameters.get('local_handoff')\n"
        "d = 0 if p is None else p.default\n"
        "print(getattr(m, 'DEFAULT_LOCAL_HANDOFF', 0) if d is None else d)"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    found = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    local_handoff = int(found.stdout.strip())
    return "strict FIFO" if local_handoff == 0 else f"local_handoff={local_handoff}"


def instructions(args: argparse.Namespace) -> None:
    """The server's and the client's instructions per uncontended cycle of each build and
    peer, side by side, with ratios to the first build's."""
    clients = [
        (f"aiolocks {label} (default: {default_config(root)})", "aiolocks", root)
        for label, root in trees(args)
    ]
    clients += [("redis-py Lock", "redis-py", HERE.parent)]
    clients += [("python-redis-lock", "python-redis-lock", HERE.parent)]
    counted, rounds_of = instructions_per_cycle(clients, args.cycles, args.rounds)
    first, mine = counted[clients[0][0]], clients[0][0]
    print("instructions per uncontended cycle (callgrind):")
    for figure in ("server", "client", "client, one instance"):
        print(f"  {figure}:")
        for column, figures in counted.items():
            value = figures.get(figure)
            if value is not None:
                versus = "" if column == mine else f"  {mine} is {ratio(first[figure], value):.3f}x"
                print(f"    {column:<48} {value:>10,.0f}{versus}")
    path = Path(args.json) if args.json else RESULTS / "cost_instructions.json"
    report = {
        "benchmark": "cost_instructions",
        "aiolocks": __version__,
        "machine": machine(),
        "cycles": args.cycles,
        "rounds": args.rounds,
        "instructions_per_cycle": {
            column: {figure: round(value) for figure, value in figures.items()}
            for column, figures in counted.items()
        },
        "client_rounds": {
            column: {figure: [round(value) for value in values] for figure, values in runs.items()}
            for column, runs in rounds_of.items()
        },
    }
    write_json(path, report)
    print(f"wrote {path}")


async def main(args: argparse.Namespace) -> None:
    builds = trees(args)
    # Each build's default, named: an older tree's default mutex is strict FIFO.
    libraries = [
        (f"aiolocks {label} (default: {default_config(root)})", "aiolocks", root)
        for label, root in builds
    ]
    for count in args.local_handoff:  # issue 32, item 5: a local hand-off of N at most
        libraries.append((f"aiolocks local_handoff={count}", LOCAL[count], HERE.parent))
    ours = len(libraries)
    libraries += [("redis-py Lock", REDISPY, HERE.parent), ("python-redis-lock", PRL, HERE.parent)]
    columns = [column for column, _, _ in libraries]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {c: {p: [] for p in PHASES} for c in columns}
    began = time.monotonic()
    with redis_server() as (url, source):
        server = {**await server_info(url), "source": source}
        get_set_us = await workload_usec(url)
        for round_ in range(args.rounds):
            for name in PHASES:
                order = libraries if round_ % 2 == 0 else libraries[::-1]
                for column, peer, root in order:
                    figures = await phase(
                        url, peer, root, name, args.cycles, args.iterations, get_set_us
                    )
                    rows[column][name].append(figures)
                    shown = {k: figures[k] for k in (*METRICS, "counter_exact", "errors")}
                    print(f"round {round_} {name:<11} {column:<22} {shown}", flush=True)
    table = {
        column: {
            name: {
                **{field: of_rounds(runs, field) for field in METRICS},
                "counter_exact": None
                if runs[0]["counter_exact"] is None
                else all(run["counter_exact"] for run in runs),
            }
            for name, runs in phases.items()
        }
        for column, phases in rows.items()
    }
    markdown = render(columns, table)
    server_cpu = headline(columns, table)
    report = {
        "benchmark": "cost",
        "aiolocks": __version__,
        "builds": {label: str(root) for label, root in builds},
        "machine": machine(),
        "loadavg_at_end": loadavg(),
        "server": server,
        "workload_get_set_us": round(get_set_us, 3),
        "rounds": args.rounds,
        "cycles": args.cycles,
        "iterations": args.iterations,
        "took_s": round(time.monotonic() - began, 1),
        "table": table,
        "targets": {column: targets(table[column], table) for column in columns[:ours]},
        "runs": rows,
        "markdown": markdown,
        "headline": server_cpu,
    }
    path = Path(args.json) if args.json else RESULTS / "cost.json"
    write_json(path, report)
    print(markdown)
    print(f"\n{server_cpu}")
    for column, checks in report["targets"].items():
        print(f"\ntargets, {column}:")
        for check, verdict in checks.items():
            print(f"  {check}: {fmt(verdict['ratio'])}x {fmt(verdict['holds'])}")
    print(f"wrote {path}")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="PATH[:LABEL] of another checkout")
    parser.add_argument("--label", default="", help="this checkout's label (default: this tree)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every phase, alternating")
    parser.add_argument("--cycles", type=int, default=2000, help="uncontended cycles")
    parser.add_argument("--iterations", type=int, default=50, help="per contending task")
    parser.add_argument(
        "--local-handoff",
        type=lambda text: [int(count) for count in text.split(",")],
        default=[],
        help="also this build with local_handoff=N, for each N given (0,4,16)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instead: server and client instructions per uncontended cycle (callgrind)",
    )
    parser.add_argument("--json", help=f"default {RESULTS / 'cost.json'}")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    if arguments.instructions:
        instructions(arguments)
    else:
        asyncio.run(main(arguments))
