"""The noxfile's groups are derived, and so nothing is left out: every test file runs in the
compatibility cells unless named as not depending on the client, every benchmark script runs
in `nox -s bench`, and the docs name only scripts that exist."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
try:
    import noxfile
finally:
    sys.path.remove(str(ROOT))

TEST_FILES = {path.name for path in (ROOT / "tests").glob("test_*.py")}


def test_every_test_file_runs_in_the_compatibility_cells_or_is_named_out() -> None:
    in_cells = {Path(name).name for name in noxfile.compat_tests()}
    assert in_cells | noxfile.NOT_PER_CLIENT == TEST_FILES
    assert not in_cells & noxfile.NOT_PER_CLIENT
    # A name left out must be a test file: a renamed or removed one is not silently dropped.
    assert noxfile.NOT_PER_CLIENT <= TEST_FILES, noxfile.NOT_PER_CLIENT - TEST_FILES


def test_the_tests_session_collects_every_test_file() -> None:
    """`nox -s tests` runs pytest with no file list: pyproject's testpaths is tests/ and
    pytest's default pattern collects every test_*.py there."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'testpaths = ["tests"]' in pyproject
    assert "python_files" not in pyproject


def test_every_benchmark_runs_in_the_bench_session_and_is_listed() -> None:
    scripts = {path.name for path in noxfile.bench_scripts()}
    assert scripts == {path.name for path in (ROOT / "benchmarks").glob("bench_*.py")}
    table = (ROOT / "benchmarks" / "README.md").read_text()
    for script in sorted(scripts):
        assert f"| `{script}`" in table, f"{script} is not in benchmarks/README.md's table"


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "benchmarks/README.md",
        *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
    ],
)
def test_the_docs_name_only_benchmark_scripts_that_exist(doc: str) -> None:
    named = set(re.findall(r"\b(bench_[a-z_]+\.py|files_entered\.py)", (ROOT / doc).read_text()))
    missing = {name for name in named if not (ROOT / "benchmarks" / name).exists()}
    assert not missing, f"{doc} names {sorted(missing)}, not in benchmarks/"
