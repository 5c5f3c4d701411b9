"""`main(argv)`: parse, run the command, turn every expected failure into one line on stderr
and an exit status (0 ok, 1 not found or refused, 2 usage, 3 server unreachable, 141 the
reader of the output went away)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TextIO

from ._errors import CliError
from ._io import Streams
from ._parser import build_parser

__all__ = ["EXIT_CLOSED_PIPE", "main"]

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE

Command = Callable[[argparse.Namespace, Streams], Coroutine[Any, Any, int]]


# Each command's module, imported on use: `--help` needs none.
_MODULES = {
    "inspect": "_inspect",
    "list": "_list",
    "release": "_release",
    "demo": "_demo",
    "run": "_run",
    "server": "_server",
}


def _command(name: str) -> Command:
    run: Command = importlib.import_module(f"{__package__}.{_MODULES[name]}").run
    return run


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the `aiolocks` command line with `argv` (default: `sys.argv[1:]`); return the
    exit status. The streams default to the process's own."""
    io = Streams(
        sys.stdin if stdin is None else stdin,
        sys.stdout if stdout is None else stdout,
        sys.stderr if stderr is None else stderr,
    )
    try:
        return _run(argv, io)
    except BrokenPipeError:  # the reader went away (`aiolocks list --json | head -1`)
        return _reader_gone(io)


def _run(argv: Sequence[str] | None, io: Streams) -> int:
    argv, command = _split_command(sys.argv[1:] if argv is None else argv)
    try:
        with contextlib.redirect_stdout(io.stdout), contextlib.redirect_stderr(io.stderr):
            args = build_parser().parse_args(argv)
    except SystemExit as exit:  # --help, --version, or a usage error argparse explained
        return exit.code if isinstance(exit.code, int) else 2
    if command is not None:
        args.cmd = command
    try:
        return asyncio.run(_command(args.command)(args, io))
    except CliError as error:
        print(f"aiolocks: {error}", file=io.stderr, flush=True)
        return error.status
    except KeyboardInterrupt:
        print("aiolocks: interrupted", file=io.stderr, flush=True)
        return 130


def _reader_gone(io: Streams) -> int:
    """A closed output pipe is a normal end: no traceback, and the status of a command a
    SIGPIPE ended (128 + 13), as `cat` or `ls` would give. The process's own streams that
    cannot be written any more are pointed at /dev/null, so the interpreter's last flush
    at exit does not complain either."""
    for stream in (io.stdout, io.stderr):
        if stream not in (sys.stdout, sys.stderr):
            continue
        try:
            stream.flush()
        except OSError:
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)
    return EXIT_CLOSED_PIPE


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """`run ... -- CMD ARGS`: everything after the first `--` is CMD's, untouched (argparse
    would read CMD's own options, or refuse the `--` after a subcommand)."""
    argv = list(argv)
    if "--" in argv and "run" in argv[: argv.index("--")]:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, None
