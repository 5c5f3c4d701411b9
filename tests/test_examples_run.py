"""The web examples start with `python examples/NAME.py PORT`: they say where they listen and
where their (embedded) server is, with an `aiolocks` command that works as printed."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from pathlib import Path

import httpx
import pytest
from _cli import cli
from _servers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("example", ["fastapi_orders", "aiohttp_orders"])
async def test_a_web_example_starts_as_documented_and_says_where_it_is(example: str) -> None:
    env = {**os.environ}
    env.pop("REDIS_URL", None)  # its own embedded server
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    port = free_port()
    app = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / f"{example}.py"), str(port),
        env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert app.stdout is not None
    try:
        said: list[str] = []
        while not said or not said[-1].startswith("orders service at "):
            line = await asyncio.wait_for(app.stdout.readline(), 60)
            assert line, f"{example} ended before it listened: {said}"
            said.append(line.decode().strip())
        app_url = said[-1].removeprefix("orders service at ")
        assert app_url == f"http://127.0.0.1:{port}"
        assert any(line.startswith("started an embedded Valkey at redis://") for line in said)
        (command,) = [line.split("its locks: ", 1)[1] for line in said if "its locks: " in line]

        async with httpx.AsyncClient(base_url=app_url) as http:
            charged = await http.post("/orders/42/charge", timeout=30)
        assert charged.status_code == 200 and charged.json()["order"] == 42

        argv = shlex.split(command)
        assert argv[:2] == ["aiolocks", "list"]
        listed = await cli(*argv[1:], "--json")  # as printed: its --url is the app's server
        assert listed.code == 0, listed.err
        assert "orders:42" in [row["name"] for row in listed.json()]

        app.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop, the embedded server with it
        # uvicorn ends by raising the SIGINT again once it has shut down, as Ctrl-C would.
        assert await asyncio.wait_for(app.wait(), 30) in (0, -signal.SIGINT)
    finally:
        if app.returncode is None:
            app.kill()
            await app.wait()
