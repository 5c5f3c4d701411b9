"""Branch coverage of the engine under CI's simulation: `python -m tests.sim.branches`
(`nox -s simcoverage`).

Runs what `tests/test_sim.py` runs (every scenario, CI's seeds, the seeds that found a
bug), each seed and scenario measured in its own forked process (`_coverage`), adds the
import of every `aiolocks` module (its top-level lines: the runs' processes are forked
from a parent that imported them before measuring), and prints the branch coverage of
the engine's files, then each branch of the cohort, the release and the lease keeper that
no run took (`--files` widens or narrows that list; `--quick` runs the scenarios only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The files whose every branch the simulation should take (issue 45), then the rest shown.
DETAILED = (
    "aiolocks/_engine/_leasedlock.py",  # (the cohort, in the module of the lock it serves)
    "aiolocks/_engine/_release.py",
    "aiolocks/_leases/_keeper.py",
)
SHOWN = ("aiolocks/_engine/*", "aiolocks/_leases/*", "aiolocks/_waiting/*", "aiolocks/mutex.py")


def runs(quick: bool) -> list[list[str]]:
    """The simulator's command lines CI runs (tests/test_sim.py), each forking its runs."""
    ci = importlib.import_module("tests.test_sim")  # (by name: a test module, not a package's)
    commands = [["--all-scenarios", "--json"]]
    if not quick:
        commands.append(["--seeds", ci.CI_SEEDS, "--duration", ci.CI_DURATION])
        commands.extend(["--seeds", seed, "--duration", ci.CI_DURATION] for seed in ci.FOUND_SEEDS)
    return commands


def measure_imports(data: Path) -> None:
    """Import every aiolocks module under measurement (in a fresh process, so that nothing
    was imported before): the top-level lines the runs' forked processes never execute."""
    code = (
        "import coverage, sys; c = coverage.Coverage(data_file=sys.argv[1], data_suffix='imports',"
        " branch=True, source=['aiolocks'], config_file=False); c.start();"
        " import tests.sim.branches as b; b.import_all(); c.stop(); c.save()"
    )
    subprocess.run([sys.executable, "-c", code, str(data / ".coverage")], cwd=ROOT, check=True)


def import_all() -> None:
    import aiolocks

    for module in pkgutil.walk_packages(aiolocks.__path__, "aiolocks."):
        if module.name.endswith(".__main__"):
            continue  # (the command line: it would run)
        with contextlib.suppress(ImportError):  # (an extra's module, its package missing)
            importlib.import_module(module.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.branches")
    parser.add_argument("--quick", action="store_true", help="the scenarios only")
    parser.add_argument("--files", nargs="*", default=list(DETAILED), help="list their misses")
    options = parser.parse_args(argv)
    import coverage

    with tempfile.TemporaryDirectory(prefix="aiolocks-simcoverage-") as tmp:
        data = Path(tmp)
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT))
        env["AIOLOCKS_SIM_COVERAGE"] = str(data)
        failed = 0
        for args in runs(options.quick):
            print(f"python -m tests.sim {' '.join(args)}", flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "tests.sim", *args],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0:
                failed += 1
                print(f"  exit status {done.returncode} (violations?):\n{done.stdout[-2000:]}")
        measure_imports(data)
        combined = coverage.Coverage(data_file=str(data / ".coverage"), config_file=False)
        combined.combine([str(data)], keep=False)
        combined.save()
        combined.load()
        print()
        combined.report(include=[str(ROOT / pattern) for pattern in SHOWN], show_missing=False)
        report = data / "report.json"
        combined.json_report(
            outfile=str(report), include=[str(ROOT / name) for name in options.files]
        )
        files = json.loads(report.read_text(encoding="utf-8"))["files"]
        for name in options.files:
            print(f"\n{name}: branches no run took (line -> line; a negative line: the exit)")
            found = files.get(name) or files.get(str(ROOT / name)) or {}
            lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
            for source, target in found.get("missing_branches", []):
                print(f"  {source:4} -> {target:4}  {lines[source - 1].strip()[:80]}")
            for line in found.get("missing_lines", []):
                print(f"  {line:4} not run  {lines[line - 1].strip()[:80]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
