"""Running the `aiolocks` command line in-process from a test: `await cli(*argv)`."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass
from typing import Any

from aiolocks.cli import main


@dataclass
class Ran:
    """What one command did: its exit status and what it wrote."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


class _Terminal(io.StringIO):
    """Typed answers on what the CLI takes for a terminal."""

    def isatty(self) -> bool:
        return True


async def cli(*argv: str, answer: str | None = None, stdin: str = "") -> Ran:
    """Run `aiolocks argv...` in its own thread and event loop (the test's loop keeps
    running its locks meanwhile); `answer` is typed at a terminal, `stdin` piped."""
    out, err = io.StringIO(), io.StringIO()
    typed = io.StringIO(stdin) if answer is None else _Terminal(answer)
    code = await asyncio.to_thread(main, list(argv), stdin=typed, stdout=out, stderr=err)
    return Ran(code, out.getvalue(), err.getvalue())
