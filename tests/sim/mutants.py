"""Mutation testing of the simulation: `python -m tests.sim.mutants` (`nox -s mutants`).

Each mutant is a small plausible bug, (file, exact original snippet, replacement, what it
breaks). One at a time, it is applied to a copy of the tree in a temporary directory (the
worktree is never modified) and the simulation is run on the copy as CI runs it (every
scenario, then seeds 1-12 at 20 virtual seconds, stopping at the first failing seed); the
mutant is caught if anything reports a violation, and the first violation names the
check. A snippet that is not found exactly once is an error: the code moved, and the
mutant must be brought up to date, not silently skipped.

`--list` lists them, `--only NAME ...` runs some, `--jobs N` runs N at once (2 by default:
a 2-core machine), `--no-control` skips the run of the unmutated copy (which must have no
violation for the score to mean anything).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEEDS = "1-12"  # as tests/test_sim.py runs them
DURATION = "20"
TIMEOUT = 900.0  # wall seconds per simulation run (a hung mutant counts as caught)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository's root
    original: str
    replacement: str
    description: str


MUTANTS = [
    # -- the six bugs that escaped the simulation before issue 33 --------------------------
    Mutant(
        "renewal-validity-from-reply",
        "aiolocks/_leases/_keeper.py",
        "                lease.renewed(sent_at)",
        "                lease.renewed(_clock.monotonic())",
        "escaped 1: a renewed lease's validity counted from the reply, not the request",
    ),
    Mutant(
        "free-grant-short-lease",
        "aiolocks/_scripts/mutex_acquire.lua",
        "  local stored = read_key(4, 'counter') or 0\n"
        "  redis.call('SET', owner, token, 'PX', ttl)\n"
        "  return",
        "  local stored = read_key(4, 'counter') or 0\n"
        "  redis.call('SET', owner, token, 'PX', math.floor(tonumber(ttl) * 0.9))\n"
        "  return",
        "escaped 2: the free-mutex grant sets a shorter lease on the server than the client's",
    ),
    Mutant(
        "renewal-extends-any-owner",
        "aiolocks/_scripts/_prelude.lua",
        "local function renew_owner_lease(keys, token, ttl_ms)\n"
        "  if redis.call('GET', keys[1]) ~= token then",
        "local function renew_owner_lease(keys, token, ttl_ms)\n"
        "  if not redis.call('GET', keys[1]) then",
        "escaped 3: a renewal extends whoever holds the mutex now, not only the caller",
    ),
    Mutant(
        "keeper-loss-untold",
        "aiolocks/_leases/_keeper.py",
        "        try:\n            lease.owner.lease_lost(reason)\n",
        "        try:\n            pass\n",
        "escaped 4: the keeper finds a lease lost and tells nobody",
    ),
    Mutant(
        "dead-waiters-not-purged",
        "aiolocks/_scripts/_prelude.lua",
        "redis.pcall('ZADD', waiters, now + tonumber(ttl), member)",
        "redis.pcall('ZADD', waiters, now + tonumber(ttl) * 1000, member)",
        "escaped 5: a crashed waiter is never purged from its queue",
    ),
    Mutant(
        "fence-ignores-counter",
        "aiolocks/_scripts/_prelude.lua",
        "  elseif stored < now then\n",
        "  else\n",
        "escaped 6: a fence from the clock alone, ignoring the stored counter",
    ),
    # -- scripts ------------------------------------------------------------------------
    Mutant(
        "release-by-non-owner",
        "aiolocks/_scripts/mutex_release.lua",
        "  if current then\n    return {0}\n  end\n",
        "",
        "a release by a token that does not own the mutex hands it on anyway",
    ),
    Mutant(
        "semaphore-one-too-many",
        "aiolocks/_scripts/_semaphore.lua",
        "    if held >= limit then\n      held = sem_held(k, limit, now)",
        "    if held > limit then\n      held = sem_held(k, limit, now)",
        "a semaphore release fills one permit more than the limit",
    ),
    Mutant(
        "rw-writer-beside-reader",
        "aiolocks/_scripts/_rwlock.lua",
        "    return not (side == 'w' and redis.call('ZCARD', k.readers) > 0)",
        "    return not (side == 'w' and redis.call('ZCARD', k.readers) > 1)",
        "an RW writer is let in beside a single reader",
    ),
    Mutant(
        "election-short-lease",
        "aiolocks/_scripts/_election.lua",
        "  redis.call('PEXPIRE', leader, ttl)\n",
        "  redis.call('PEXPIRE', leader, math.floor(tonumber(ttl) / 2))\n",
        "an election's leader is given half its lease on the server",
    ),
    Mutant(
        "multi-try-takes-held-names",
        "aiolocks/_scripts/multi_try.lua",
        "  if (current[i] and current[i] ~= token) or",
        "  if (current[i] and current[i] == token) or",
        "the multi-lock's one-script try takes names another token holds",
    ),
    Mutant(
        "release-skips-purge",
        "aiolocks/_scripts/_prelude.lua",
        "    local live = deadline and tonumber(deadline) >= now\n",
        "    local live = deadline\n",
        "a release hands on to the queue's head without dropping dead waiters (pop_live)",
    ),
    # -- the lease keeper ---------------------------------------------------------------
    Mutant(
        "validity-without-drift",
        "aiolocks/_leases/_keeper.py",
        "    return sent_at + ttl * (1 - _DRIFT) - 0.002",
        "    return sent_at + ttl",
        "a lease's validity without the clock-drift margin",
    ),
    Mutant(
        "renewed-bucket-due-late",
        "aiolocks/_leases/_keeper.py",
        "            self._push(sent_at + ttl / 3, bucket)",
        "            self._push(sent_at + ttl, bucket)",
        "renewed leases re-queued at ttl, not ttl/3 (their heap entry never matches)",
    ),
    Mutant(
        "lapsed-lease-renewed",
        "aiolocks/_leases/_keeper.py",
        "        if lease.valid_until > now:\n            return False\n",
        "        if lease.valid_until > now - lease.ttl:\n            return False\n",
        "a lease whose validity ended is sent for renewal, or taken up again by a late reply",
    ),
    Mutant(
        "renewal-waits-past-validity",
        "aiolocks/_leases/_keeper.py",
        "    deadline = now + min(\n",
        "    deadline = now + 3600 + 0 * min(\n",
        "an unanswered renewal is waited for an hour, past the leases' validity",
    ),
    # -- waiting ------------------------------------------------------------------------
    Mutant(
        "stale-grant-believed",
        "aiolocks/_waiting/_waitqueue.py",
        "        return fence <= self.floor",
        "        return False",
        "a grant at or below the fence floor is believed (issue 24's bug 1)",
    ),
    Mutant(
        "queued-at-from-reply",
        "aiolocks/_waiting/_waitqueue.py",
        "        if sent_at > self.queued_at:\n            self.queued_at = sent_at",
        "        if sent_at > self.queued_at:\n            self.queued_at = _clock.monotonic()",
        "a waiter's grant counted from when 'still queued' was read, not sent",
    ),
    Mutant(
        "safety-timer-late",
        "aiolocks/_waiting/_waitqueue.py",
        "        end = _clock.monotonic() + max(remaining_ms, 0) / 1000.0 + 0.002",
        "        end = _clock.monotonic() + max(remaining_ms, 0) / 100.0 + 0.002",
        "the head waiter's safety-net timer set ten times too late",
    ),
    # -- local hand-off cohorts ---------------------------------------------------------
    Mutant(
        "cohort-passes-lapsed-lease",
        "aiolocks/_engine/_leasedlock.py",
        "        if lease.remaining <= 0 or not self._may_pass():",
        "        if lease.valid_until <= _clock.monotonic() - 1.0 or not self._may_pass():",
        "a cohort passes on a lease whose validity ended",
    ),
    Mutant(
        "cohort-keep-validity-from-reply",
        "aiolocks/_engine/_leasedlock.py",
        "        lease.kept(sent_at)",
        "        lease.kept(_clock.monotonic())",
        "a cohort's kept lease counted from the reply",
    ),
    Mutant(
        "cohort-ignores-time-bound",
        "aiolocks/_engine/_leasedlock.py",
        "        since = self._waited_since\n"
        "        if since is None:\n"
        "            if self._watching():\n"
        "                return True\n"
        "            since = self._chain_start\n"
        "        now = _clock.monotonic()\n"
        "        return now - since < CHAIN_BOUND and now - self._held_since < CHAIN_BOUND",
        "        return True",
        "a cohort passes locally past its 10 ms (the count its only bound): a waiter elsewhere"
        " waits up to 16 holdings of any length",
    ),
    Mutant(
        "cohort-ignores-long-holding-after-news",
        "aiolocks/_engine/_leasedlock.py",
        "        return now - since < CHAIN_BOUND and now - self._held_since < CHAIN_BOUND",
        "        return now - since < CHAIN_BOUND",
        "once a waiter elsewhere is heard of, a cohort still passes on after a holding of"
        " 10 ms or more, within 10 ms of the news",
    ),
    Mutant(
        "cohort-ignores-announcement",
        "aiolocks/_engine/_leasedlock.py",
        "        elif self.token is not None and payload == self.token.encode():\n"
        "            self._waited_since = _clock.monotonic()",
        "        elif self.token is not None and payload == self.token.encode():\n            pass",
        "a cohort is not told that a waiter queued elsewhere: while it is watching, it passes"
        " locally up to its count, whatever the holdings' length",
    ),
    Mutant(
        "cohort-loss-untold",
        "aiolocks/_engine/_leasedlock.py",
        "            lock, holding = holder\n            lock._lease_lost(holding, reason)",
        "            lock, holding = holder",
        "a cohort's lost lease is not told to its current local holder",
    ),
    # -- multi-lock ---------------------------------------------------------------------
    Mutant(
        "multi-name-loss-untold",
        "aiolocks/multilock.py",
        "        elif not taken.holding.is_lost:\n"
        "            self._lease_lost(taken.holding, reason)",
        "        elif not taken.holding.is_lost:\n            pass",
        "a multi-lock's lost name is not told to its holder",
    ),
    Mutant(
        "multi-lease-from-reply",
        "aiolocks/multilock.py",
        "            grant.granted_at, owner,\n        )  # fmt: skip",
        "            _clock.monotonic(), owner,\n        )  # fmt: skip",
        "a multi-lock's leases counted from when the grant was read",
    ),
]


class SnippetMissing(Exception):
    pass


def check(mutants: list[Mutant], root: Path = ROOT) -> None:
    """Every mutant's snippet is in its file exactly once (else SnippetMissing)."""
    problems = []
    for mutant in mutants:
        text = (root / mutant.file).read_text(encoding="utf-8")
        count = text.count(mutant.original)
        if count != 1:
            problems.append(f"{mutant.name}: snippet found {count} times in {mutant.file}")
    if problems:
        raise SnippetMissing("\n".join(problems))


