"""The README's Python snippets run as written (against a test server, not localhost)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


async def _drive() -> None:
    async with _LifespanManager(app) as manager:
        transport = _httpx.ASGITransport(app=manager.app)
        async with _httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            print((await client.post("/orders/42/charge")).text)


_asyncio.run(_drive())
"""


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
