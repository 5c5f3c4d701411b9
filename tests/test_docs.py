"""The docs site builds (`mkdocs build --strict`) and every ```python block of docs/ runs.

The snippet convention (all of docs/**/*.md): a ```python block is a self-contained
program that connects to `redis://localhost:6379`; it is run in a subprocess with that URL
replaced by a test server's and must exit 0 with nothing on stderr. A ```text block right
after it is its expected stdout, matched as written except that `<n>` matches any integer.
Snippets run a few at a time, each on its own (flushed) logical database of one server,
so concurrent snippets never see each other's keys; one that creates an ACL user runs on
database 0, since such a user may not be allowed `SELECT`.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from _servers import ServerProcess

import aiolocks
from aiolocks import RedisMutex

# The site's build and every page's snippets: not in the quick loop (`-m "not slow ..."`).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LOCAL_URL = "redis://localhost:6379"
PYTHON = frozenset({"python", "py", "python3"})
PARALLEL = 4  # snippets running at once, each on a database of its own
SNIPPET_TIMEOUT = 60.0
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
# mkdocs-material prints a notice about its successor on every build; not our output.
QUIET = {"NO_MKDOCS_2_WARNING": "1"}


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, first line (1-based) and text."""

    page: Path
    line: int
    language: str
    code: str


@dataclass(frozen=True)
class Snippet:
    """A ```python block and the ```text block right after it, if any."""

    block: Block
    expected: str | None

    @property
    def where(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.block.line}"


def fenced_blocks(page: Path, text: str) -> Iterator[Block]:
    """Every fenced block of `text`, indented ones (in lists, admonitions, tabs) included."""
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^{re.escape(indent)}{fence[0]}{{{len(fence)},}}[ \t]*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{index + 1}: a fenced block is never closed")
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        language = opening["info"].split(maxsplit=1)[0].lower() if opening["info"].strip() else ""
        yield Block(page, index + 1, language, "\n".join(body) + "\n" if body else "")
        index = end + 1


def page_snippets(page: Path, text: str) -> list[Snippet]:
    """The runnable snippets of one page, each with its expected output."""
    blocks = list(fenced_blocks(page, text))
    lines = text.splitlines()
    found = []
    for position, block in enumerate(blocks):
        if block.language in ("pycon", "pyi", "ipython"):
            raise AssertionError(
                f"{page}:{block.line}: ```{block.language} blocks are not run; write a "
                "```python program (or a ```text block if it is not code)"
            )
        if block.language not in PYTHON:
            continue
        expected = None
        following = blocks[position + 1] if position + 1 < len(blocks) else None
        if following is not None and following.language == "text":
            closed_at = _closing_line(block)
            between = lines[closed_at + 1 : following.line - 1]
            if all(not line.strip() for line in between):
                expected = following.code
        found.append(Snippet(block, expected))
    return found


def _closing_line(block: Block) -> int:
    """Index (0-based) of the line that closes `block`."""
    return block.line + block.code.count("\n")


def check_runnable(snippet: Snippet) -> None:
    """A ```python block must be a program that does something when run, not a fragment."""
    where = snippet.where
    try:
        tree = ast.parse(snippet.block.code, filename=where)
    except SyntaxError as exc:
        raise AssertionError(f"{where}: not valid Python: {exc}") from None
    runs = any(_runs_something(statement) for statement in tree.body)
    if not runs:
        raise AssertionError(
            f"{where}: this ```python block defines things but runs nothing, so it cannot "
            "be tested; make it a program (end with asyncio.run(main())) or, if it is not "
            "code, use another fence"
        )


def _runs_something(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Expr) and isinstance(statement.value, (ast.Call, ast.Await)):
        return True
    if isinstance(statement, ast.Raise):
        return True  # e.g. raise SystemExit(pytest.main([...]))
    if isinstance(statement, ast.If):  # if __name__ == "__main__": ...
        return any(_runs_something(inner) for inner in statement.body)
    return False


def expected_pattern(expected: str) -> str:
    """A regular expression for an expected output: literal, `<n>` = any integer."""
    return r"-?\d+".join(re.escape(part) for part in expected.split("<n>"))


def docs_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def all_snippets() -> list[Snippet]:
    return [snippet for page in docs_pages() for snippet in page_snippets(page, page.read_text())]


# -- the parser itself -----------------------------------------------------------------


