"""Branch coverage of a simulated run's own process (`python -m tests.sim.branches`).

Each seed and scenario runs in a forked child that ends with `os._exit` (`__main__._forked`),
which skips every exit hook, coverage.py's save among them: so the child measures itself,
from its fork to its end, and saves before it exits, when `AIOLOCKS_SIM_COVERAGE` names the
directory to save in. Unset (CI, a replay), nothing is imported and nothing measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

ENV = "AIOLOCKS_SIM_COVERAGE"


def measure_child() -> Callable[[], None] | None:
    """Start measuring this (forked) process if asked; returns what saves it, else None."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    import coverage

    measured = coverage.Coverage(
        data_file=os.path.join(directory, ".coverage"),
        data_suffix=f"sim.{os.getpid()}.{time.monotonic_ns()}",
        branch=True,
        source=["aiolocks"],
        config_file=False,
    )
    measured.start()

    def save() -> None:
        measured.stop()
        measured.save()

    return save
