"""The CMD of the `aiolocks run` tests: reports signals and exits when told.

    python run_child.py MODE

Prints ``started <pid>``, then reads stdin lines: ``exit N`` exits with N. MODE ``polite``:
SIGINT or SIGTERM print ``got <signum>`` and exit 3. MODE ``stubborn``: SIGTERM prints
``term`` and is otherwise ignored (only SIGKILL ends it).
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def main(mode: str) -> int:
    def polite(signum: int, frame: FrameType | None) -> None:
        print("got", signum, flush=True)
        os._exit(3)

    def stubborn(signum: int, frame: FrameType | None) -> None:
        print("term", flush=True)

    if mode == "polite":
        signal.signal(signal.SIGINT, polite)
        signal.signal(signal.SIGTERM, polite)
    else:
        signal.signal(signal.SIGTERM, stubborn)
    print("started", os.getpid(), flush=True)
    for line in sys.stdin:
        if line.startswith("exit "):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
