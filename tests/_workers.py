"""Worker processes for multi-process tests: start, read lines, reap (used by `spawn`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_TIMEOUT = 20.0  # longest wait for one expected line of a worker
EXIT_TIMEOUT = 10.0  # longest wait for a worker to exit once it should


class Worker:
    """One worker process with its stdout read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: list[str] = []  # every stdout line read so far
        self.stderr = ""

    async def expect(self, word: str, timeout: float = LINE_TIMEOUT) -> list[str]:
        """Read lines until one whose first field is ``word``; return its fields."""

        async def read() -> list[str]:
            assert self.proc.stdout is not None
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    await self.finish()
                    raise AssertionError(
                        f"{self.name} ended (status {self.proc.returncode}) before "
                        f"printing {word!r}; stdout={self.lines!r}\nstderr:\n{self.stderr}"
                    )
                line = raw.decode().strip()
                self.lines.append(line)
                fields = line.split()
                if fields and fields[0] == word:
                    return fields

        try:
            return await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"{self.name} printed no {word!r} within {timeout:g}s; stdout={self.lines!r}"
            ) from None

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def finish(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Wait for the exit (killing it past ``timeout``); collect the rest of its output."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        except TimeoutError:
            self.kill()
            out, err = await self.proc.communicate()
            err += f"\n[killed: still running {timeout:g}s after it should have ended]".encode()
        self.lines += [line.strip() for line in out.decode().splitlines()]
        self.stderr += err.decode(errors="replace")
        assert self.proc.returncode is not None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def events(self, word: str) -> list[list[str]]:
        return [line.split() for line in self.lines if line.split()[:1] == [word]]


Spawn = Callable[..., Awaitable[Worker]]


@contextlib.asynccontextmanager
async def spawner() -> AsyncIterator[Spawn]:
    """``await spawn(script, *argv, stdin=False)`` starts a worker; all are reaped on exit."""
    started: list[Worker] = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)

    async def start(script: Path, *argv: object, stdin: bool = False) -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            *map(str, argv),
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        worker = Worker(proc, f"{script.name}#{len(started)} (pid {proc.pid})")
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()
        for worker in started:
            await worker.finish()
