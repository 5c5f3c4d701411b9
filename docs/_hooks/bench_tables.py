"""MkDocs hook: the benchmark page's tables and chart come from `benchmarks/results/`.

A line `<!-- results: NAME -->` in a page becomes tables rendered from
`benchmarks/results/NAME.json` at build time, and `benchmarks/results/peers.png` is
published as `assets/peers.png`, so the page always shows the committed run and nothing
is copied by hand. An unknown NAME, or a results file that is missing, fails the build.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

RESULTS = Path("benchmarks") / "results"
CHARTS = {"assets/peers.png": "peers.png"}  # published path -> file in RESULTS
MARKER = re.compile(r"^<!-- results: ([a-z_]+) -->$", re.M)

Row = Sequence[object]


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish the committed charts beside the pages."""
    for published, name in CHARTS.items():
        source = _root(config) / RESULTS / name
        if not source.is_file():
            raise PluginError(f"bench_tables: {source} is missing")
        files.append(File.generated(config, published, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace every results marker with the tables of that results file."""

    def render(match: re.Match[str]) -> str:
        name = match.group(1)
        renderer = RENDERERS.get(name)
        if renderer is None:
            known = ", ".join(sorted(RENDERERS))
            raise PluginError(f"{page.file.src_uri}: no results named {name!r} (known: {known})")
        path = _root(config) / RESULTS / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PluginError(f"{page.file.src_uri}: cannot read {path}: {exc}") from exc
        return renderer(data)

    return MARKER.sub(render, markdown)


# -- formatting ------------------------------------------------------------------------


def _num(value: object, digits: int = 0) -> str:
    """A figure as the tables show it: thousands separated, `digits` decimals, '-' if none."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:,.{digits}f}"


def _times(value: object) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.2f}x"


def _table(header: Row, rows: Iterable[Row]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def _machine(data: dict[str, Any]) -> str:
    machine = data.get("machine", {})
    load = (
        machine.get("loadavg_1_5_15") or machine.get("loadavg") or machine.get("loadavg_at_start")
    )
    parts = [f"{machine.get('nproc', '?')} CPUs"]
    if machine.get("cpu_model"):
        parts.insert(0, str(machine["cpu_model"]))
    if load:
        parts.append("load average " + " / ".join(f"{x:.1f}" for x in load))
    for key in ("python", "redis_py"):
        if machine.get(key):
            parts.append(("redis-py " if key == "redis_py" else "") + str(machine[key]))
    server = data.get("server", {}).get("version")
    if server:
        parts.append(str(server))
    when = data.get("started_at")
    return ("Run of " + str(when)[:10] + " on " if when else "Run on ") + ", ".join(parts) + "."


# -- one renderer per results file -----------------------------------------------------


def _peers(data: dict[str, Any]) -> str:
    labels: dict[str, str] = data["libraries"]
    results: dict[str, dict[str, Any]] = data["results"]

    def get(workload: str, library: str) -> dict[str, Any]:
        found: dict[str, Any] = results.get(workload, {}).get(library, {})
        return found

    def why_not(entry: dict[str, Any]) -> str:
        return str(entry.get("note") or entry.get("capped") or "-")

    throughput = [
        (
            label,
            _num(get("uncontended", lib).get("cycles_per_s")),
            _num(get("contended", lib).get("acquisitions_per_s")),
            _times(get("contended", lib).get("aiolocks_x")),
            _num(get("processes", lib).get("acquisitions_per_s")),
            _times(get("processes", lib).get("aiolocks_x")),
        )
        for lib, label in labels.items()
    ]
    waits = []
    for lib, label in labels.items():
        contended = get("contended", lib)
        wait = contended.get("wait_ms", {})
        waits.append(
            (
                label,
                _num(wait.get("p50"), 2),
                _num(wait.get("p99"), 2),
                _num(wait.get("max"), 2),
                _num(contended.get("client_commands_per_acquisition"), 2),
                _num(100 * contended["regrab_share"], 1) + "%"
                if "regrab_share" in contended
                else "-",
            )
        )

    def _scale(scale: dict[str, Any]) -> str:
        served, waiters = scale.get("served"), scale.get("waiters")
        if served is None:
            return why_not(scale)
        text = f"{_num(served)} of {_num(waiters)} served"
        if served == waiters:
            return f"{text}, drained in {_num(scale.get('drain_s'), 2)} s"
        errors = [str(error).split("(")[0] for error in scale.get("errors", [])]
        return "; ".join([text, why_not(scale), *errors[:1]])

    others = []
    for lib, label in labels.items():
        waiting, handoff = get("waiting", lib), get("handoff", lib)
        crash, scale = get("crash", lib), get("scale", lib)
        halves = waiting.get("client_commands_by_half")
        latency = handoff.get("latency_ms", {})
        beyond = crash.get("beyond_lease_ms", {}).get("median")
        others.append(
            (
                label,
                _num(waiting.get("client_commands_per_waiter_whole_wait"), 2),
                " then ".join(_num(x) for x in halves) if halves else "-",
                f"{_num(latency.get('p50'), 2)} ({_times(handoff.get('x_evalsha_rtt'))})"
                if latency
                else "-",
                _num(beyond, 1) if beyond is not None else why_not(crash),
                _scale(scale),
            )
        )
    plan = data.get("plan", {})
    return "\n\n".join(
        [
            _machine(data),
            "**Throughput** (acquisitions per second; `aiolocks x` is aiolocks' figure "
            "divided by the row's):",
            _table(
                (
                    "library",
                    "uncontended cycles/s",
                    f"contended, {plan.get('tasks', '?')} tasks",
                    "aiolocks x",
                    f"{plan.get('processes', '?')} processes x "
                    f"{plan.get('tasks_per_process', '?')} tasks",
                    "aiolocks x",
                ),
                throughput,
            ),
            "**Contended, one process**: waits (from calling acquire to its return), lock "
            "commands sent per acquisition, and re-grabs (the releasing task taking the lock "
            "straight back):",
            _table(
                (
                    "library",
                    "wait p50 ms",
                    "wait p99 ms",
                    "wait max ms",
                    "commands/acq",
                    "re-grabs",
                ),
                waits,
            ),
            f"**Waiting, hand-off, crash, scale**: commands per waiter over a whole wait of "
            f"{plan.get('waiters', '?')} waiters, and in the two halves of a "
            f"{plan.get('wait_window_s', '?')} s window; hand-off latency from `release()` in "
            "one process to `acquire()` returning in another (in round trips of a plain "
            "`EVALSHA`); how long after a killed holder's lease ended the next waiter held the "
            "lock; 10,000 waiting tasks over 1,000 names:",
            _table(
                (
                    "library",
                    "commands/waiter",
                    "in the window",
                    "hand-off p50 ms",
                    "crash: ms after lease end",
                    "10,000 waiters",
                ),
                others,
            ),
        ]
    )


def _primitives(data: dict[str, Any]) -> str:
    rows = [
        (
            name,
            _num(row.get("acquisitions_per_s")),
            _num(row.get("wait_ms", {}).get("p50"), 2),
            _num(row.get("wait_ms", {}).get("p99"), 2),
            _num(row.get("engine_commands_per_acquisition"), 2),
            _num(row.get("max_concurrency", row.get("max_readers"))),
        )
        for name, row in data["results"].items()
    ]
    header = ("row", "acquisitions/s", "wait p50 ms", "wait p99 ms", "commands/acq", "most at once")
    return _machine(data) + "\n\n" + _table(header, rows)


def _registry(data: dict[str, Any]) -> str:
    results = data["results"]
    speed = [
        (
            name,
            _num(row["names"]),
            _num(row["registrations_per_s"]),
            _num(row["client_commands"]),
            _num(row["names_per_command"], 1),
        )
        for name, row in results["throughput"].items()
    ]
    doubles = [
        (
            name,
            _num(row["calls"]),
            _num(row["names_given_several_ids"]),
            _num(row["burned_counter_values"]),
            "yes" if row["ids_exactly_1_to_n"] else "no",
        )
        for name, row in results["duplicates"].items()
    ]
    return "\n\n".join(
        [
            _machine(data),
            _table(("row", "names", "names/s", "commands", "names/command"), speed),
            "The same 2,000 names registered by 16 concurrent tasks, each in its own order:",
            _table(
                ("row", "calls", "names given 2+ ids", "ids burned", "ids exactly 1..n"), doubles
            ),
        ]
    )


def _cluster(data: dict[str, Any]) -> str:
    results = data["results"]
    single = {row["names"]: row for row in results["one server"]}
    rows = []
    for row in results["3-node cluster"]:
        alone = single.get(row["names"], {})
        ratio = (
            row["acquisitions_per_s"] / alone["acquisitions_per_s"]
            if alone.get("acquisitions_per_s")
            else None
        )
        exact = row.get("counters_exact") and alone.get("counters_exact")
        rows.append(
            (
                _num(row["names"]),
                _num(alone.get("acquisitions_per_s")),
                _num(row["acquisitions_per_s"]),
                _times(ratio),
                "yes" if exact else "no",
                _num(sum(node.get("spublish_calls", 0) for node in row.get("per_node", []))),
                _num(_bus_messages(row.get("per_node", []))),
            )
        )
    machine = data.get("machine", {})
    header = (
        "names",
        "one server acq/s",
        "3-primary cluster acq/s",
        "cluster / one",
        "counters exact",
        "SPUBLISH calls",
        "cluster bus messages",
    )
    plain = results.get("pubsub", {}).get("plain_publish_x1000_per_node", [])
    return "\n\n".join(
        [
            _machine(data).rstrip(".") + f", {machine.get('kind', 'valkey')} servers.",
            _table(header, rows),
            f"For comparison, 1,000 plain `PUBLISH`es on one node made "
            f"{_num(_bus_messages(plain))} cluster bus messages.",
        ]
    )


def _bus_messages(nodes: list[dict[str, Any]]) -> int:
    """Pub/sub messages the nodes received over the cluster bus."""
    return sum(
        int(node.get("bus_publish_received", 0)) + int(node.get("bus_publishshard_received", 0))
        for node in nodes
    )


def _telemetry(data: dict[str, Any]) -> str:
    modes = list(data["modes"])
    rows = []
    for workload in ("uncontended", "contended"):
        row = data[workload]
        for figure, ratio, label in (
            ("per_second_median", "per_second_ratio_to_none", "cycles/s"),
            ("cpu_us_per_cycle_median", "cpu_ratio_to_none", "client CPU µs per cycle"),
        ):
            cells = [f"{_num(row[figure][m])} ({_times(row[ratio][m])})" for m in modes]
            rows.append((f"{workload}, {label}", *cells))
    return "\n\n".join([_machine(data), _table(("median of rounds", *modes), rows)])


def _optimizations(data: dict[str, Any]) -> str:
    """bench_optimizations.py: one row per optimization and workload, then the verdicts."""

    def rows(table: list[dict[str, Any]]) -> list[Row]:
        out: list[Row] = []
        for row in table:
            p99 = "-"
            if row.get("p99_ms_with") is not None:
                p99 = f"{_num(row['p99_ms_with'], 1)} / {_num(row['p99_ms_without'], 1)}"
            out.append(
                (
                    f"`{row['optimization']}`",
                    data["workloads"][row["workload"]],
                    f"{_num(row['with'], 1)} {row['unit']}",
                    _num(row["without"], 1),
                    _times(row["gain"]),
                    _times(row.get("cpu_gain")),
                    p99,
                )
            )
        return out

    header = ("optimization", "workload", "with", "without", "gain", "CPU gain", "p99 ms")
    repeats = [
        f"{repeat['what']} ({repeat['rounds']} rounds, median shown):\n\n"
        + _table(header, rows(repeat["table"]))
        for repeat in data.get("repeats", [])
    ]
    verdicts = [
        (f"`{name}`", switch["target"], *data["verdicts"].get(name, ("-", "-")))
        for name, switch in data["switches"].items()
    ]
    return "\n\n".join(
        [
            _machine(data)
            + f" {data['rounds']} rounds, median shown; load average at the end "
            + " / ".join(f"{x:.1f}" for x in data.get("loadavg_at_end") or []),
            _table(header, rows(data["table"])),
            *repeats,
            _table(("optimization", "switched by", "kept or removed", "why"), verdicts),
        ]
    )


_SCALE = (
    ("acquire_per_s", "acquisitions/s", 0),
    ("client_cpu_us_per_renewal", "client CPU µs per renewal", 1),
    ("script_calls_per_100_leases_per_period", "script calls per 100 leases per period", 2),
    ("round_trips_per_100_leases_per_period", "round trips per 100 leases per period", 3),
    ("server_bytes_per_lease", "server bytes per lease", 0),
    ("client_bytes_per_lease", "client bytes per lease", 0),
    ("lost", "leases lost", 0),
    ("keys_left_after_idle", "keys left after the idle window", 0),
)


def _scale(data: dict[str, Any]) -> str:
    """bench_scale.py: one column per N, one row per figure; the load average with each."""
    rows_by_n = [row for row in data["rows"] if "error" not in row]
    header = ("figure", *(f"N = {row['n']:,}" for row in rows_by_n))
    rows = [
        (label, *(_num(row.get(key), digits) for row in rows_by_n)) for key, label, digits in _SCALE
    ]
    load = ("load average (1 min) at start", *(_num(r["loadavg_start"][0], 1) for r in rows_by_n))
    parts = [_machine(data), f"{data.get('label') or ''}".strip(), _table(header, [*rows, load])]
    return "\n\n".join(part for part in parts if part)


def _scale_burst(data: dict[str, Any]) -> str:
    """bench_scale.py --burst: one row per build and N (in run order), then the targets."""
    header = (
        "build",
        "N",
        "acquire/s",
        "release/s",
        "release s",
        "unconfirmed",
        "lost",
        "keeper µs/renewal",
        "keeper CPU share",
        "longest stall s (acquire / release)",
        "full GCs s (acquire / release)",
        "load",
    )
    rows: list[Row] = []
    for row in data["rows"]:
        if "error" in row:
            rows.append((row["build"], _num(row["n"]), row["error"], *("-",) * 9))
            continue
        rows.append(
            (
                row["build"],
                _num(row["n"]),
                _num(row["acquire_per_s"]),
                _num(row["release_per_s"]),
                _num(row["release_s"], 2),
                _num(row["unconfirmed"]),
                _num(row["lost"]),
                _num(row["keeper_cpu_us_per_renewal"] if row["keeper_renewals"] else None, 1),
                _num(row["keeper_cpu_share"], 3),
                f"{_num(row['acquire_loop_stall_max_s'], 1)} / "
                f"{_num(row['release_loop_stall_max_s'], 1)}",
                f"{_num(row['acquire_gc_full_s'], 1)} / {_num(row['release_gc_full_s'], 1)}",
                _num(row["loadavg_start"][0], 1),
            )
        )
    targets = [
        (
            build,
            _num(entry.get(next(k for k in entry if k.startswith("acquire_per_s_"))), 2),
            _num(entry.get(next(k for k in entry if k.startswith("release_per_s_"))), 2),
            _num(entry["unconfirmed"]),
            _num(entry["lost"]),
            "yes" if entry["met"] else "no",
        )
        for build, entry in data.get("targets", {}).items()
    ]
    target_header = (
        "build",
        "acquire/s largest ÷ smallest N",
        "release/s largest ÷ smallest N",
        "unconfirmed",
        "lost",
        "targets met",
    )
    parts = [_machine(data), _table(header, rows), _table(target_header, targets)]
    return "\n\n".join(parts)


def _scale_calls(data: dict[str, Any]) -> str:
    header = ("leases per call", "server µs per call", "server µs per lease", "client µs per lease")
    rows = [
        (
            _num(row["leases_per_call"]),
            _num(row["server_us_per_call"], 1),
            _num(row["server_us_per_lease"], 2),
            _num(row["client_cpu_us_per_lease"], 2),
        )
        for row in data["rows"]
    ]
    return "\n\n".join([_machine(data), _table(header, rows)])


def _default_mutex(data: dict[str, Any]) -> str:
    """bench_peers.py --runs 3 over the acquire loops: the first run's figures per library,
    then every target with what each run measured."""
    labels: dict[str, str] = data["libraries"]
    results: dict[str, dict[str, Any]] = data["results"]
    tables = [_machine(data)]
    for workload, title in (
        ("contended", "**Contended, one process** (16 tasks x 50 on one name), first run:"),
        ("processes", "**Contended, 4 processes x 8 tasks**, first run:"),
    ):
        rows: list[Row] = []
        for lib, label in labels.items():
            r = results.get(workload, {}).get(lib)
            if not r:
                continue
            rows.append(
                (
                    label,
                    _num(r.get("acquisitions_per_s")),
                    _num(r.get("x_floor"), 2),
                    _times(r.get("aiolocks_x")),
                    _num(r.get("client_commands_per_acquisition"), 2),
                    _num(r.get("server_commands_per_acquisition"), 1),
                    _num(r.get("client_cpu_ms_per_acquisition"), 3),
                    _num(r.get("server_cpu_ms_per_acquisition"), 3),
                    _num(r.get("mean_hold_ms"), 3),
                    _num((r.get("handoff_ms") or {}).get("mean"), 3),
                    _num(r.get("wait_ms", {}).get("p99"), 1),
                )
            )
        header = (
            "library",
            "acq/s",
            "x floor",
            "aiolocks x",
            "sent/acq",
            "server cmds/acq",
            "client CPU ms/acq",
            "server CPU ms/acq",
            "hold ms",
            "hand-off ms",
            "wait p99 ms",
        )
        tables += [title, _table(header, rows)]
    spread = data.get("spread")
    if spread:
        runs = len(data.get("runs", []))
        tables.append(f"**Targets**, each measured within its run, in {runs} runs:")
        rows = [
            (
                str(entry["target"]),
                " / ".join(entry["measured"]),
                {True: "yes", False: "no", None: "-"}[entry["met_in_all"]],
            )
            for entry in spread
        ]
        tables.append(_table(("target", "run by run", "met in all"), rows))
    return "\n\n".join(tables)


def _cost(data: dict[str, Any]) -> str:
    """bench_cost.py: its own table (rendered by the benchmark), then the targets it checked."""
    rows = [
        (
            column,
            check,
            _times(verdict["ratio"]),
            {True: "yes", False: "no", None: "-"}[verdict["holds"]],
        )
        for column, checks in data["targets"].items()
        for check, verdict in checks.items()
    ]
    took = f"{data['rounds']} rounds, {data['server']['version']}, load average at the end "
    took += " / ".join(map(str, data.get("loadavg_at_end") or []))
    return "\n\n".join(
        [took, data["markdown"], _table(("build", "target", "ratio", "holds"), rows)]
    )


def _cost_instructions(data: dict[str, Any]) -> str:
    """bench_cost.py --instructions: the server's and the client's instructions per
    uncontended cycle (the client's: a mutex made per cycle, and the cycle alone)."""
    counted = data["instructions_per_cycle"]
    prl = counted["python-redis-lock"]
    rows = [
        (
            column,
            _num(figures["server"]),
            _times(figures["server"] / prl["server"]),
            _num(figures.get("client")),
            _num(figures.get("client, one instance")),
        )
        for column, figures in counted.items()
    ]
    header = ("client", "server", "vs python-redis-lock", "client", "client, one instance")
    return f"{data.get('rounds', 1)} rounds (client: the median)\n\n" + _table(header, rows)


def _ratelimit(data: dict[str, Any]) -> str:
    settings = data["settings"]
    rows = [
        (row["label"], row["unavailable"], "", "", "", "", "", "")
        if "unavailable" in row
        else (
            row["label"],
            _num(row["server_us_per_permit"], 1),
            _num(row["commands_per_permit"], 1),
            _num(row["client_us_per_permit"]),
            _num(row["most_in_1s"]),
            _num(row["most_in_100ms"]),
            _num(row["rate_reached"], 1),
            _num(row["commands_while_waiting"]),
        )
        for row in data["rows"]
    ]
    header = (
        "library",
        "server µs / permit",
        "commands / permit",
        "client CPU µs / permit",
        f"most in any 1 s (limit {settings['bound_rate']}/s)",
        "most in any 100 ms",
        "grants / s",
        "commands while waiting ~1 s",
    )
    return _machine(data) + "\n\n" + _table(header, rows)


def _sync(data: dict[str, Any]) -> str:
    """bench_sync.py: each contender's median ops/s over the rounds, 1 and 4 processes."""
    labels: dict[str, str] = data["contenders"]
    cells: dict[str, dict[str, list[dict[str, Any]]]] = data["results"]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    rows = []
    for kind, label in labels.items():
        row: list[object] = [label]
        for processes in ("1", "4"):
            mine = cells.get(processes, {}).get(kind, [])
            base = cells.get(processes, {}).get(data["baseline"], [])
            # Each round's ratio to the baseline's run of the same round (the load drifts).
            ratios = [a["ops"] / b["ops"] for a, b in zip(mine, base, strict=False) if b["ops"]]
            row += [_num(median([run["ops"] for run in mine])), _times(median(ratios))]
        exact = all(run["exact"] for runs in cells.values() for run in runs.get(kind, []))
        row.append("yes" if exact else "NO")
        rows.append(row)
    threads = data.get("args", {}).get("threads", "?")
    header = ("contender", "1 process ops/s", "x python-redis-lock", "4 processes ops/s",
              "x python-redis-lock", "counter exact")  # fmt: skip
    return (
        _machine(data) + f" {threads} threads per process, on one name.\n\n" + _table(header, rows)
    )


def _fastapi(data: dict[str, Any]) -> str:
    """bench_fastapi.py --rounds N: each install's medians per mode and worker count, then
    the ratios the FastAPI page promises, each taken within a round (median over rounds)."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = data["results"]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    rows = [
        (
            label,
            run.replace("/", ", ") + " w",
            _num(median([r["per_s"] for r in rounds])),
            _num(median([r["cpu_us"] for r in rounds if r.get("cpu_us") is not None])),
            _num(median([r["scripts_per_req"] for r in rounds if "scripts_per_req" in r]), 2),
            sum(r["overlaps"] or 0 for r in rounds if r.get("counter_exact") is not None),
        )
        for label, runs in results.items()
        for run, rounds in runs.items()
    ]
    table = _table(
        ("build", "mode, workers", "requests/s", "CPU µs / request", "scripts / request",
         "overlaps"),
        rows,
    )  # fmt: skip
    ratios = (
        ("by hand / asyncio.Lock, 1 worker", "by-hand/1", "floor/1"),
        ("request_lock (wait) / asyncio.Lock, 1 worker", "wait/1", "floor/1"),
        ("request_lock (wait) / by hand, 2 workers", "wait/2", "by-hand/2"),
        ("refuse / redis-py's Lock, 2 workers", "refuse/2", "redis-py/2"),
    )
    ratio_rows = []
    for what, top, bottom in ratios:
        row: list[object] = [what]
        for runs in results.values():
            pairs = zip(runs.get(top, []), runs.get(bottom, []), strict=False)
            row.append(_times(median([a["per_s"] / b["per_s"] for a, b in pairs if b["per_s"]])))
        ratio_rows.append(row)
    took = f"{data['rounds']} rounds of {data['seconds']:g} s, {data['connections']} connections"
    took += f" over {data['orders']} orders, on {data['server']}. "
    took += _machine({**data, "server": {}})
    return "\n\n".join([took, table, _table(("requests/s, per round", *results), ratio_rows)])


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "sync": _sync,
    "fastapi": _fastapi,
    "cost": _cost,
    "cost_instructions": _cost_instructions,
    "default_mutex": _default_mutex,
    "scale": _scale,
    "scale_burst": _scale_burst,
    "scale_calls": _scale_calls,
    "peers": _peers,
    "primitives": _primitives,
    "registry": _registry,
    "ratelimit": _ratelimit,
    "cluster": _cluster,
    "telemetry": _telemetry,
    "optimizations": _optimizations,
    "local_handoff": _peers,  # bench_peers.py --only contended,processes: the same layout
    "uvloop": _peers,  # bench_peers.py --only ...,processes, with the uvloop rows
}
