"""`RedisRateLimiter`: at most `rate` permits per `per` seconds across every process (GCRA).

One string key per name holds the theoretical arrival time (the generic cell rate
algorithm), so a call costs one script call whatever the traffic, and the server's clock
decides. A caller that must wait reserves its slot in that call and sleeps until it: no
command while waiting, and slots are handed out in arrival order.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Self, final

from ._base import _telemetry
from ._base._adapter import text
from ._base._clients import AnyRedis, ensure_async_client
from ._base._errors import LimitMismatch, LockTimeout, map_redis_errors
from ._base._keys import DEFAULT_PREFIX, KeySpace, validate_name, validate_prefix
from ._base._query import AsyncWithOnly
from ._engine._context import ClientContext, context_for
from ._engine._release import InFlight, shielded
from ._engine._settings import validate_int, validate_timeout
from ._scripts import load

__all__ = [
    "Limit",
    "RateLimiterInfo",
    "RateLimiterStatistics",
    "RedisRateLimiter",
    "validate_cost",
    "validate_settings",
]

_ACQUIRE = load("ratelimit_acquire", "ratelimit", prelude=False)
_GIVE_BACK = load("ratelimit_give_back", "ratelimit", prelude=False)
_INSPECT = load("ratelimit_inspect", "ratelimit", prelude=False)
_SET = load("ratelimit_set", "ratelimit", prelude=False)

MAX_BURST = 2**31 - 1
# Limits on one name at most (each adds four arguments and a few operations per call).
MAX_LIMITS = 16
# The scripts count whole microseconds per permit.
MAX_RATE = 1_000_000
# The longest a burst may span (burst x interval), in microseconds: the scripts' integer
# arithmetic on server microseconds (about 1.8e15) stays exact below 2^53.
_MAX_SPAN_US = 2**50
# How long a cancelled wait's give-back (the reservation's reply, then the compare-and-set)
# may hold its CancelledError back, at most; past it the slot is lost (never exceeded).
_GIVE_BACK_BOUND = 5.0


# (rate, per, burst, µs per permit) of one limit, validated
Settings = tuple[float, float, int, int]


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of a `RedisRateLimiter` (`limits=[...]`): `rate` permits per `per`
    seconds; without `burst`, at most `rate` in any window of `per` seconds, with it, at
    most `burst` at once and `burst + rate * t / per` in any t. Validated when made."""

    rate: float
    per: float = 1.0
    burst: int | None = None

    def __post_init__(self) -> None:
        validate_settings(self.rate, self.per, self.burst)


@dataclass(frozen=True, slots=True)
class RateLimiterStatistics:
    """A cheap local snapshot of one `RedisRateLimiter` instance (no Redis call)."""

    name: str
    rate: float
    per: float
    burst: int
    acquisitions: int  # acquire() calls granted (cumulative)
    permits: int  # permits those calls were granted (their costs added up)
    refusals: int  # tries refused at once (blocking=False, or timeout=0)
    timeouts: int  # acquire(timeout=t) calls whose slot was later than t
    waiting: int  # calls sleeping until their slot now
    given_back: int  # waits cancelled before their slot whose slot was given back
    slots_lost: int  # waits cancelled whose slot could not be given back (unused)


@dataclass(frozen=True, slots=True)
class RateLimiterInfo:
    """What the server says about a rate limiter (from `RedisRateLimiter.inspect()`)."""

    name: str
    rate: float | None  # the stored settings of the first limit (None: never used, or idle)
    per: float | None
    burst: int | None
    available: int  # permits that could be granted at once right now (by every limit)
    next_free_ms: int  # until a permit of cost 1 could be granted (0: now)
    reserved_ms: int  # until every reservation made is past (0: idle)
    limits: tuple[Limit, ...] = ()  # every stored limit, bursts as used (empty when idle)


@dataclass(frozen=True, slots=True)
class _SpecView:
    """What the telemetry hooks read of an instance (as of a lock's `Spec`)."""

    renew_keys: tuple[bytes, ...]
    counters: _telemetry.Counters


