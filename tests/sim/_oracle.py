"""The oracle on the server's truth: what the fake server holds, checked against what each
holder believes, trusting nothing the engine says about its own leases.

The engine's account is used only to say *whether* a holder believes it holds (granted,
not released, not told of a loss, its `valid_until` not yet over). Whether it may is read
from the server at that instant, and how long it may is computed here, from when the
simulator saw the granting or renewing request written on its connection:

- **OWNERLESS BELIEF**: after every command the server runs, and at every grant, validity
  change (a renewal's reply), loss report and release, each believing holder owns its
  name on the server (the owner key, or a live member of the holders set).
- **VALIDITY**: a lease is never believed past `sent + ttl x (1 - drift) - 2 ms`, where
  `sent` is when the holder's process wrote the last of its requests that the server had
  run when it granted or extended that token's lease (the granting or renewing request
  itself, when it is the holder's own).
- **SHORT LEASE**: each grant or extension gives the token a lease of at least its ttl on
  the server.
- **FENCE DOWN**: a name's fence counter only rises.
- **DEAD GRANT**: nobody is granted a name on behalf of a process that died longer than
  a ttl ago (its queue entries must have been purged by then: the queue moves on).
- **LATE LOSS (server)**: a holder is told of its loss (or has released) by the end of the
  validity computed here plus the documented bound; `_workload` checks that the body of
  `async with` is cancelled and `LockLost` raised.
- **EXTRA WAIT**: a waiter elsewhere waits, beyond strict FIFO, for at most `local_handoff`
  local holdings of a cohort and at most 10 ms of them after the news of its queueing
  reached the cohort's process, plus the holding under way then (docs/mutex.md,
  "Fairness"). From the server's record of each name (`Tenure`: a token's owner key, from
  its grant or its last `keep` to the next change of owner or fence block) and the
  holdings the simulator saw begin, on its own clock: once another token's live entry is
  in the queue (at Q), no holding of the cohort's token begins more than 10 ms after the
  later of when its chain came from Redis (the `keep` on the server, or the first holding
  of a grant) and when the news reached its process (the queueing script's message on the
  name's "queued" channel, or the reset that lost it: `Net.announced`; Q if none was
  sent), nor past the count, nor, once that news is in, after a holding of 10 ms (before
  it, nobody is known to wait elsewhere, and a holding of any length may be passed on).

Excused, each where it is checked: a restart without persistence (`_restart_excuse`: a
belief from before it lasts until the holder's next renewal tells it, ttl/3 after; the
overlap checks go by `server_ran`, when the server ran the grant a belief rests on). The
simulation has no replica failover with data loss; a server clock stepped back keeps every
key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._loop import Proc

if TYPE_CHECKING:
    from ._net import Conn
    from ._world import Hold, World

# A fault of a holder's own this long before a restart may still slow its next renewal
# (slow renewal replies last up to 12 s): it learns of the restart by its validity's end.
TROUBLE_BEFORE = 15.0

# The documented validity (docs/architecture.md, "Invariants"): sent + ttl x 0.99 - 2 ms.
DRIFT = 0.01
MARGIN = 0.002
_EPS = 1e-7
# Which key holds a holding's lease, per kind: (the primitive's key kind, part).
LEASE_KEYS = {
    "mutex": ("mutex", "owner"),
    "cohort": ("mutex", "owner"),
    "multi": ("mutex", "owner"),
    "semaphore": ("semaphore", "holders"),
    "read": ("rwlock", "readers"),
    "write": ("rwlock", "writer"),
    "election": ("election", "leader"),
}
_LEASE_PARTS = tuple(f":{part}".encode() for _, part in set(LEASE_KEYS.values()))
# The fairness bound docs/mutex.md states: a cohort passes the name on locally only while
# it has stayed in the process less than this since it came from Redis, and not after a
# holding this long (plus the count, `local_handoff`, read from its token's `+N` block).
FAIR_TIME = 0.010
FAIR_SLACK = 0.001  # a pass's holder runs its first step after the releaser's
_MUTEX = b"aiolocks:mutex:{"


def validity(sent: float, ttl: float) -> float:
    """How long a lease granted or renewed by a request written at `sent` may be believed."""
    return sent + ttl * (1 - DRIFT) - MARGIN


def lease_key(kind: str, name: str) -> bytes:
    what, part = LEASE_KEYS[kind]
    return f"aiolocks:{what}:{{{name}}}:{part}".encode()


@dataclass
class Extension:
    """The server granted or extended a token's lease."""

    basis: float  # when the request it counts from was written (loop time)
    run: float  # when the server ran it (loop time)
    lease: float  # seconds of lease it gave, on the server's clock


