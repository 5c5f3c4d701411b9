"""The deterministic simulation (tests/sim/): issue 24's scenarios and a bounded number of
random seeds, each with zero invariant violations.

The simulator patches the engine's clocks and token source for the run, so it runs in a
subprocess (`python -m tests.sim`, which also pins PYTHONHASHSEED), never in this one. A
failure shows the violations and the trace; `nox -s simulate -- --seed N` replays a seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# CI's share: about two minutes of seeds on a 2-core machine (`nox -s sweep`: 1-1000).
# Seed 21 found a bug there: a multi-lock's release waited for its first name's lease, not
# for the first of its leases to end (a name granted by a late reply: SLOW release multi).
CI_SEEDS = "1-24"
CI_DURATION = "20"
# Seeds past CI's range that each found a bug (issue 40): an oracle gap, OWNERLESS BELIEF on
# 20, 114, 365, 451 (a grant or renewal the server ran before a restart, heard of after it);
# ORPHANED on 74 (a lease lost at its validity's end given back only when its task released);
# on 373 a release answered 0.8 s past its validity (a cancellation Python 3.11 swallowed);
# on 165 and 964 a cohort's keep answered after renewals moved its lease's validity back
# (SLOW release, LATE LOSS of a lease the server had just renewed); on 723 an oracle gap,
# OVERLAP (a grant the server ran before a restart, heard of after it); on 695 a renewal
# answered past its lease's validity took the lease up again, its loss never told (LATE LOSS).
FOUND_SEEDS = ["20", "114", "365", "451", "74", "373", "165", "964", "723", "695", "428"]


def _simulate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    return subprocess.run(
        [sys.executable, "-m", "tests.sim", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# The simulation's seeds and scenarios: not in the quick loop (`-m "not slow ..."`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scenarios() -> dict[str, Any]:
    done = _simulate("--all-scenarios", "--json")
    assert done.returncode in (0, 1), done.stderr[-3000:]
    results: dict[str, Any] = json.loads(done.stdout)
    return results


# Each reproduced the bug named on the code before its fix (issue 24); bugs 2 and 3 lived in
# carrying, since removed: their scenarios still run, on the engine without it.
SCENARIOS = {
    "late-grant-message": "bug 1: a late grant message believed after a re-check",
    "waiter-behind-a-taken-over-holder": "bug 2 (was in carrying): a waiter without a timer",
    "cancelled-waiter-behind-a-slow-release": "bug 3 (was in carrying): a departed owner",
    "multilock-bounds": "bug 4: RedisMultiLock ignores the engine's bounds",
    "failed-config-get": "bug 5: one failed CONFIG GET ends a queued acquisition",
    "multilock-grant-for-another-name": "found by the simulation: a grant for another name",
    "cohort-pass-after-validity": "found by the simulation: a lapsed lease passed locally",
    "cohort-release-bound": "found by the simulation: a cohort release past the validity",
    # issue 45: the default's cohort paths no seed reached, and its fairness bound
    "cohort-at-its-bound-while-another-waits": "a waiter elsewhere past the 10 ms bound",
    "cohort-keeps-past-its-renewal": "a kept lease renewed from the keep's request",
    "cohort-pass-at-the-drift-margin": "a lease lapsed inside the 10 ms, passed locally",
    "cohort-told-during-a-long-holding": "a long holding passed on, the news of a waiter in",
    "cohort-turns-cancelled-and-handed-over": "a turn cancelled as it comes; a detached cohort",
    "restart-while-held": "issue 33: a renewal after a restart must not extend another's lease",
    "clock-back": "issue 33: fences rise across a server clock stepped back",
    "clock-back-after-expiry": "issue 40: ... and stepped back after the counter expired",
    "crash-while-queued": "issue 33: a dead process's queued tasks are purged, the queue moves on",
    "stall-past-validity": "issue 33: a validity ended in a loop stall is reported, not renewed",
    "loop-ends-after-cancelling-waiters": "issue 34: a withdrawal cut short by the loop's end",
    # issue 36: RedisRateLimiter's grants under the faults, against the bound and their slots
    "ratelimit-faults": "the rate limiter: a grant above the bound, or before its slot",
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_has_no_violation(scenarios: dict[str, Any], name: str) -> None:
    result = scenarios[name]
    assert not result["violations"], f"{SCENARIOS[name]}\n" + "\n".join(
        result["trace"][-60:] + result["violations"]
    )


@pytest.mark.parametrize("seed", FOUND_SEEDS)
def test_a_seed_that_found_a_gap_stays_clean(seed: str) -> None:
    done = _simulate("--seed", seed, "--duration", CI_DURATION, "--trace", "60")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_random_seeds_have_no_violation() -> None:
    done = _simulate("--seeds", CI_SEEDS, "--duration", CI_DURATION, timeout=590)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "0 with violations" in done.stdout


def test_a_seed_replays_identically() -> None:
    """Reproducible from its seed: the same trace twice."""
    first = _simulate("--seed", "3", "--duration", "5", "--full-trace")
    second = _simulate("--seed", "3", "--duration", "5", "--full-trace")
    assert first.returncode == 0, first.stdout[-3000:]
    assert first.stdout == second.stdout
    assert first.stdout.count("\n") > 1000  # a real trace (commands, replies, faults)


def test_overlapping_latency_faults_leave_the_link_at_its_own_latency() -> None:
    """Two latency faults on one link that end in the other order: the link comes back to
    its own latency (each fault restored what it saw at its start, so the first to end
    restored the base and the second then restored the first fault's 0.1 s for good)."""
    from types import SimpleNamespace

    from sim._workload import _end_latency_fault

    conn: Any = SimpleNamespace(latency=0.0005, base_latency=0.0005, latency_faults=0)
    for latency in (0.1, 0.4):  # the second starts while the first is on
        conn.latency, conn.latency_faults = latency, conn.latency_faults + 1
    _end_latency_fault(conn)  # the first ends: the second's is still on
    assert conn.latency == 0.4
    _end_latency_fault(conn)
    assert conn.latency == 0.0005


def test_a_reset_link_leaves_no_loss_for_the_collector_to_report() -> None:
    """Seed 883 (once in 1,000 seeds): at the run's closing collection the loop logged
    "Future exception was never retrieved ConnectionResetError". The simulated transport kept
    its protocol after the loss (asyncio's drop theirs), and the stream protocol's close
    waiter, which asyncio marks seen only in the protocol's `__del__`, was finalized first in
    a reference cycle. Now the transport lets go of its protocol at the loss and the waiter's
    loss is marked seen there."""
    import asyncio
    from types import SimpleNamespace

    from sim._net import SimTransport

    async def reset() -> tuple[SimTransport, asyncio.Future[None]]:
        conn: Any = SimpleNamespace(_close_server_side=lambda: None)
        transport = SimTransport(conn)
        protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
        transport.set_protocol(protocol)
        transport.lose(ConnectionResetError(104, "Connection reset by peer"))
        return transport, protocol._closed  # type: ignore[attr-defined]

    transport, closed = asyncio.run(reset())
    assert transport.protocol is None
    assert closed._log_traceback is False  # read before exception() marks it
    assert isinstance(closed.exception(), ConnectionResetError)


def test_a_replayed_seed_with_a_crash_prints_nothing_at_exit() -> None:
    """Seed 125 crashes a process with acquisitions in flight: as a killed process, its tasks
    never run again, not even their clean-up when the interpreter exits (which printed
    "no running event loop" tracebacks after the replay's verdict)."""
    done = _simulate("--seed", "125", "--duration", "20")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "'crash': 1" in done.stdout
    assert done.stderr == ""
