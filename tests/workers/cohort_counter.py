"""Worker: TASKS tasks of one process contend for one `RedisMutex` with local hand-off.

    python cohort_counter.py URL NAME WORKER WORKERS TASKS ITERATIONS LOCAL_HANDOFF TTL TIMEOUT

Waits until all WORKERS have connected (a barrier on the server), then each task, ITERATIONS
times: acquire; log the start of its critical section in the name's `HistoryLog` (which
reads the counter); yield to the loop; log the end (which writes the counter plus one);
release. Prints ``done WORKER ACQUISITIONS SCRIPT_CALLS``: the engine's script calls of this
process (acquire, release, renewals), against its acquisitions.
"""

from __future__ import annotations

import asyncio
import sys

from _history import HistoryLog
from _lockworker import connect, emit, run
from mutex_counter import barrier

from aiolocks import RedisMutex
from aiolocks._engine._context import context_for


async def main(argv: list[str]) -> int:
    url, name, worker, workers = argv[0], argv[1], int(argv[2]), int(argv[3])
    tasks, iterations, local_handoff = int(argv[4]), int(argv[5]), int(argv[6])
    ttl, timeout = float(argv[7]), float(argv[8])
    client = connect(url)
    log = HistoryLog(client, name)
    try:
        await barrier(client, f"test:{{{name}}}:barrier", workers, timeout)

        async def hold(task: int) -> None:
            mutex = RedisMutex(client, name, ttl=ttl, timeout=timeout, local_handoff=local_handoff)
            for _ in range(iterations):
                async with mutex:
                    fence = mutex.fencing_token
                    assert fence is not None
                    started = await log.start()
                    await asyncio.sleep(0)  # another holder would interleave here
                    await log.end("x", fence, started, f"{worker}.{task}")

        await asyncio.gather(*(hold(task) for task in range(tasks)))
        emit("done", worker, tasks * iterations, context_for(client).commands_sent)
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), float(sys.argv[9]) + 5.0))