def copy_tree(into: Path, tree: Path = ROOT) -> None:
    """The library and the simulation, as they are in `tree` now (this worktree, or
    another checkout whose simulation is to be scored on the same mutants)."""
    shutil.copytree(tree / "aiolocks", into / "aiolocks", ignore=_IGNORE)
    shutil.copytree(tree / "tests" / "sim", into / "tests" / "sim", ignore=_IGNORE)


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def apply(mutant: Mutant, root: Path) -> None:
    path = root / mutant.file
    text = path.read_text(encoding="utf-8")
    if text.count(mutant.original) != 1:
        raise SnippetMissing(f"{mutant.name}: snippet not found once in {mutant.file}")
    path.write_text(text.replace(mutant.original, mutant.replacement), encoding="utf-8")


@dataclass
class Outcome:
    name: str
    caught: bool
    by: str  # the check that caught it (the first violation's), or why it survived
    where: str  # the scenario or seed
    detail: str
    seconds: float


def run_one(mutant: Mutant | None, scenarios_first: bool = True, tree: Path = ROOT) -> Outcome:
    """Apply `mutant` (None: the control) to a fresh copy of `tree` and run the simulation
    there (without the scenarios if not `scenarios_first`: which seeds alone catch it)."""
    started = time.monotonic()
    name = "control" if mutant is None else mutant.name
    with tempfile.TemporaryDirectory(prefix=f"aiolocks-mutant-{name}-") as tmp:
        root = Path(tmp)
        copy_tree(root, tree)
        if mutant is not None:
            apply(mutant, root)
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="0")
        results = {}
        if scenarios_first:
            scenarios = _sim(root, env, "--all-scenarios", "--json")
            if scenarios.returncode not in (0, 1) or not scenarios.stdout.strip():
                detail = (scenarios.stderr or scenarios.stdout)[-300:]
                return Outcome(name, True, "run failed", "scenarios", detail, _since(started))
            results = json.loads(scenarios.stdout)
        for scenario, result in results.items():
            if result["violations"]:
                first = result["violations"][0]
                return Outcome(
                    name, True, check_of(first), f"scenario {scenario}", first, _since(started)
                )
        fast = (
            ["--fail-fast"] if "--fail-fast" in (root / "tests/sim/__main__.py").read_text() else []
        )
        seeds = _sim(root, env, "--seeds", SEEDS, "--duration", DURATION, *fast)
        seed, first = first_violation(seeds.stdout)
        if first is not None:
            return Outcome(name, True, check_of(first), f"seed {seed}", first, _since(started))
        if seeds.returncode != 0:
            detail = (seeds.stderr or seeds.stdout)[-300:]
            return Outcome(name, True, "run failed", "seeds", detail, _since(started))
        return Outcome(name, False, "survived", "", "", _since(started))


