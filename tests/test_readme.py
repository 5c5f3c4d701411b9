"""The README's Python snippets run as written (against a test server, not localhost)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


EXPECTED = [
    r"charging, fence \d+\n",
    r"calling the API, fence \d+\nreading\nwriting\n",
    r"alice \{1\}\n\[2, 3, 2\]\nalice 3\n",
    r'\{"order":42,"fence":\d+\}\n',
]

# A web app snippet only defines `app`: run its lifespan and send it one request.
APP_DRIVER = """
import asyncio as _asyncio
import httpx as _httpx
from asgi_lifespan import LifespanManager as _LifespanManager
import pytest


async def _drive() -> None:
    async with _LifespanManager(app) as manager:
        transport = _httpx.ASGITransport(app=manager.app)
        async with _httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            print((await client.post("/orders/42/charge")).text)


_asyncio.run(_drive())
"""


@pytest.mark.slow
def test_snippets_run(url: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == len(EXPECTED), "a README snippet has no expected output here"
    for code, expected in zip(blocks, EXPECTED, strict=True):
        code = code.replace("redis://localhost:6379", url)
        if "FastAPI(" in code:
            code += APP_DRIVER
        assert url in code
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(expected, done.stdout), done.stdout


def test_the_test_commands_are_there_and_use_what_the_test_extra_installs() -> None:
    """The one command .ci/run runs (between the markers) installs the `test` extra, whose
    packages include pytest-xdist for `-n`; the quick loop's markers are registered."""
    text = README.read_text()
    block = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```\n<!-- /test-command -->", text)
    assert block is not None and text.count("<!-- test-command -->") == 1
    assert block[1] == "pip install -e '.[test]' && python -m pytest -n auto"
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())
    assert any(
        dep.startswith("pytest-xdist")
        for dep in project["project"]["optional-dependencies"]["test"]
    )
    quick = re.search(r'python -m pytest -n (?:auto|\d+) -m "([^"]+)"', text)
    assert quick is not None, "no quick loop in the README"
    registered = {m.split(":")[0] for m in project["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(re.findall(r"\b(?!not\b|and\b|or\b)(\w+)", quick[1])) <= registered