@dataclass
class Tenure:
    """A token owned a mutex name on the server: from a grant (or a cohort's `keep`, a new
    fence block for the same token) to the next change of owner or block."""

    name: str
    token: str
    fence: int | None
    start: float  # loop time the server ran the grant or keep
    kept: bool  # began with a `keep` (the same token's next block)
    deadline: float  # loop time its owner key ends, as last seen
    waited: float | None = None  # first seen with another token's live entry queued
    end: float = float("inf")


class Oracle:
    """Watches the server (`Net.observer`) and the holders (`World`)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.net = world.net
        self.ext: dict[tuple[bytes, str], list[Extension]] = {}
        self.last_write: dict[Proc, float] = {}
        self.fences: dict[bytes, int] = {}
        self.live: list[Hold] = []
        self.by_lease: dict[int, list[Hold]] = {}
        self.reported: set[tuple[Any, str]] = set()
        self.tenure: dict[str, Tenure] = {}  # each mutex name's current owner
        self.tenures: list[Tenure] = []  # ended

    # -- the server's state ------------------------------------------------------------

    def holders(self, key: bytes) -> dict[str, float]:
        """Who holds the lease at `key` now: token -> deadline (server seconds)."""
        item = self.net.db._dict.get(key)
        if item is None:
            return {}
        now = self.net.server_time()
        expireat = item.expireat
        if expireat is not None and expireat <= now:
            return {}
        end = float("inf") if expireat is None else expireat
        value = item.value
        if isinstance(value, bytes):
            return {value.decode(): end}
        byscore = getattr(value, "_byscore", None)
        if byscore is not None:
            return {member.decode(): score / 1000 for score, member in byscore}
        fields = getattr(value, "_values", None)
        token = None if fields is None else fields.get(b"token")
        return {} if token is None else {token.decode(): end}

    def _fence(self, key: bytes) -> int | None:
        item = self.net.db._dict.get(key)
        if item is None or not isinstance(item.value, bytes):
            return None
        try:
            return int(item.value)
        except ValueError:
            return None

    # -- each command the server runs --------------------------------------------------

    def before(self, conn: Conn, fields: list[bytes]) -> Any:
        keys = _keys_of(fields)
        leases = [k for k in keys if k.endswith(_LEASE_PARTS)]
        return leases, {k: self.holders(k) for k in leases}

    def after(self, conn: Conn, fields: list[bytes], seen: Any) -> None:
        world = self.world
        now = world.loop.time()
        proc = conn.proc
        sent = getattr(conn, "sent_at", now) or now
        if proc in world.clients:
            self.last_write[proc] = max(self.last_write.get(proc, 0.0), sent)
        leases, before = seen
        server_now = self.net.server_time()
        for key in leases:
            old = before[key]
            for token, deadline in self.holders(key).items():
                if deadline <= server_now:
                    continue
                was = old.get(token)
                owner = world.recorder.tokens.get(token.split("+")[0])
                exts = self.ext.setdefault((key, token), [])
                if was is not None and abs(deadline - was) < 1e-9:
                    # Unchanged: not extended, unless re-armed by its own process within
                    # the same millisecond (the deadline is as fresh as a new lease).
                    fresh = exts and deadline - server_now >= exts[0].lease - 0.0011
                    if owner is not proc or not fresh:
                        continue
                # Counted from the last request the holder's process wrote that the server
                # has run by now (this one, if its own): the engine may count from any of
                # them (its own call, or the last that found it queued), never later.
                basis = self.last_write.get(owner, now) if owner is not None else now
                extension = Extension(basis, now, deadline - server_now)
                exts.append(extension)
                if was is None:
                    self._check_grantee(key, token, owner, extension.lease)
        for key in _keys_of(fields):
            if key.endswith(b":fence"):
                self._check_fence(key)
            elif key.startswith(_MUTEX) and key.endswith(b":owner"):
                self._track_tenure(key[len(_MUTEX) : -len(b"}:owner")].decode())
        self.step(f"after {fields[0].decode(errors='replace')}")

    def _track_tenure(self, name: str) -> None:
        """After a command on mutex `name`: who owns it, with which fence block, and whether
        another token waits live in its queue (`Tenure`)."""
        now = self.world.loop.time()
        prefix = _MUTEX + name.encode() + b"}:"
        server_now = self.net.server_time()
        owners = self.holders(prefix + b"owner")
        token, deadline = next(iter(owners.items()), (None, 0.0))
        fence = self._fence(prefix + b"fence")
        current = self.tenure.get(name)
        if current is not None and (token != current.token or fence != current.fence):
            current.end = min(now, current.deadline)
            self.tenures.append(self.tenure.pop(name))
        if token is None:
            return
        if current is None or current.end != float("inf"):
            kept = current is not None and current.token == token and current.end >= now
            current = self.tenure[name] = Tenure(name, token, fence, now, kept, now)
        current.deadline = now + (deadline - server_now)
        if current.waited is None and self._queued_other(prefix, token):
            current.waited = now

    def _queued_other(self, prefix: bytes, token: str) -> bool:
        """Whether another token than `token` has a live entry in the name's queue."""
        zset = self.net.value(prefix + b"waiters")
        now_ms = self.net.now_ms()
        return any(
            score >= now_ms and member.split(b":")[0].decode() != token
            for score, member in getattr(zset, "_byscore", ())
        )

    def _check_grantee(self, key: bytes, token: str, owner: Proc | None, ttl: float) -> None:
        """A dead process's queue entries outlive its last heartbeat by their ttl (the
        lease a grant gives is that ttl), on the server's clock: granted later than that
        after the process died, an entry was not purged."""
        crashed = getattr(owner, "crashed_at", None)
        if owner is None or crashed is None:
            return
        late = self.world.loop.time() - crashed
        back = sum(s for at, s in self.net.clock_steps if at >= crashed - ttl)
        if late > ttl + back + 0.05:
            self.violation(
                ("dead", key.decode()),
                f"DEAD GRANT: {key.decode()!r} granted to {owner.name}'s token {token[:8]} "
                f"{late:.3f} s after {owner.name} died (its queue entries live {ttl:g} s)",
            )

    def _check_fence(self, key: bytes) -> None:
        value = self._fence(key)
        if value is None:
            return
        last = self.fences.get(key)
        if last is not None and value < last:
            self.world.violate(
                f"FENCE DOWN on {key.decode()!r}: the counter went from {last} to {value}"
            )
        self.fences[key] = value

    # -- the holders -------------------------------------------------------------------

    def granted(self, hold: Hold) -> None:
        self.live.append(hold)
        for lease in hold.leases:
            self.by_lease.setdefault(id(lease), []).append(hold)
        self.check_hold(hold, "granted")

    def validity_set(self, lease: Any) -> None:
        """The engine moved a lease's validity (a grant, a renewal's reply)."""
        for hold in self.by_lease.get(id(lease), ()):
            if self._live(hold, self.world.loop.time()):
                self.check_hold(hold, "validity moved")

    def step(self, what: str) -> None:
        """Every believing holder owns its names on the server, now."""
        now = self.world.loop.time()
        kept = []
        for hold in self.live:
            if self._live(hold, now):
                kept.append(hold)
                if self.world.believed(hold, now):
                    self._owns(hold, what)
        self.live = kept

    def _live(self, hold: Hold, now: float) -> bool:
        if hold.released_at is not None and hold.released_at <= now:
            return False
        lost = hold.lost_at()
        if lost is not None and lost <= now:
            return False
        return not getattr(hold.proc, "crashed_at", None) and hold.taken_away is None

    def check_hold(self, hold: Hold, what: str) -> None:
        now = self.world.loop.time()
        if not self.world.believed(hold, now):
            return
        self._owns(hold, what)
        keys = {lease_key(hold.kind, name): name for name in hold.names}
        for lease in hold.leases:
            key = bytes(lease.keys[0]) if lease.keys else b""
            name = keys.get(key)
            if name is None:
                self.violation(
                    (id(hold), "key"),
                    f"LEASE KEY of {_who(hold)}: renews {key!r}, not one of {sorted(keys)}",
                )
                continue
            exts = self.ext.get((key, hold.token))
            if not exts:
                if not self._restart_excuse(hold, lease):
                    self.violation(
                        (id(hold), "nogrant"),
                        f"VALIDITY of {_who(hold)} on {name!r}: believed until "
                        f"{lease.valid_until - 1000:.4f} with no grant of its token on the server",
                    )
                continue
            bound = validity(max(e.basis for e in exts), hold.ttl)
            if lease.valid_until > bound + _EPS and not self._restart_excuse(hold, lease):
                self.violation(
                    (id(hold), f"valid {name}"),
                    f"VALIDITY of {_who(hold)} on {name!r} ({what}): believed until "
                    f"{lease.valid_until - 1000:.4f}, but its last grant or renewal on the "
                    f"server was written at {max(e.basis for e in exts) - 1000:.4f}: "
                    f"valid until {bound - 1000:.4f} (ttl {hold.ttl:g})",
                )
            last = exts[-1]
            if last.lease < hold.ttl - 0.0021:  # (a set's deadlines are in whole ms)
                self.violation(
                    (id(hold), f"short {name}"),
                    f"SHORT LEASE of {_who(hold)} on {name!r}: the server gave "
                    f"{last.lease:.4f} s at {last.run - 1000:.4f}, its ttl is {hold.ttl:g} s",
                )

    def _owns(self, hold: Hold, what: str) -> None:
        server_now = self.net.server_time()
        for name in hold.names:
            deadline = self.holders(lease_key(hold.kind, name)).get(hold.token)
            if deadline is not None and deadline > server_now:
                continue
            if any(self._restart_excuse(hold, lease) for lease in hold.leases):
                continue
            valid = min((lease.valid_until for lease in hold.leases), default=0.0)
            self.violation(
                (id(hold), f"owner {name}"),
                f"OWNERLESS BELIEF ({what}): {_who(hold)} believes it holds {name!r} "
                f"(valid until {valid - 1000:.4f}) but the server "
                + ("has no lease of its token" if deadline is None else "ended its lease"),
            )

    def server_ran(self, hold: Hold) -> float:
        """When the server ran what `hold`'s belief rests on, by its own record: for each
        name, its token's last grant or extension run by the time the holding began; the
        oldest of them (the holding's start if there is none)."""
        runs = []
        for name in hold.names:
            exts = self.ext.get((lease_key(hold.kind, name), hold.token), ())
            ran = [e.run for e in exts if e.run <= hold.start]
            if ran:
                runs.append(max(ran))
        return min(runs, default=hold.start)

    def _restart_excuse(self, hold: Hold, lease: Any) -> bool:
        """The documented gap of a restart without persistence: a holder granted before it
        believes until its next renewal tells it otherwise, a third of its ttl after the
        server answers again (its loop's stalls added), or up to its validity's end if a
        fault of its own slowed that renewal. A validity counted from a request answered
        after the restart is never excused. Both go by when the request that set the
        validity was written, not by when the holder heard back: a grant or renewal the
        server ran before the restart, its reply or message late past it, still counts."""
        starts = self.net.restart_starts
        if not starts:
            return False
        history = self.world.recorder.validity.get(id(lease), [])
        written = history[-1][1] - validity(0.0, hold.ttl) if history else hold.start
        now = self.world.loop.time()
        for start, answers in zip(starts, self.net.restarts, strict=True):
            if written < answers:
                gap = hold.ttl / 3 + 0.5 + hold.proc.stalled_between(start, now)
                # (its own faults may hold its next renewal's answer off to the validity's end)
                if now <= answers + gap or self.world.troubled(hold.proc, start - TROUBLE_BEFORE):
                    return True
        return False

    def violation(self, key: tuple[Any, str], text: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            self.world.violate(text)

    # -- after the run ------------------------------------------------------------------

    def server_end(self, hold: Hold) -> float | None:
        """Until when `hold` may believe by the server's record: from the last grant or
        renewal written before it began, through each next one written in time."""
        ends = []
        for name in hold.names:
            exts = sorted(
                self.ext.get((lease_key(hold.kind, name), hold.token), ()), key=lambda e: e.basis
            )
            first = [e for e in exts if e.basis <= hold.start]
            if not first:
                return None
            end = validity(first[-1].basis, hold.ttl)
            for e in exts:
                if e.basis <= first[-1].basis:
                    continue
                if e.basis >= end:
                    break
                end = max(end, validity(e.basis, hold.ttl))
            ends.append(end)
        return min(ends, default=None)

    def check_losses(self, slack: float, end_of_run: float) -> None:
        """Each holder was told of its loss (or had let go) by its validity as computed
        here plus `slack` (the time its loop was stalled does not count)."""
        for hold in self.world.holds:
            if hold.detached or hold.taken_away is not None:
                continue
            end = self.server_end(hold)
            if end is None:
                continue
            due = end + slack + hold.proc.stalled_between(end, end + 30)
            if due >= end_of_run - 1:
                continue
            marks = [hold.released_at, hold.lost_at(), getattr(hold.proc, "crashed_at", None)]
            if any(m is not None and m <= due for m in marks):
                continue  # (no excuse for a restart: the validity ends anyway)
            lost = hold.lost_at()
            late = "never" if lost is None else f"{lost - end:.3f} s after it"
            self.world.violate(
                f"LATE LOSS (server) {_who(hold)} {hold.names}: its last renewal on the "
                f"server ran out at {end - 1000:.4f}; told of the loss {late}"
            )

    def check_fairness(self, end_of_run: float) -> None:
        """EXTRA WAIT: while another token waited in a name's queue, a cohort's token passed
        it on locally only within the stated bound (see the module's docstring)."""
        for tenure in self.tenures + list(self.tenure.values()):
            if "+" not in tenure.token or tenure.waited is None:
                continue  # not a cohort's, or nobody else waited meanwhile
            end = min(tenure.end, end_of_run)
            holds = sorted(
                (
                    h
                    for h in self.world.holds
                    if h.token == tenure.token
                    and tenure.name in h.names
                    and tenure.start <= h.start <= end
                ),
                key=lambda h: h.start,
            )
            if not holds or any(h.adopted or h.detached for h in holds):
                continue  # (a lease handed over is the adopter's, not the cohort's)
            count = int(tenure.token.rsplit("+", 1)[1]) - 1  # its block: local_handoff + 1
            came = tenure.start if tenure.kept else holds[0].start
            told = self._told(holds[0].proc, tenure)
            since = max(came, told)
            for i, hold in enumerate(holds[1:], 1):
                if hold.start <= tenure.waited:
                    continue
                proc = hold.proc
                chain = hold.start - since - proc.stalled_between(since, hold.start)
                after = holds[i - 1]
                held = hold.start - after.start - proc.stalled_between(after.start, hold.start)
                # (a long holding bars a pass only once the news is in: before, nobody is
                # known to wait elsewhere, and the chain may stay whatever its holdings last)
                news_in = hold.start - told - proc.stalled_between(told, hold.start) > FAIR_SLACK
                why = ""
                if i > count:
                    why = f"the {i + 1}th holding in a row (local_handoff={count})"
                elif chain > FAIR_TIME + FAIR_SLACK:
                    why = f"{chain * 1000:.1f} ms after the name came from Redis or the news"
                elif held > FAIR_TIME + FAIR_SLACK and news_in:
                    why = f"after a holding of {held * 1000:.1f} ms, the news in"
                if why:
                    waited = end - tenure.waited
                    self.violation(
                        (tenure.token, f"fair {tenure.name}"),
                        f"EXTRA WAIT on {tenure.name!r}: {_who(hold)} was passed it locally at "
                        f"{hold.start - 1000:.4f}, {why}, while another waited in the queue "
                        f"since {tenure.waited - 1000:.4f} ({waited:.3f} s until the cohort "
                        f"let go; bound: {FAIR_TIME * 1000:g} ms of local holdings, at most "
                        f"{count}, plus the one under way)",
                    )
                    break

    def _told(self, proc: Proc, tenure: Tenure) -> float:
        """When the news that another token queued behind `tenure`'s reached `proc` (the
        first message, or reset that lost one, from the tenure's first waiter on); when
        none was sent, the queueing itself (the cohort must then count from its chain's
        start)."""
        assert tenure.waited is not None
        arrivals = self.net.announced.get((proc, tenure.token), ())
        return min((at for at in arrivals if at >= tenure.waited - _EPS), default=tenure.waited)


def _keys_of(fields: list[bytes]) -> list[bytes]:
    """The keys a command names (a script's KEYS, or a plain command's first argument)."""
    if not fields:
        return []
    name = fields[0].upper()
    if name in (b"EVALSHA", b"EVAL"):
        if len(fields) > 2 and fields[2].isdigit():
            return fields[3 : 3 + int(fields[2])]
        return []
    return fields[1:2]


def _who(hold: Hold) -> str:
    fences = ",".join(str(f) for f in hold.fences.values())
    return f"{hold.proc.name}/{hold.task} {hold.kind} fence={fences} token={hold.token[:8]}"