def test_the_parser_pairs_programs_with_their_output() -> None:
    text = (
        "Intro.\n\n```python\nprint(1)\n```\n\n```text\n<n>\n```\n\n"
        "- item\n\n    ```python\n    print('indented')\n    ```\n\nProse.\n\n"
        "```text\nnot an output: prose comes between\n```\n"
    )
    snippets = page_snippets(DOCS / "x.md", text)
    assert [(s.block.line, s.block.code, s.expected) for s in snippets] == [
        (3, "print(1)\n", "<n>\n"),
        (13, "print('indented')\n", None),
    ]


def test_a_fragment_that_runs_nothing_is_refused() -> None:
    fragment = Snippet(Block(DOCS / "x.md", 1, "python", "import asyncio\nx = 1\n"), None)
    with pytest.raises(AssertionError, match="runs nothing"):
        check_runnable(fragment)
    check_runnable(Snippet(Block(DOCS / "x.md", 1, "python", "asyncio.run(main())\n"), None))
    with pytest.raises(AssertionError, match="not run"):
        page_snippets(DOCS / "x.md", "```pycon\n>>> 1\n```\n")


def test_n_matches_integers_only() -> None:
    pattern = expected_pattern("fence <n> (x+1)\n")
    assert re.fullmatch(pattern, "fence 42 (x+1)\n")
    assert re.fullmatch(pattern, "fence -3 (x+1)\n")
    assert not re.fullmatch(pattern, "fence 4.2 (x+1)\n")
    assert not re.fullmatch(pattern, "fence n (x+1)\n")
    assert not re.fullmatch(pattern, "fence 42 (xx1)\n")


# -- every snippet runs ------------------------------------------------------------------


def test_every_page_snippet_is_found() -> None:
    """The parser finds every ```python fence a plain text search finds (nothing hides)."""
    for page in docs_pages():
        text = page.read_text()
        fences = len(re.findall(r"^[ \t]*(?:`{3,}|~{3,})[ \t]*(?:python|py|python3)\b", text, re.M))
        assert len(page_snippets(page, text)) == fences, page


class Databases:
    """Lends each running snippet a logical database of its own; database 0 only to the
    snippets that need it (those that create an ACL user)."""

    def __init__(self, others: int) -> None:
        self._free = set(range(others + 1))
        self._changed = threading.Condition()

    @contextmanager
    def lend(self, zero: bool) -> Iterator[int]:
        def ready() -> bool:
            return 0 in self._free if zero else bool(self._free - {0})

        with self._changed:
            if not self._changed.wait_for(ready, timeout=4 * SNIPPET_TIMEOUT):
                raise AssertionError("no database came free (a snippet run is stuck)")
            db = 0 if zero else min(self._free - {0})
            self._free.remove(db)
        try:
            yield db
        finally:
            with self._changed:
                self._free.add(db)
                self._changed.notify_all()


@contextmanager
def _flushed(url: str) -> Iterator[str]:
    """`url`'s database, emptied before and after (other tests use database 0 too)."""
    with redis.Redis.from_url(url) as admin:
        admin.flushdb()
        try:
            yield url
        finally:
            admin.flushdb()