def _positive(value: object, what: str) -> Fraction:
    """`value` exactly as written (a float's shortest decimal, not its binary expansion:
    0.7 / 0.7 is 1), if it is a finite number > 0 that a float can hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, not {type(value).__name__}")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        finite = False
    if not finite or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return Fraction(value) if isinstance(value, int) else Fraction(repr(value))


def validate_settings(rate: object, per: object, burst: object) -> Settings:
    """(rate, per, burst, microseconds per permit) if they can be a limiter's settings.
    Raises `TypeError`/`ValueError` naming the argument otherwise. Computed exactly
    (fractions): settings with the same ratio give the same interval.

    With `burst` given: GCRA with that burst and one permit every `per / rate` seconds
    (rounded up to the microsecond: never faster), at most `burst + rate * t / per` over
    any t. Without (`burst` None): the window reading, at most `rate` permits in any
    window of `per` seconds, bursts included (see `window_settings`)."""
    exact_rate = _positive(rate, "rate")
    exact_per = _positive(per, "per")
    if exact_rate / exact_per > MAX_RATE:
        raise ValueError(
            f"rate / per must be at most {MAX_RATE:,} per second (one permit per µs), got "
            f"{rate!r} / {per!r}"
        )
    if burst is None:
        burst, interval = window_settings(exact_rate, exact_per)
    else:
        burst = validate_int(burst, "burst", 1, MAX_BURST)
        interval = math.ceil(exact_per * 1_000_000 / exact_rate)
    if interval * burst > _MAX_SPAN_US:
        raise ValueError(
            f"per / rate x burst must be at most {_MAX_SPAN_US / 1e6:.0f} s, got "
            f"{per!r} / {rate!r} x {burst}"
        )
    return float(exact_rate), float(exact_per), burst, interval


def window_settings(rate: Fraction, per: Fraction) -> tuple[int, int]:
    """(burst, microseconds per permit) of GCRA that grants at most `rate` permits in any
    window of `per` seconds (closed, on the server's clock), bursts included.

    `rate` below 1 is 1 permit per `per / rate` seconds; otherwise `rate` is rounded down
    (at most 2.5 in a second is at most 2). For n permits in a window of w: GCRA with
    burst b and interval T grants at most b + floor(w / T) in any closed window of w
    (docs/architecture.md shows why), so T, the smallest whole microsecond above
    w / (n - b + 1), keeps n; the burst is a twentieth of n (at least 1), so a busy
    window still gets n - b + 1 (95% of n or more) and the state stays one string."""
    if rate < 1:
        count, window = 1, per / rate
    else:
        count, window = math.floor(rate), per
    burst = min(MAX_BURST, max(1, count // 20))
    interval = math.floor(window * 1_000_000 / (count - burst + 1)) + 1
    return burst, interval


def validate_limits(
    rate: object, per: object, burst: object, limits: Iterable[Limit] | None
) -> tuple[Settings, ...]:
    """(rate, per, burst, µs per permit) of each limit: `rate`, `per`, `burst` for one, or
    `limits` (1 to MAX_LIMITS of them), not both."""
    if limits is None:
        if rate is None:
            raise ValueError("give rate= (one limit) or limits= (several)")
        return (validate_settings(rate, per, burst),)
    if rate is not None or burst is not None or per != 1.0:
        raise ValueError("give rate=, per=, burst= (one limit) or limits=, not both")
    if isinstance(limits, (str, bytes, Limit)):
        raise TypeError(f"limits must be an iterable of Limit, not {type(limits).__name__}")
    given = list(limits)
    if not 1 <= len(given) <= MAX_LIMITS:
        raise ValueError(f"limits must hold 1..{MAX_LIMITS} Limit, got {len(given)}")
    for limit in given:
        if not isinstance(limit, Limit):
            raise TypeError(f"limits must hold Limit objects, not {type(limit).__name__}")
    return tuple(validate_settings(limit.rate, limit.per, limit.burst) for limit in given)


def validate_cost(cost: object, burst: int) -> int:
    """`cost` if it is a number of permits one call may take (1..burst); raises if not."""
    return validate_int(cost, "cost", 1, burst)


@final
class RedisRateLimiter(AsyncWithOnly):
    """At most `rate` permits per `per` seconds across every process using the name.

    Without `burst`: at most `rate` permits in any window of `per` seconds, bursts included
    (a twentieth of `rate` at once, at least 1; `window_settings`). With `burst`: over any
    interval of length t, at most `burst + rate * t / per`. Both counted across every
    process and client using the name with the same settings, on the server's clock; a
    granted caller never starts before its slot.

    - `acquire()` reserves the earliest slot in one script call and sleeps until it: no
      command while waiting; callers get their slots in the order their calls reached the
      server. A try that cannot be granted (`blocking=False`, or a slot later than
      `timeout`) reserves nothing.
    - A wait cancelled before its slot gives the slot back when no later reservation was
      made since; otherwise the slot is lost (unused): the limit is never exceeded.
    - `limits=[Limit(350, per=10.0), Limit(10_000, per=3600.0)]` instead of `rate`, `per`,
      `burst`: several limits on one name, all or nothing; a slot is granted only when
      every limit has it, in one script call, and a refused or cancelled try takes
      nothing from any of them.
    - The settings are stored with the name: using it with other limits raises
      `LimitMismatch` (nothing changes) until the stored state expires, one second after
      the last reservation's slot. `set_limits()` changes them live, keeping the state;
      every instance then adopts the limits it stored.
    - Permits are not released: a permit is a slot in time, not a holding.
    """

    __slots__ = (
        "_client",
        "_key",
        "_limits",
        "_most",
        "_name",
        "_settings",
        "_shown",
        "_spec",
        "_stamp",
        "_stats",
        "_timeout",
    )

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        rate: float | None = None,
        per: float = 1.0,
        burst: int | None = None,
        limits: Iterable[Limit] | None = None,
        timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self._client = ensure_async_client(client)
        self._name = validate_name(name)
        self._configure(validate_limits(rate, per, burst, limits), 0)
        self._timeout = validate_timeout(timeout)
        self._key = KeySpace(validate_prefix(prefix), "ratelimit", self._name).key("state")
        self._spec = _SpecView((self._key,), _telemetry.Counters())
        # permits, refusals, waiting, given_back, slots_lost
        self._stats = [0, 0, 0, 0, 0]

    def _configure(self, limits: tuple[Settings, ...], stamp: int) -> None:
        """Use `limits`, set by `set_limits()` at server time `stamp` (0: the constructor's)."""
        self._limits = limits
        self._most = min(burst for _, _, burst, _ in limits)  # the largest cost
        self._settings = _arguments(limits)
        self._shown = tuple((rate, per, burst) for rate, per, burst, _ in limits)
        self._stamp = stamp

    def _adopt(self, state: bytes | str) -> None:
        """Use the limits stored in `state` (set by `set_limits()`, newer than this
        instance's): the stored settings win (see `set_limits`)."""
        fields = text(state).split(" ")
        stamp = int(fields.pop(0)[1:]) if fields[0].startswith("=") else 0
        self._configure(
            tuple(
                (
                    float(fields[at + 4]),
                    float(fields[at + 5]),
                    int(fields[at + 3]),
                    int(fields[at + 2]),
                )
                for at in range(0, len(fields), 6)
            ),
            stamp,
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def rate(self) -> float:
        """The first limit's rate (the only one unless `limits` was given)."""
        return self._limits[0][0]

    @property
    def per(self) -> float:
        return self._limits[0][1]

    @property
    def burst(self) -> int:
        return self._limits[0][2]

    @property
    def limits(self) -> tuple[Limit, ...]:
        """Every limit, with the burst each uses (computed when not given)."""
        return tuple(Limit(rate, per, burst) for rate, per, burst, _ in self._limits)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"rate={rate:g} per={per:g} burst={burst}" for rate, per, burst, _ in self._limits
        )
        return f"<RedisRateLimiter {self._name!r} {shown}>"

    def _current(self) -> None:
        """No holding: a permit is a slot in time (for the telemetry hooks)."""
        return None

    # -- acquire -------------------------------------------------------------------------

    async def acquire(
        self, blocking: bool = True, timeout: float | None = None, *, cost: int = 1
    ) -> bool:
        """Wait for `cost` permits; True once granted, False when not granted.

        `blocking=False` (or `timeout=0`) is one try: False at once, reserving nothing,
        when the permits are not free now. With `timeout`, False at once (reserving
        nothing) when the earliest slot is later than `timeout` seconds from now; otherwise
        the slot is reserved and the call sleeps until it. A cancellation while sleeping
        gives the slot back when no later reservation was made since.
        """
        return await self._acquire(blocking, timeout, cost) is None

    async def _acquire(self, blocking: bool, timeout: float | None, cost: int) -> float | None:
        """`acquire()`, observed: None when granted, else seconds until the slot asked for
        (what an HTTP `Retry-After` says)."""
        timeout = validate_timeout(timeout)
        if not blocking and timeout is not None:
            raise ValueError("a timeout cannot be given with blocking=False")
        validate_cost(cost, self._most)
        if not blocking:
            timeout = 0.0
        refused: list[float] = []
        counters = self._spec.counters
        limit = _telemetry.LimitCall(self._shown)

        async def call(_blocking: bool, _timeout: float | None) -> bool:
            wait = await self._reserve(timeout, cost, limit)
            if wait is None:
                counters.acquisitions += 1
                return True
            refused.append(wait)
            if timeout != 0:  # one try refused is busy, not a timeout
                counters.timeouts += 1
            return False

        try:
            if _telemetry.recorder is not None:
                await _telemetry.observe(self, blocking, timeout, call, limit)
            else:
                await call(blocking, timeout)
        finally:
            if refused and timeout == 0:
                self._stats[1] += 1
        return refused[0] if refused else None

    async def _reserve(
        self, timeout: float | None, cost: int, limit: _telemetry.LimitCall
    ) -> float | None:
        """One script call; then, if reserved, sleep until the slot. Says in `limit` which
        limit set the slot and how far it was."""
        context = context_for(self._client)
        max_wait = -1 if timeout is None else math.floor(timeout * 1e6)
        args = (cost, max_wait, self._stamp, *self._settings)
        loop = asyncio.get_running_loop()
        # The call runs in a task of its own: a cancellation meanwhile must not lose the
        # reply, which the give-back needs.
        in_flight = InFlight(self._call(context, args))
        try:
            reply = await in_flight.reply()
        except asyncio.CancelledError:
            await self._give_back(context, in_flight, cost)
            raise
        # The slot is `delay` after the server ran the script, which was before its reply
        # came: counted from the reply, the sleep never ends before the slot on the server.
        replied = loop.time()
        status = int(reply[0])
        if status < 0:
            raise self._refusal(reply, cost)
        if status >= 2:  # under the stored limits, newer than this instance's: use them
            self._adopt(reply[2 if status == 2 else 3])
            limit.limits = self._shown
        delay = int(reply[1])
        binding = int(reply[2 if status in (0, 3) else 5])
        limit.binding, limit.delay = (binding - 1 if binding else None), delay / 1e6
        if status in (0, 3):
            return delay / 1e6
        if delay > 0:
            self._stats[2] += 1
            try:
                await asyncio.sleep(replied + delay / 1e6 - loop.time())
            except asyncio.CancelledError:
                await self._give_back(context, in_flight, cost)
                raise
            finally:
                self._stats[2] -= 1
        self._stats[0] += cost
        return None

    async def _call(self, context: ClientContext, args: tuple[Any, ...]) -> list[Any]:
        with map_redis_errors(self._name):
            # Not retried: a reservation run twice would take two slots (one lost).
            reply: list[Any] = await context.run(_ACQUIRE, (self._key,), args, retry=False)
        return reply

    async def _give_back(
        self, context: ClientContext, in_flight: InFlight[list[Any]], cost: int
    ) -> None:
        """Once the reservation's reply is in, give its slot back; awaited by the cancelled
        caller (shielded, at most `_GIVE_BACK_BOUND` seconds) before its CancelledError goes
        on, so that its own next reservation cannot land first and make the slot lost."""
        await shielded(lambda: self._giving_back(context, in_flight, cost), _GIVE_BACK_BOUND)

    async def _giving_back(
        self, context: ClientContext, in_flight: InFlight[list[Any]], cost: int
    ) -> None:
        reply = await in_flight.outcome()
        if reply is None:
            return  # no reply: whatever it reserved is lost, never exceeded
        if int(reply[0]) not in (1, 2):
            return  # refused: nothing was reserved
        written, before = reply[2], reply[6:]
        try:
            with map_redis_errors(self._name):
                # Not retried: run twice, a compare-and-set could match a later reservation.
                given = await context.run(_GIVE_BACK, (self._key,), (written, *before), retry=False)
        except Exception:
            given = 0
        self._stats[3 if int(given) == 1 else 4] += 1

    def _refusal(self, reply: list[Any], cost: int) -> Exception:
        """Why the script reserved nothing: other limits stored (-2), or a cost above the
        burst of the limits `set_limits()` stored, which this instance now uses (-3)."""
        if int(reply[0]) == -3:
            self._adopt(reply[1])
            return ValueError(
                f"cost must be in 1..{self._most} for {self._name!r} since set_limits() stored "
                f"{_shown(self._limits)}, got {cost}"
            )
        fields = [text(value) for value in reply[1:]]
        stored = ", ".join(
            f"rate={fields[at]} per={fields[at + 1]} burst={fields[at + 2]}"
            for at in range(0, len(fields), 3)
        )
        return LimitMismatch(
            self._name,
            f"stored with {stored}, used here with {_shown(self._limits)}; every user of a "
            "name must give the same settings (the stored ones expire once the name is idle), "
            "or change them with set_limits()",
        )

    # -- a change --------------------------------------------------------------------------

    async def set_limits(
        self,
        *,
        rate: float | None = None,
        per: float = 1.0,
        burst: int | None = None,
        limits: Iterable[Limit] | None = None,
    ) -> tuple[Limit, ...]:
        """Change the name's limits live, keeping its state, in one script call; returns
        the limits stored before (empty: the name was idle). Arguments as the constructor's.

        What was reserved still counts: each limit keeps the permits its predecessor (at
        the same place in the list) still counts, spaced by its own interval, so a stricter
        limit binds at once and a looser one gives no free burst; a limit added at a new
        place starts as full as the fullest stored limit was. Reservations already made
        keep their slots. The change is stamped with the server's clock: every instance
        using other limits with an older stamp adopts these at its next call (in that
        call), and one that saw a change stores it again if the name went idle meanwhile;
        see docs/ratelimit.md. A validation error changes nothing."""
        settings = validate_limits(rate, per, burst, limits)
        with map_redis_errors(self._name):
            # Retried: run twice, the second run carries the state over to the same limits.
            reply: list[Any] = await context_for(self._client).run(
                _SET, (self._key,), _arguments(settings), retry=True
            )
        self._configure(settings, int(reply[0]))
        fields = [text(value) for value in reply[1:]]
        return tuple(
            Limit(float(fields[at]), float(fields[at + 1]), int(fields[at + 2]))
            for at in range(0, len(fields), 3)
        )

    # -- async with ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        wait = await self._acquire(True, self._timeout, 1)
        if wait is not None:
            assert self._timeout is not None
            slot = f"the next free slot is in {wait:.3f} s"
            raise LockTimeout(self._name, self._timeout, slot, retry_after=wait)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None  # nothing to release: the permit was a slot in time

    # -- reading -------------------------------------------------------------------------

    def statistics(self) -> RateLimiterStatistics:
        """A cheap local snapshot of this instance (no Redis call)."""
        counters = self._spec.counters
        permits, refusals, waiting, given_back, lost = self._stats
        return RateLimiterStatistics(
            name=self._name,
            rate=self.rate,
            per=self.per,
            burst=self.burst,
            acquisitions=counters.acquisitions,
            permits=permits,
            refusals=refusals,
            timeouts=counters.timeouts,
            waiting=waiting,
            given_back=given_back,
            slots_lost=lost,
        )

    async def inspect(self) -> RateLimiterInfo:
        """The server's view: the stored settings, permits free now, the next free slot."""
        with map_redis_errors(self._name):
            reply: list[Any] = await context_for(self._client).run(_INSPECT, (self._key,), ())
        now = int(reply[0])
        if len(reply) == 1:
            return RateLimiterInfo(self._name, None, None, None, self._most, 0, 0)
        available, next_free, ahead = MAX_BURST, 0, 0
        limits = []
        for at in range(1, len(reply), 5):
            tat, interval, burst = (int(value) for value in reply[at : at + 3])
            limits.append(Limit(float(text(reply[at + 3])), float(text(reply[at + 4])), burst))
            reserved = max(tat - now, 0)  # reserved time not yet past
            room = burst * interval - reserved  # what a cost-n call may add without waiting
            available = min(available, max(0, room // interval))
            next_free = max(next_free, interval - room)
            ahead = max(ahead, reserved)
        return RateLimiterInfo(
            name=self._name,
            rate=limits[0].rate,
            per=limits[0].per,
            burst=limits[0].burst,
            available=available,
            next_free_ms=math.ceil(next_free / 1000),
            reserved_ms=math.ceil(ahead / 1000),
            limits=tuple(limits),
        )


def _arguments(limits: tuple[Settings, ...]) -> tuple[str, ...]:
    """The scripts' arguments for `limits`: interval, burst, rate, per of each."""
    return tuple(
        field
        for rate, per, burst, interval in limits
        for field in (str(interval), str(burst), repr(rate), repr(per))
    )


def _shown(limits: tuple[Settings, ...]) -> str:
    return ", ".join(f"rate={rate!r} per={per!r} burst={burst}" for rate, per, burst, _ in limits)
