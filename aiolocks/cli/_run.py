"""`aiolocks run NAME -- CMD`: run a program only while holding a lock (flock(1) across hosts).

Holds `RedisMutex(NAME)` (a `RedisSemaphore` with `--limit`) while CMD runs, then releases.
CMD runs in a process group of its own, so that a lost lease stops all of its processes:
SIGTERM to the group, SIGKILL after `--grace` seconds. Signals sent to `aiolocks run`
(INT, TERM, HUP, QUIT, USR1, USR2) are forwarded to that group; the lock is released once
CMD has exited. On Linux, CMD is also killed if `aiolocks run` itself dies (the lease then
ends by its ttl).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

from .._base._errors import LimitMismatch, LockLost
from .._engine._leasedlock import LeasedLock
from ..mutex import RedisMutex
from ..semaphore import RedisSemaphore
from ._connect import connected, server_url
from ._errors import EXIT_LEASE_LOST, EXIT_NOT_ACQUIRED, Refused, UsageError
from ._io import Streams

__all__ = ["run"]

_FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_PDEATHSIG = 1


def _in_own_group() -> None:
    """In the child, before exec: a process group of its own, and (Linux) SIGKILL when the
    parent dies, so CMD never runs on without the lock's holder."""
    os.setpgid(0, 0)
    if sys.platform == "linux":
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _on_signal(
    loop: asyncio.AbstractEventLoop, signum: int, handler: Callable[[int], None]
) -> None:
    """Handle `signum` on the loop; possible only in the main thread (`main()` called from
    another thread, as tests do, forwards no signals)."""
    with contextlib.suppress(ValueError, RuntimeError):
        loop.add_signal_handler(signum, handler, signum)


def _status(returncode: int) -> int:
    """CMD's exit status as a shell reports it (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def _what(args: argparse.Namespace) -> str:
    kind = "mutex" if args.limit is None else f"semaphore (limit {args.limit})"
    return f"{kind} {args.name!r}"


async def run(args: argparse.Namespace, io: Streams) -> int:
    command: list[str] = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no command to run: aiolocks run NAME [options] -- CMD [ARGS...]")
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    received: list[int] = []

    def stop(signum: int) -> None:  # before CMD runs: give up waiting
        received.append(signum)
        main.cancel()

    if args.set_limit and args.limit is None:
        raise UsageError("--set-limit needs --limit N: the limit to store")
    for signum in (signal.SIGINT, signal.SIGTERM):
        _on_signal(loop, signum, stop)
    try:
        async with connected(server_url(args.url), args.connect_timeout) as client:
            lock: LeasedLock
            if args.limit is None:
                lock = RedisMutex(client, args.name, ttl=args.ttl, prefix=args.prefix)
            else:
                lock = RedisSemaphore(
                    client, args.name, limit=args.limit, ttl=args.ttl, prefix=args.prefix
                )
                if args.set_limit:
                    await lock.set_limit(args.limit)
            try:
                acquired = await lock.acquire(timeout=args.timeout)
            except LimitMismatch:
                assert isinstance(lock, RedisSemaphore)
                raise Refused(await _other_limit(lock, args)) from None
            if not acquired:
                waited = "at once" if args.timeout == 0 else f"within {args.timeout:g} s"
                print(
                    f"aiolocks: {_what(args)} not acquired {waited}: {command[0]} not started",
                    file=io.stderr,
                    flush=True,
                )
                return EXIT_NOT_ACQUIRED
            return await _hold_while_running(lock, command, args, io)
    except asyncio.CancelledError:
        if not received:
            raise
        return 128 + received[0]
    finally:
        for signum in _FORWARDED:
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)


async def _other_limit(lock: RedisSemaphore, args: argparse.Namespace) -> str:
    """Why a semaphore with another stored limit was refused, and what to type instead."""
    stored = (await lock.inspect()).limit
    said = "another limit" if stored is None else f"limit {stored}"
    keep = "" if stored is None else f"give --limit {stored}, or "
    return (
        f"semaphore {args.name!r} is stored with {said}, not {args.limit}: {keep}add "
        f"--set-limit to store {args.limit} (every user of the name must then give "
        f"--limit {args.limit})"
    )


async def _hold_while_running(
    lock: LeasedLock, command: list[str], args: argparse.Namespace, io: Streams
) -> int:
    loop = asyncio.get_running_loop()
    try:
        process = await asyncio.create_subprocess_exec(*command, preexec_fn=_in_own_group)
    except OSError as exc:  # statuses as a shell's: 127 not found, 126 not runnable
        with contextlib.suppress(LockLost):
            await lock.release()
        print(f"aiolocks: cannot run {command[0]}: {exc.strerror or exc}", file=io.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)

    for signum in _FORWARDED:
        _on_signal(loop, signum, forward)
    exited = asyncio.ensure_future(process.wait())
    gone = asyncio.ensure_future(lock.lost.wait())
    try:
        await asyncio.wait((exited, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
    if not exited.done():
        print(
            f"aiolocks: lost the lease of {_what(args)} while {command[0]} ran: sent it "
            f"SIGTERM (SIGKILL after {args.grace:g} s); exit status {EXIT_LEASE_LOST}",
            file=io.stderr,
            flush=True,
        )
        forward(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(exited), args.grace)
        except TimeoutError:
            forward(signal.SIGKILL)
            await exited
    status = _status(exited.result())
    reported = gone.done() and not gone.cancelled()
    try:
        await lock.release()
    except LockLost as exc:
        if not reported:
            print(
                f"aiolocks: {exc}; {command[0]} exited with {status} but may have run "
                f"without it: exit status {EXIT_LEASE_LOST}",
                file=io.stderr,
                flush=True,
            )
        return EXIT_LEASE_LOST
    return EXIT_LEASE_LOST if reported else status