def _sim(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [sys.executable, "-m", "tests.sim", *args],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"timed out after {TIMEOUT:g} s")


def _since(started: float) -> float:
    return time.monotonic() - started


def first_violation(output: str) -> tuple[str, str | None]:
    """The first failing seed of a `--seeds` run and its first violation."""
    seed = ""
    for line in output.splitlines():
        match = re.match(r"seed (\d+):", line)
        if match:
            seed = match.group(1)
        elif line.startswith("    ") and seed:
            return seed, line.strip()
    return seed, None


def check_of(violation: str) -> str:
    """The check that reported `violation`: its leading words in capitals (with the
    history's or the server's mark), else the text before its first colon."""
    text = re.sub(r"^t=\S+ ", "", violation)
    if text.startswith("NO LockLost"):
        return "NO LockLost"
    match = re.match(r"((?:[A-Z]{2,} )*[A-Z]{2,})\b( \((?:server|history)\))?", text)
    if match:
        return match.group(1) + (match.group(2) or "")
    return text.split(":")[0][:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants")
    parser.add_argument("--only", nargs="*", help="run only these mutants (by name)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once (2 cores)")
    parser.add_argument("--no-control", action="store_true", help="skip the unmutated run")
    parser.add_argument(
        "--seeds-only", action="store_true", help="judge by the seeds alone (no scenarios)"
    )
    parser.add_argument(
        "--tree", type=Path, default=ROOT, help="score another checkout's simulation"
    )
    options = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not options.only or m.name in options.only]
    if options.only and len(mutants) != len(set(options.only)):
        known = {m.name for m in MUTANTS}
        print(f"unknown mutants: {sorted(set(options.only) - known)}", file=sys.stderr)
        return 2
    try:
        check(mutants, options.tree)
    except SnippetMissing as exc:
        print(f"error: mutants out of date with the code:\n{exc}", file=sys.stderr)
        return 2
    if options.list:
        for mutant in mutants:
            print(f"{mutant.name:34} {mutant.file:36} {mutant.description}")
        return 0
    jobs: list[Mutant | None] = [None] if not options.no_control else []
    jobs.extend(mutants)
    outcomes: dict[str, Outcome] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, options.jobs)) as pool:
        futures = {pool.submit(run_one, m, not options.seeds_only, options.tree): m for m in jobs}
        for future in concurrent.futures.as_completed(futures):
            outcome = future.result()
            outcomes[outcome.name] = outcome
            status = f"caught by {outcome.by} ({outcome.where})" if outcome.caught else "SURVIVED"
            if outcome.name == "control":
                status = f"violation: {outcome.detail}" if outcome.caught else "no violation"
            print(f"{outcome.name:34} {status}  [{outcome.seconds:.0f} s]", flush=True)
    control = outcomes.pop("control", None)
    print()
    print(f"{'mutant':34} {'file':36} result")
    for mutant in mutants:
        outcome = outcomes[mutant.name]
        status = f"caught by {outcome.by} ({outcome.where})" if outcome.caught else "SURVIVED"
        print(f"{mutant.name:34} {mutant.file:36} {status}")
    caught = sum(o.caught for o in outcomes.values())
    print(f"\nscore: {caught}/{len(outcomes)} caught ({100 * caught / len(outcomes):.0f}%)")
    for outcome in outcomes.values():
        if outcome.caught:
            print(f"  {outcome.name}: {outcome.detail[:300]}")
    if control is not None and control.caught:
        print(f"error: the unmutated copy has violations: {control.detail}", file=sys.stderr)
        return 2
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