def _run(snippet: Snippet, base_url: str, databases: Databases, tmp: Path) -> str | None:
    """Run one snippet on a database of its own; None if it behaved, else what went wrong."""
    check_runnable(snippet)
    with (
        databases.lend(zero="ACL SETUSER" in snippet.block.code) as db,
        _flushed(f"{base_url}/{db}") as url,
    ):
        code = snippet.block.code.replace(LOCAL_URL, url)
        script = tmp / (re.sub(r"\W", "_", snippet.where) + ".py")
        script.write_text(code)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        try:
            done = subprocess.run(
                [sys.executable, "-W", "error", str(script)],
                capture_output=True,
                text=True,
                timeout=SNIPPET_TIMEOUT,
                cwd=tmp,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"{snippet.where}: still running after {SNIPPET_TIMEOUT:g} s"
    problems = []
    if done.returncode != 0:
        problems.append(f"exit status {done.returncode}")
    if done.stderr:
        problems.append("stderr:\n" + done.stderr)
    if snippet.expected is not None and not re.fullmatch(
        expected_pattern(snippet.expected), done.stdout
    ):
        problems.append(f"stdout:\n{done.stdout}expected:\n{snippet.expected}")
    if not problems:
        return None
    return f"{snippet.where}: " + "\n".join(problems)


def test_every_python_snippet_runs(valkey_notify: ServerProcess, tmp_path: Path) -> None:
    snippets = all_snippets()
    assert snippets, "no ```python block found under docs/"
    base_url = valkey_notify.url.rsplit("/", 1)[0]
    databases = Databases(PARALLEL)
    with ThreadPoolExecutor(PARALLEL) as pool:
        outcomes = list(
            pool.map(lambda snippet: _run(snippet, base_url, databases, tmp_path), snippets)
        )
    failures = [outcome for outcome in outcomes if outcome is not None]
    assert not failures, f"{len(failures)} of {len(snippets)} snippets failed:\n\n" + "\n\n".join(
        failures
    )


# -- the site builds ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with `mkdocs build --strict`."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **QUIET},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_the_site_builds_with_its_pages(site: Path) -> None:
    for page in docs_pages():
        relative = page.relative_to(DOCS)
        if relative.parts[0].startswith("_"):
            continue
        html = site / relative.with_suffix("") / "index.html"
        if relative.name == "index.md":
            html = site / relative.parent / "index.html"
        assert html.is_file(), f"{relative} was not built"


def test_the_home_tables_first_column_stays_on_one_line(site: Path) -> None:
    """`RedisReadWriteLock` in the home page's table was broken in two at 1280 px."""
    home = (site / "index.html").read_text()
    assert 'href="stylesheets/extra.css"' in home
    css = " ".join((site / "stylesheets" / "extra.css").read_text().split())
    assert "table:not([class]) td:first-child code { white-space: nowrap; }" in css
    assert '<td><a href="rwlock/"><code>RedisReadWriteLock</code></a></td>' in home


def test_the_api_reference_comes_from_the_docstrings(site: Path) -> None:
    reference = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    for name in aiolocks.__all__:
        assert f'id="aiolocks.{name}"' in reference, f"aiolocks.{name} is not in the reference"
    mutex = (site / "reference" / "mutex" / "index.html").read_text()
    for member in (RedisMutex.acquire, RedisMutex.release, RedisMutex.inspect):
        first_line = (inspect.getdoc(member) or "").splitlines()[0]
        assert first_line.split("`")[0] in mutex, member.__qualname__
    # A code example in a docstring would be shown but never run: examples live in the
    # guides' python blocks. (Signatures are `doc-signature highlight` blocks.)
    assert '<div class="highlight"' not in reference, "a docstring shows a code example"
    testing = (site / "reference" / "testing" / "index.html").read_text()
    assert 'id="aiolocks.testing.expire_lease"' in testing
    integrations = (site / "reference" / "integrations" / "index.html").read_text()
    assert 'id="aiolocks.integrations.fastapi.request_lock"' in integrations
    assert 'id="aiolocks.integrations.aiohttp.locked"' in integrations


def test_the_benchmark_page_shows_the_committed_results(site: Path) -> None:
    results = ROOT / "benchmarks" / "results"
    page = (DOCS / "benchmarks.md").read_text()
    for path in results.glob("*.json"):
        assert f"<!-- results: {path.stem} -->" in page, f"{path.name} is not on the page"
    html = (site / "benchmarks" / "index.html").read_text()
    peers = json.loads((results / "peers.json").read_text())
    contended = peers["results"]["contended"]["aiolocks"]["acquisitions_per_s"]
    assert f"{contended:,.0f}" in html
    assert "<!-- results:" not in html  # every marker was replaced
    assert (site / "assets" / "peers.png").read_bytes() == (results / "peers.png").read_bytes()


def test_the_security_page_shows_the_readme_acl_line() -> None:
    """docs/security.md shows, and its snippet applies, exactly the README's ACL line."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- acl -->\s*```text\n(.+?)\n```", readme, re.S)
    assert found, "README.md has no <!-- acl --> block"
    line = found.group(1)
    page = DOCS / "security.md"
    blocks = list(fenced_blocks(page, page.read_text()))
    assert line + "\n" in [block.code for block in blocks if block.language == "text"]
    applied = []
    for snippet in page_snippets(page, page.read_text()):
        for node in ast.parse(snippet.block.code).body:
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "ACL_LINE":
                applied.append(ast.literal_eval(node.value))
    assert applied == [line], "keep the ACL_LINE of docs/security.md's snippet = README's"
