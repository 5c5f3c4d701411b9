"""Run the simulation: `python -m tests.sim --seed N` replays one seed (its violations and
trace), `--seeds A-B` runs a range (`--jobs N`: N seeds at once), `--minutes M` runs new
seeds for M minutes,
`--scenario NAME` runs one of the scripted scenarios (`--list` names them).

Runs re-execute themselves with PYTHONHASHSEED=0: set iteration order (and so the
schedule) must not change between a failing run and its replay.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ._coverage import measure_child
from ._world import Result


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        args = [sys.executable, "-m", "tests.sim", *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, args, env)
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("--seed", type=int, help="replay one seed, with its trace on failure")
    parser.add_argument("--seeds", help="a range A-B of seeds")
    parser.add_argument("--minutes", type=float, help="run new seeds for this long")
    parser.add_argument("--start", type=int, default=1000, help="first seed for --minutes")
    parser.add_argument("--duration", type=float, default=30.0, help="virtual s of workload")
    parser.add_argument("--scenario", help="run a scripted scenario")
    parser.add_argument("--list", action="store_true", help="list the scenarios")
    parser.add_argument("--all-scenarios", action="store_true", help="run every scenario")
    parser.add_argument("--json", action="store_true", help="results as JSON (scenarios)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once (with --seeds)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failing seed")
    parser.add_argument("--trace", type=int, default=200, help="trace lines shown on failure")
    parser.add_argument("--full-trace", action="store_true", help="print the whole trace")
    options = parser.parse_args(argv)

    from . import _ratelimit, _scenarios  # noqa: F401 (_ratelimit registers its scenario)
    from ._workload import run

    if options.list:
        for name, scenario in _scenarios.SCENARIOS.items():
            print(f"{name}: {(scenario.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if options.scenario or options.all_scenarios:
        names = list(_scenarios.SCENARIOS) if options.all_scenarios else [options.scenario]
        results = {name: isolated_scenario(name) for name in names}
        if options.json:
            print(json.dumps({n: vars(r) for n, r in results.items()}))
            return 1 if any(r.violations for r in results.values()) else 0
        status = 0
        for result in results.values():
            status |= report(result, options, always=not options.all_scenarios)
        return status
    if options.seed is not None:
        seed, duration = options.seed, options.duration
        result = _forked(lambda: run(seed, duration), f"seed {seed}", seed)
        return report(result, options, always=options.full_trace)
    if options.seeds:
        first, _, last = options.seeds.partition("-")
        seeds = iter(range(int(first), int(last or first) + 1))
        stop = float("inf")
    else:
        seeds = iter(range(options.start, 1 << 62))
        stop = time.monotonic() + 60 * (options.minutes or 1.0)
    started, failed, count, virtual = time.monotonic(), [], 0, 0.0
    pool = ThreadPoolExecutor(max(1, options.jobs))  # each seed runs in a forked process
    if options.jobs > 1 and options.seeds:
        ran: Iterator[Result] = pool.map(lambda seed: isolated(seed, options.duration), seeds)
    else:
        running = itertools.takewhile(lambda _: time.monotonic() < stop, seeds)
        ran = (isolated(seed, options.duration) for seed in running)
    for outcome in ran:
        count += 1
        virtual += outcome.virtual
        print(outcome.summary, flush=True)
        if outcome.violations:
            failed.append(outcome.seed)
            for line in outcome.violations[:5]:
                print("    " + line, flush=True)
            if options.fail_fast:
                break
    pool.shutdown(cancel_futures=True)
    wall = time.monotonic() - started
    print(
        f"{count} seeds in {wall:.1f} s wall ({60 * count / wall:.1f} seeds/min), "
        f"{virtual:.0f} virtual s ({virtual / wall:.1f} simulated s per wall s); "
        f"{len(failed)} with violations: {failed}"
    )
    if failed:
        print(f"replay one with: nox -s simulate -- --seed {failed[0]}")
    return 1 if failed else 0


def isolated(seed: int, duration: float) -> Result:
    """Run `seed` in a forked child, so that no state of an earlier run (the engine's
    module-level caches, garbage) changes its schedule: the same as `--seed N`, which runs
    in one too."""
    from ._workload import run

    return _forked(lambda: run(seed, duration, trace=False), f"seed {seed}", seed)


def isolated_scenario(name: str) -> Result:
    from ._scenarios import SCENARIOS

    return _forked(SCENARIOS[name], f"scenario {name}", 0)


def _forked(play: Callable[[], Result], what: str, seed: int) -> Result:
    """Run `play` in a child that ends with `os._exit`: as a killed process would, the tasks
    of the run's crashed processes never run again, not even their clean-up at the
    interpreter's exit (in-process, their `finally` blocks ran then, without a loop, and
    printed "no running event loop")."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _die_with_parent()
        code = 0
        save = measure_child()  # (`python -m tests.sim.branches`: os._exit skips its save)
        try:
            data = pickle.dumps(play())
            with os.fdopen(write, "wb") as out:
                out.write(data)
        except BaseException:
            code = 1
        finally:
            try:
                if save is not None:
                    save()
            finally:
                os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        result = Result(seed)
        result.violations = [f"the run's process failed (status {status})"]
        result.summary = f"{what}: failed"
        return result
    loaded: Result = pickle.loads(data)
    return loaded


def _die_with_parent() -> None:
    """Linux: the run's process ends with the runner (a killed test run leaves none)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def report(result: object, options: argparse.Namespace, always: bool) -> int:
    violations: list[str] = getattr(result, "violations", [])
    print(getattr(result, "summary", ""))
    if violations or always:
        trace: list[str] = getattr(result, "trace", [])
        shown = trace if options.full_trace else trace[len(trace) - options.trace :]
        print(f"--- trace (last {len(shown)} of {len(trace)} lines kept) ---")
        print("\n".join(shown))
    if violations:
        print(f"--- {len(violations)} violation(s), seed {getattr(result, 'seed', '?')} ---")
        print("\n".join(violations))
        return 1
    print("no violations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
