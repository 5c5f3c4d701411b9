"""`RedisRateLimiter` on real servers: the GCRA bound across processes, waiting without
commands, arrival order, refusals and cancellations that reserve nothing, settings,
validation, wrong-type keys, expiry and Cluster."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from _cli import cli
from _cluster import Cluster
from _servers import arun_workers, command_count
from _web import ONE_SERVER
from redis.asyncio.cluster import RedisCluster

from aiolocks import Limit, LimitMismatch, LockTimeout, RedisRateLimiter, ServerUnavailable

WORKERS = Path(__file__).resolve().parent / "workers"
KEY = b"aiolocks:ratelimit:{api}:state"


def _most_in_window(slots: list[int], window_us: int) -> int:
    """Most slots within any closed window of `window_us` (the worst starts at a slot)."""
    ordered = sorted(slots)
    return max(
        bisect.bisect_right(ordered, start + window_us) - index
        for index, start in enumerate(ordered)
    )


# -- the contract across processes ---------------------------------------------------------


@pytest.mark.slow
async def test_bound_across_four_processes(r: redis.asyncio.Redis, url: str) -> None:
    """4 processes x 6 tasks hammer one name (rate 100/s, burst 10) for 3 s: in every
    sliding window of length t, at most burst + rate x t grants (on the server's clock);
    no grant is used before its slot; at least 90% of the rate is reached."""
    rate, per, burst, workers, tasks, seconds = 100, 1.0, 10, 4, 6, 3.0
    results = await arun_workers(
        str(WORKERS / "ratelimit_user.py"),
        [[str(arg) for arg in (url, "mp", rate, per, burst, workers, tasks, seconds)]] * workers,
        timeout=60,
    )
    grants: list[list[int]] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        line = [row for row in result.stdout.splitlines() if row.startswith("grants ")]
        assert len(line) == 1, result.stdout
        mine = json.loads(line[0].removeprefix("grants "))
        assert mine, f"worker {index} got no permit"
        grants += mine
    slots = [slot for slot, *_ in grants]
    interval_us = round(per * 1e6 / rate)
    figures = {}
    for window_us in (0, interval_us // 2, interval_us, 5 * interval_us, 250_000, 1_000_000):
        most = _most_in_window(slots, window_us)
        bound = burst + rate * window_us / (per * 1e6)
        figures[window_us] = (most, bound)
        assert most <= bound, (window_us, most, bound)
    early = [(slot, used) for slot, used, _ in grants if used < slot]
    assert not early, early[:5]
    span_s = (max(slots) - min(slots)) / 1e6
    reached = (len(slots) - burst) / span_s
    assert reached >= 0.9 * rate / per, (reached, span_s, len(slots), figures)
    # the burst was used at once, and the windows were full: the bound is not loose
    assert figures[1_000_000][0] >= 0.9 * figures[1_000_000][1], figures


@pytest.mark.slow
async def test_default_is_at_most_rate_in_any_window_across_four_processes(
    r: redis.asyncio.Redis, url: str
) -> None:
    """The default (no burst): at most `rate` grants in any window of `per` seconds, the
    burst included, counted on the server's clock across 4 processes x 6 tasks; and a busy
    window still gets at least 95% of `rate`. The issue's rate=100, per=60 scaled in time
    by 1/20 (rate=100, per=3: the same counts, burst 5 and 96 per window, in seconds)."""
    rate, per, workers, tasks, seconds = 100, 3.0, 4, 6, 7.0
    results = await arun_workers(
        str(WORKERS / "ratelimit_user.py"),
        [[str(arg) for arg in (url, "win", rate, per, "none", workers, tasks, seconds)]] * workers,
        timeout=60,
    )
    slots: list[int] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        line = [row for row in result.stdout.splitlines() if row.startswith("grants ")]
        assert len(line) == 1, result.stdout
        slots += [slot for slot, *_ in json.loads(line[0].removeprefix("grants "))]
    window_us = round(per * 1e6)
    most = _most_in_window(slots, window_us)
    ordered = sorted(slots)
    busy = [
        bisect.bisect_right(ordered, start + window_us) - index
        for index, start in enumerate(ordered)
        if start + window_us <= ordered[-1]
    ]
    print(f"window test: {len(slots)} grants, most in any {per:g} s window {most}", end="")
    print(f", least in a busy one {min(busy) if busy else None}")
    assert most <= rate, (most, len(slots))
    assert busy and min(busy) >= 0.95 * rate, (min(busy), most, len(slots))
    # the start: the burst (5) at once (the 6th is 31 ms later), the window filled to its bound
    assert _most_in_window(slots, 15_000) == 5 and most == rate, (most, len(slots))


@pytest.mark.slow
async def test_several_limits_across_four_processes(r: redis.asyncio.Redis, url: str) -> None:
    """4 processes x 6 tasks on two limits for 6 s, counted on the server's clock: at most
    20 in any 1 s window (the default's window reading), at most 40 + 5 t in any t (an
    explicit burst); each reached while it binds: the first 2 s at 20 a second (the
    second's burst not spent yet), the last 2 s at 5 a second."""
    limits = [[20, 1.0, None], [5, 1.0, 40]]
    workers, tasks, seconds = 4, 6, 6.0
    results = await arun_workers(
        str(WORKERS / "ratelimit_user.py"),
        [[url, "two", "0", "0", json.dumps(limits), *map(str, (workers, tasks, seconds))]]
        * workers,
        timeout=60,
    )
    slots: list[int] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        line = [row for row in result.stdout.splitlines() if row.startswith("grants ")]
        slots += [slot for slot, *_ in json.loads(line[0].removeprefix("grants "))]
    ordered = sorted(slots)
    figures = {t: _most_in_window(slots, t) for t in (0, 500_000, 1_000_000, 2_000_000, 4_000_000)}
    print(f"two limits: {len(slots)} grants, most in windows (µs): {figures}")
    assert figures[1_000_000] <= 20, figures  # the first limit
    for window_us, most in figures.items():
        assert most <= 40 + 5 * window_us / 1e6, figures  # the second
    first_two = bisect.bisect_right(ordered, ordered[0] + 2_000_000)
    last_two = len(ordered) - bisect.bisect_left(ordered, ordered[-1] - 2_000_000)
    assert first_two >= 0.95 * 40 and figures[1_000_000] == 20, (first_two, figures)
    assert last_two >= 0.9 * 10, (last_two, figures)


# -- one process ----------------------------------------------------------------------------


async def test_burst_then_refusals_reserve_nothing(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=10, per=1.0, burst=3)
    assert [await limiter.acquire(blocking=False) for _ in range(3)] == [True] * 3
    state = await r.get(KEY)
    assert not await limiter.acquire(blocking=False)
    assert not await limiter.acquire(timeout=0)
    assert not await limiter.acquire(timeout=0.02)  # the next slot is ~100 ms away
    assert not await limiter.acquire(blocking=False, cost=2)
    assert await r.get(KEY) == state  # nothing reserved, nothing changed
    stats = limiter.statistics()
    assert (stats.acquisitions, stats.permits, stats.refusals, stats.timeouts) == (3, 3, 3, 1)
    info = await limiter.inspect()
    assert (info.rate, info.per, info.burst, info.available) == (10.0, 1.0, 3, 0)
    assert 0 < info.next_free_ms <= 100 and 0 < info.reserved_ms <= 300, info


async def test_waiting_sends_no_command(r: redis.asyncio.Redis) -> None:
    """A caller whose slot is ~1 s away: one script call, then nothing until its slot."""
    limiter = RedisRateLimiter(r, "api", rate=1, per=1.0, burst=1)
    assert await limiter.acquire()
    before = await command_count(r)
    started = time.monotonic()
    assert await limiter.acquire()
    waited = time.monotonic() - started
    after = await command_count(r)
    assert waited >= 0.8, waited  # it did wait for its slot (1 s after the first's)
    # The EVALSHA and the commands its script ran (GET, TIME, SET), and the first INFO.
    assert after - before == 5, after - before


async def test_arrival_order_is_grant_order(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=50, per=1.0, burst=1)
    order: list[int] = []

    async def user(index: int) -> None:
        assert await limiter.acquire()
        order.append(index)

    tasks = []
    for index in range(15):
        tasks.append(asyncio.create_task(user(index)))
        await asyncio.sleep(0)  # each call made (and sent) after the one before
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == list(range(15))


async def test_cancelled_wait_gives_its_slot_back(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=5, per=1.0, burst=1)
    assert await limiter.acquire()
    before = (await r.get(KEY) or b"").split()[0]
    waiting = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.05)  # reserved (~200 ms away) and sleeping
    assert limiter.statistics().waiting == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await r.get(KEY) or b"").split()[0] == before  # the same slot is free again
    assert limiter.statistics().given_back == 1


async def test_cancelled_wait_gives_its_slot_back_before_its_cancellation_returns(
    r: redis.asyncio.Redis,
) -> None:
    """The issue's case (rate 1/s, burst 1): the slot a cancelled wait reserved is back by
    the time its CancelledError reaches the caller, so the caller's next try gets it (a
    wait of ~0.8 s; 1.8 s when the give-back ran after the next reservation)."""
    limiter = RedisRateLimiter(r, "api", rate=1, per=1.0, burst=1)
    assert await limiter.acquire()
    before = (await r.get(KEY) or b"").split()[0]
    waiting = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert (await r.get(KEY) or b"").split()[0] == before  # already given back
    assert limiter.statistics().given_back == 1
    started = time.monotonic()
    assert await limiter.acquire(timeout=3)
    waited = time.monotonic() - started
    assert waited <= 1.0 + 0.3, waited  # ~0.8 s: its slot, not the one after it


async def test_cancelled_wait_with_a_later_reservation_loses_its_slot(
    r: redis.asyncio.Redis,
) -> None:
    limiter = RedisRateLimiter(r, "api", rate=5, per=1.0, burst=1)
    assert await limiter.acquire()
    first = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.02)
    second = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.05)
    state = await r.get(KEY)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await r.get(KEY) == state  # the later reservation stands; the slot is lost
    assert limiter.statistics().slots_lost == 1
    started = time.monotonic()
    assert await asyncio.wait_for(second, 2)
    assert time.monotonic() - started >= 0.2  # still its own slot (400 ms after the first)


async def test_async_with_waits_and_times_out(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=4, per=1.0, burst=1, timeout=0.1)
    async with limiter:
        pass
    with pytest.raises(LockTimeout, match=r"not acquired within 0\.1 s"):
        async with limiter:
            pass


async def test_cost_takes_several_permits(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=10, per=1.0, burst=5)
    assert await limiter.acquire(blocking=False, cost=4)
    assert await limiter.acquire(blocking=False)
    assert not await limiter.acquire(blocking=False)
    assert limiter.statistics().permits == 5


async def test_settings_mismatch_is_refused(r: redis.asyncio.Redis) -> None:
    assert await RedisRateLimiter(r, "api", rate=10, burst=10).acquire()
    state = await r.get(KEY)
    for other in (
        RedisRateLimiter(r, "api", rate=20, burst=10),
        RedisRateLimiter(r, "api", rate=10, burst=3),
        RedisRateLimiter(r, "api", rate=10, per=2.0, burst=10),
        RedisRateLimiter(r, "api", rate=10),  # the default: at most 10 in any second
    ):
        with pytest.raises(LimitMismatch, match=r"stored with rate=10\.0 per=1\.0 burst=10"):
            await other.acquire()
    assert await r.get(KEY) == state
    # the same limit written otherwise is the same limit
    assert await RedisRateLimiter(r, "api", rate=600, per=60, burst=10).acquire()
    assert await RedisRateLimiter(r, "api", rate=0.7, per=0.07, burst=10).acquire()


async def test_default_settings_are_the_window_reading(r: redis.asyncio.Redis) -> None:
    """No burst: at most `rate` in any window of `per`: a twentieth of it at once (at
    least 1), then one permit a little more often than every per / (rate - burst + 1)."""
    client = redis.asyncio.Redis(port=1)
    figures = {
        (rate, per): (limiter.burst, limiter._limits[0][3])
        for rate, per in ((100, 60), (10, 1), (1, 1), (0.5, 1), (2.5, 1), (350, 10))
        for limiter in [RedisRateLimiter(client, "api", rate=rate, per=per)]
    }
    assert figures == {
        (100, 60): (5, 625_001),  # 5 + floor(60 s / 625,001 µs) = 5 + 95 = 100
        (10, 1): (1, 100_001),
        (1, 1): (1, 1_000_001),
        (0.5, 1): (1, 2_000_001),  # 1 in any 2 s
        (2.5, 1): (1, 500_001),  # 2 in any second
        (350, 10): (17, 29_941),
    }
    limiter = RedisRateLimiter(r, "api", rate=100, per=60)
    assert [await limiter.acquire(blocking=False) for _ in range(6)] == [True] * 5 + [False]


async def test_key_expires_once_idle(r: redis.asyncio.Redis) -> None:
    limiter = RedisRateLimiter(r, "api", rate=10, per=1.0, burst=2)
    assert await limiter.acquire(cost=2)
    left = await r.pttl(KEY)
    assert 1000 < left <= 1200, left  # its slots end 200 ms from now, then 1 s of margin
    await asyncio.sleep(left / 1000 + 0.05)  # one check after the announced expiry
    assert await r.exists(KEY) == 0
    info = await limiter.inspect()
    assert (info.rate, info.burst, info.available, info.next_free_ms) == (None, None, 2, 0)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"rate": 0}, ValueError, "rate must be a finite number > 0"),
        ({"rate": -1.5}, ValueError, "rate must be a finite number > 0"),
        ({"rate": float("inf")}, ValueError, "rate must be a finite number > 0"),
        ({"rate": "10"}, TypeError, "rate must be a number"),
        ({"rate": True}, TypeError, "rate must be a number"),
        ({"rate": 10, "per": 0}, ValueError, "per must be a finite number > 0"),
        ({"rate": 10, "per": -1}, ValueError, "per must be a finite number > 0"),
        ({"rate": 10, "burst": 0}, ValueError, r"burst must be in 1\.\."),
        ({"rate": 10, "burst": 2.0}, TypeError, "burst must be an int"),
        ({"rate": 10, "timeout": -1}, ValueError, "timeout must be >= 0"),
        ({"rate": 10, "prefix": ""}, ValueError, "prefix must not be empty"),
        ({"rate": 1e-9, "per": 1e9}, ValueError, "per / rate x burst must be at most"),
        ({"rate": 2e6}, ValueError, "rate / per must be at most 1,000,000 per second"),
    ],
)
def test_bad_settings_fail_at_construction(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    client = redis.asyncio.Redis(port=1)  # nothing listens: any call would fail otherwise
    with pytest.raises(error, match=match):
        RedisRateLimiter(client, "api", **options)


def test_bad_name_and_client_fail_at_construction() -> None:
    client = redis.asyncio.Redis(port=1)
    with pytest.raises(ValueError, match="must not contain"):
        RedisRateLimiter(client, "a{b}", rate=1)
    with pytest.raises(ValueError, match="name must not be empty"):
        RedisRateLimiter(client, "", rate=1)
    with pytest.raises(TypeError, match="client must be"):
        RedisRateLimiter(object(), "api", rate=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        ({"cost": 0}, ValueError, r"cost must be in 1\.\.3"),
        ({"cost": 4}, ValueError, r"cost must be in 1\.\.3"),
        ({"cost": 1.0}, TypeError, "cost must be an int"),
        ({"timeout": -0.5}, ValueError, "timeout must be >= 0"),
        ({"blocking": False, "timeout": 1}, ValueError, "cannot be given with blocking=False"),
    ],
)
async def test_bad_calls_fail_before_any_redis_call(
    r: redis.asyncio.Redis, call: dict[str, Any], error: type[Exception], match: str
) -> None:
    limiter = RedisRateLimiter(r, "api", rate=10, burst=3)
    before = await command_count(r)
    with pytest.raises(error, match=match):
        await limiter.acquire(**call)
    assert await command_count(r) == before + 1  # only the first INFO


@pytest.mark.parametrize("kind", ["hash", "string"])
async def test_wrong_type_key_fails_and_changes_nothing(r: redis.asyncio.Redis, kind: str) -> None:
    if kind == "hash":
        await r.hset(KEY, "field", "value")
        match = "holds a hash, not a string"
    else:
        await r.set(KEY, "not ours")
        match = "holds a string that is not a rate limiter state"
    dumped = await r.dump(KEY)
    limiter = RedisRateLimiter(r, "api", rate=10)
    with pytest.raises(ServerUnavailable, match=match):
        await limiter.acquire()
    with pytest.raises(ServerUnavailable, match=match):
        await limiter.inspect()
    assert await r.dump(KEY) == dumped


# -- Cluster --------------------------------------------------------------------------------


async def test_cluster(cluster: Cluster, cluster_r: RedisCluster) -> None:
    names = [f"api:{index}" for index in range(6)]  # spread over the nodes' slots
    limiters = [RedisRateLimiter(cluster_r, name, rate=20, burst=2) for name in names]
    for limiter in limiters:
        assert await limiter.acquire(blocking=False)
        assert await limiter.acquire(blocking=False)
        assert not await limiter.acquire(blocking=False)
    started = time.monotonic()
    assert all(await asyncio.gather(*(limiter.acquire() for limiter in limiters)))
    assert time.monotonic() - started >= 0.04  # each waited ~50 ms for its slot
    info = await limiters[0].inspect()
    assert (info.rate, info.burst) == (20.0, 2)


# -- the command line ----------------------------------------------------------------------


@ONE_SERVER
async def test_cli_inspect_and_list_show_the_next_slot_and_the_settings(
    r: redis.asyncio.Redis, url: str
) -> None:
    limiter = RedisRateLimiter(r, "api", rate=100, per=60.0, burst=2)
    assert await limiter.acquire(cost=2)
    shown = await cli("inspect", "api", "--url", url, "--json")
    assert shown.code == 0, shown.err
    view = shown.json()
    assert view["kind"] == "ratelimit" and view["holders"] == [] and view["queue"] == []
    summary = view["summary"]
    assert (summary["rate"], summary["per"], summary["burst"]) == (100.0, 60.0, 2)
    assert summary["available"] == 0 and 0 < summary["next_free_ms"] <= 600, summary
    assert view["state"].startswith("next slot in ") and view["state"].endswith("100 per 60 s")

    table = await cli("inspect", "api", "--url", url)
    assert table.code == 0 and "next free slot" in table.out and "100 per 60 s" in table.out

    listed = await cli("list", "--url", url, "--json")
    assert [(row["kind"], row["name"]) for row in listed.json()] == [("ratelimit", "api")]
    assert listed.json()[0]["state"].endswith("100 per 60 s")
    assert "ratelimit" in (await cli("list", "--url", url)).out

    refused = await cli("release", "api", "--force", "--yes", "--url", url)
    assert refused.code != 0 and "is not a lock" in refused.err


# -- settings computed exactly ---------------------------------------------------------------


def test_settings_with_the_same_ratio_are_the_same_limit() -> None:
    """Every pair of decimal settings with one ratio gives one interval (float arithmetic
    gave 1,000,001 µs for rate=0.7, per=0.7 against 1,000,000 for 1/1)."""
    client = redis.asyncio.Redis(port=1)
    decimals = [n / 10 for n in range(1, 100)] + [n / 100 for n in range(1, 100, 7)]
    for ratio in (1, 2, 5, 10):
        intervals = {
            RedisRateLimiter(client, "api", rate=value * ratio, per=value, burst=1)._limits[0][3]
            for value in decimals
            if value * ratio == round(value * ratio, 2)  # the rate as written, too
        }
        assert intervals == {1_000_000 // ratio}, (ratio, intervals)
    assert (
        RedisRateLimiter(client, "api", rate=0.7, per=0.7, burst=1)._limits[0][3]
        == RedisRateLimiter(client, "api", rate=1, per=1, burst=1)._limits[0][3]
    )


@pytest.mark.parametrize(
    "options",
    [{"rate": 10**400}, {"rate": 1, "per": 10**400}, {"rate": 1e308, "per": 1e308}],
)
def test_finite_settings_too_large_are_a_value_error(options: dict[str, Any]) -> None:
    client = redis.asyncio.Redis(port=1)
    with pytest.raises(ValueError, match=r"(rate|per)"):
        RedisRateLimiter(client, "api", **options)


# -- several limits ---------------------------------------------------------------------------


def _but_counter(state: Any) -> list[bytes]:
    """A state's fields but each limit's reservation counter."""
    return [field for at, field in enumerate((state or b"").split()) if at % 6 != 1]


async def test_several_limits_all_or_nothing(r: redis.asyncio.Redis) -> None:
    """10 per second (burst 2) and 3 per minute: a slot only when both have it; a try
    refused by either reserves nothing in both; a cancelled wait gives both back."""
    limiter = RedisRateLimiter(
        r, "api", limits=[Limit(10, per=1.0, burst=2), Limit(3, per=60.0, burst=3)]
    )
    assert [await limiter.acquire(blocking=False) for _ in range(3)] == [True, True, False]
    state = await r.get(KEY)
    assert not await limiter.acquire(timeout=0.02)  # the first limit binds: ~100 ms
    assert await r.get(KEY) == state
    waiting = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.03)
    assert limiter.statistics().waiting == 1 and await r.get(KEY) != state
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # both limits given back, before the CancelledError (the counter only rises)
    assert _but_counter(await r.get(KEY)) == _but_counter(state)
    assert await limiter.acquire(timeout=1)  # the third of the minute, ~100 ms after
    # the minute's limit binds now: the next slot is ~20 s away (3 per 60 s, burst 3)
    wait = await limiter._acquire(True, 0, 1)
    assert wait is not None and 15 < wait <= 20.1, wait
    with pytest.raises(LockTimeout, match=r"the next free slot is in 1\d\.\d{3} s"):
        async with RedisRateLimiter(
            r, "api", limits=limiter.limits, timeout=0.1
        ):  # the LockTimeout says when
            pass
    info = await limiter.inspect()
    assert info.limits == (Limit(10.0, 1.0, 2), Limit(3.0, 60.0, 3)), info
    assert info.available == 0 and 15_000 < info.next_free_ms <= 20_100, info


async def test_several_limits_are_stored_together(r: redis.asyncio.Redis) -> None:
    both = [Limit(10, per=1.0, burst=2), Limit(100, per=60.0)]
    assert await RedisRateLimiter(r, "api", limits=both).acquire()
    state = await r.get(KEY)
    for other in (
        RedisRateLimiter(r, "api", limits=both[:1]),
        RedisRateLimiter(r, "api", limits=both[::-1]),
        RedisRateLimiter(r, "api", rate=10, burst=2),
    ):
        with pytest.raises(LimitMismatch, match=r"burst=2, rate=100\.0 per=60\.0 burst=5"):
            await other.acquire()
    assert await r.get(KEY) == state


def test_limits_arguments_are_checked() -> None:
    client = redis.asyncio.Redis(port=1)
    with pytest.raises(ValueError, match="or limits=, not both"):
        RedisRateLimiter(client, "api", rate=1, limits=[Limit(1)])
    with pytest.raises(ValueError, match=r"give rate= \(one limit\) or limits="):
        RedisRateLimiter(client, "api")
    with pytest.raises(ValueError, match=r"limits must hold 1\.\.16 Limit, got 0"):
        RedisRateLimiter(client, "api", limits=[])
    with pytest.raises(TypeError, match="limits must hold Limit objects, not tuple"):
        RedisRateLimiter(client, "api", limits=[(1, 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        Limit(0)
    limiter = RedisRateLimiter(client, "api", limits=[Limit(10, burst=5), Limit(100, per=60)])
    with pytest.raises(ValueError, match=r"cost must be in 1\.\.5"):
        asyncio.run(limiter.acquire(cost=6))


async def test_several_limits_on_cluster(cluster: Cluster, cluster_r: RedisCluster) -> None:
    """All of a name's limits are one key, so one hash slot, on every node's names."""
    limits = [Limit(20, per=1.0, burst=2), Limit(3, per=60.0, burst=3)]
    limiters = [RedisRateLimiter(cluster_r, f"api:{index}", limits=limits) for index in range(6)]
    for limiter in limiters:
        assert await limiter.acquire(blocking=False)
        assert await limiter.acquire(blocking=False)
        assert not await limiter.acquire(blocking=False)  # the first limit's burst
        assert await limiter.acquire(timeout=1)  # ~50 ms
        assert not await limiter.acquire(timeout=1)  # the minute's: 20 s away
        assert (await limiter.inspect()).limits == (Limit(20.0, 1.0, 2), Limit(3.0, 60.0, 3))


# -- a change (set_limits) ------------------------------------------------------------------


def _stamp(state: object) -> int:
    """The set_limits() stamp a state carries (0: none)."""
    assert isinstance(state, bytes), state
    head = state.split(b" ", 1)[0]
    return int(head[1:]) if head.startswith(b"=") else 0


def _check_change(
    grants: list[tuple[int, int, int]], limits: list[tuple[int, int, int]], window_us: int
) -> float:
    """Check the transition rule (docs/ratelimit.md, "A limit changed live") on every window
    of `window_us` starting at a grant's slot; `grants` are (slot, used, reserved) on the
    server's clock, `limits` (from_us, burst, interval_us) of each limit in force from
    `from_us` on (the first from 0), at most one change in a window. Returns the highest
    count / bound seen."""
    starts = [at for at, _, _ in limits]
    worst = 0.0
    for a, _, _ in grants:
        b = a + window_us
        index = bisect.bisect_right(starts, b) - 1  # the limit in force at b
        at, burst, interval = limits[index]
        inside = [(slot, reserved) for slot, _, reserved in grants if a <= slot <= b]
        # the grants reserved while it was in force: its bound, in any window
        mine = sum(1 for _, reserved in inside if reserved >= at)
        assert mine <= burst + window_us / interval, (a, window_us, mine, limits[index])
        worst = max(worst, mine / (burst + window_us / interval))
        if a < at:  # a window across the change: what was used before it still counts
            assert index == 0 or starts[index - 1] <= a, ("two changes in a window", a, b)
            before = len(inside) - mine  # reserved before the change: they keep their slots
            bound = burst + (at - a) / limits[index - 1][2] + (b - at) / interval
            assert len(inside) <= max(before, bound), (a, window_us, len(inside), before, bound)
            worst = max(worst, len(inside) / max(before, bound))
    return worst


@pytest.mark.slow
async def test_a_change_under_load_from_other_processes(r: redis.asyncio.Redis, url: str) -> None:
    """4 processes x 6 tasks take permits of 100/s (burst 10) for 4.5 s; this process
    changes the name's limit to 30/s (burst 3) after 1.5 s, then to 150/s (burst 15) after
    3 s, each in one call while the workers keep their limiters made with 100/s (they
    adopt the change). Counted on the server's clock, every window [a, b] obeys the
    transition rule (`_change_bound`: the old bound before each change, the new one after,
    nothing free at a change), and each limit is reached while in force."""
    workers, tasks, seconds = 4, 6, 4.5
    settings = [(100, 10), (30, 3), (150, 15)]  # rate per second, burst
    limiter = RedisRateLimiter(r, "api", rate=100, burst=10)
    job = asyncio.ensure_future(
        arun_workers(
            str(WORKERS / "ratelimit_user.py"),
            [[url, "api", "100", "1", "10", str(workers + 1), str(tasks), str(seconds)]] * workers,
            timeout=60,
        )
    )
    # the workers' barrier, with this process as one more party (a client of its own: no
    # socket timeout while the workers start)
    async with redis.asyncio.Redis.from_url(url, socket_timeout=60) as gate:
        if await gate.incr("test:{api}:barrier:arrived") == workers + 1:
            await gate.rpush("test:{api}:barrier:gate", *["go"] * (workers + 1))
        assert await gate.blpop(["test:{api}:barrier:gate"], timeout=30) is not None
    changes = [(0, 10, 10_000)]
    for rate, burst in settings[1:]:
        await asyncio.sleep(1.5)
        previous = await limiter.set_limits(rate=rate, burst=burst)
        assert previous[0].burst == changes[-1][1], previous
        changes.append((_stamp(await r.get(KEY)), burst, limiter._limits[0][3]))
    results = await job
    grants: list[tuple[int, int, int]] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        line = [row for row in result.stdout.splitlines() if row.startswith("grants ")]
        grants += [tuple(grant) for grant in json.loads(line[0].removeprefix("grants "))]
    grants.sort()
    worst = {
        window_us: _check_change(grants, changes, window_us)
        for window_us in (0, 20_000, 100_000, 300_000, 1_000_000)
    }
    # each limit reached while in force (its last 0.4 s: the backlog carried over spent)
    reached = []
    for index, (_, _, interval) in enumerate(changes):
        end = changes[index + 1][0] if index + 1 < len(changes) else grants[-1][0]
        count = sum(1 for slot, _, _ in grants if end - 400_000 <= slot < end)
        reached.append(count / 0.4)
        assert count >= 0.85 * 400_000 / interval, (index, count, changes)
    print(f"a change under load: {len(grants)} grants; reached per second {reached}")
    print(f"highest count / bound in windows (µs): {worst}")


async def test_set_limits_keeps_what_was_reserved(r: redis.asyncio.Redis) -> None:
    """No free burst: what was taken under the old limit still counts under the new one,
    a stricter limit binds at once and a looser one gives nothing back retroactively."""
    limiter = RedisRateLimiter(r, "api", rate=1, per=1.0, burst=5)
    assert [await limiter.acquire(blocking=False) for _ in range(5)] == [True] * 5
    # looser: 10 a second, burst 5; the 5 taken (5 s of the old limit's time) are 5 of the
    # new one's permits (0.5 s): nothing free at once, the next in ~100 ms
    assert await limiter.set_limits(rate=10, burst=5) == (Limit(1.0, 1.0, 5),)
    assert limiter.limits == (Limit(10.0, 1.0, 5),)
    assert not await limiter.acquire(blocking=False)
    info = await limiter.inspect()
    assert info.limits == (Limit(10.0, 1.0, 5),) and info.available == 0, info
    assert 0 < info.next_free_ms <= 100 and 400 < info.reserved_ms <= 500, info
    assert await limiter.acquire(timeout=1)  # one permit of the new limit, ~100 ms later
    # stricter: 1 a second, burst 2; ~5 permits counted (~500 ms of 100 ms each): full, so
    # the next in ~3-4 s, where a reset would have given 2 at once
    assert await limiter.set_limits(rate=1, burst=2) == (Limit(10.0, 1.0, 5),)
    assert not await limiter.acquire(blocking=False)
    info = await limiter.inspect()
    assert 2_500 < info.next_free_ms <= 4_000, info
    # several limits: each keeps its place's share; an added one starts as full as the
    # fullest was (here full: nothing at once under either)
    both = [Limit(100, per=1.0, burst=10), Limit(1000, per=60.0, burst=50)]
    assert await limiter.set_limits(limits=both) == (Limit(1.0, 1.0, 2),)
    info = await limiter.inspect()
    assert info.limits == tuple(both) and info.available == 0, info
    # reservations made before a change keep their slots
    waiting = asyncio.create_task(limiter.acquire())
    await asyncio.sleep(0.05)
    assert limiter.statistics().waiting == 1
    await limiter.set_limits(rate=1, per=3600.0, burst=1)  # far stricter
    assert await asyncio.wait_for(waiting, 2)  # the slot reserved before, kept


async def test_other_instances_adopt_a_change(r: redis.asyncio.Redis) -> None:
    """Instances made with the old limits (or any others) adopt the limits set_limits()
    stored, in their next call; they keep them, and store them again if the name went idle
    and an instance that never saw the change stored its own meanwhile."""
    old = RedisRateLimiter(r, "api", rate=10, burst=2)
    operator = RedisRateLimiter(r, "api", rate=10, burst=2)
    assert await old.acquire(blocking=False)
    await operator.set_limits(rate=1, per=1.0, burst=3)  # 1 s a permit: no timing margin needed
    for instance in (old, RedisRateLimiter(r, "api", rate=5, per=7.0, burst=9)):
        assert await instance.acquire(blocking=False)  # no LimitMismatch: the stored win
        assert instance.limits == (Limit(1.0, 1.0, 3),), instance
        assert instance.statistics().burst == 3
    assert not await old.acquire(blocking=False)  # 3 taken: the new burst
    # a refusal adopts too, and says when the slot would be under the stored limits
    other = RedisRateLimiter(r, "api", rate=1, per=60.0, burst=1)
    wait = await other._acquire(True, 0, 1)
    assert wait is not None and 0 < wait <= 1 and other.limits == (Limit(1.0, 1.0, 3),)
    # a cost above the stored burst: a ValueError naming the change, nothing changed
    state = await r.get(KEY)
    with pytest.raises(ValueError, match=r"cost must be in 1\.\.3 for 'api' since set_limits"):
        await RedisRateLimiter(r, "api", rate=10, burst=5).acquire(cost=4)
    assert await r.get(KEY) == state
    # the name idle (its key gone); an instance that never saw the change stores its own
    # limits; the next instance that saw it stores the change again, carrying the state
    await r.delete(KEY)
    never = RedisRateLimiter(r, "api", rate=1, burst=2)
    assert await never.acquire(blocking=False)
    assert _stamp(await r.get(KEY)) == 0
    assert await old.acquire(blocking=False)
    assert (await old.inspect()).limits == (Limit(1.0, 1.0, 3),)
    assert _stamp(await r.get(KEY)) > 0
    assert await never.acquire(blocking=False)  # adopts it again
    assert never.limits == (Limit(1.0, 1.0, 3),)
    assert not await never.acquire(blocking=False)  # 3 in all: carried over
    # without a change, other limits are still a mismatch (the constructors disagree)
    await r.delete(KEY)
    assert await RedisRateLimiter(r, "other", rate=10, burst=2).acquire()
    with pytest.raises(LimitMismatch, match=r"or change them with set_limits\(\)"):
        await RedisRateLimiter(r, "other", rate=20, burst=2).acquire()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"rate": 0}, ValueError, "rate must be a finite number > 0"),
        ({"rate": 10, "burst": 0}, ValueError, r"burst must be in 1\.\."),
        ({"rate": 10, "limits": [Limit(1)]}, ValueError, "or limits=, not both"),
        ({"limits": []}, ValueError, r"limits must hold 1\.\.16 Limit, got 0"),
        ({}, ValueError, r"give rate= \(one limit\) or limits="),
        ({"rate": "10"}, TypeError, "rate must be a number"),
    ],
)
async def test_set_limits_validation_changes_nothing(
    r: redis.asyncio.Redis, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    limiter = RedisRateLimiter(r, "api", rate=10, burst=2)
    with pytest.raises(error, match=match):
        await limiter.set_limits(**options)  # idle: nothing written
    assert await r.exists(KEY) == 0
    assert await limiter.acquire(blocking=False)
    state = await r.get(KEY)
    before = await command_count(r)
    with pytest.raises(error, match=match):
        await limiter.set_limits(**options)
    assert await command_count(r) == before + 1  # only the first INFO
    assert await r.get(KEY) == state and limiter.limits == (Limit(10.0, 1.0, 2),)


async def test_set_limits_on_cluster(cluster: Cluster, cluster_r: RedisCluster) -> None:
    """A change is one call on the name's one key (one hash slot), on every node's names."""
    limiters = [RedisRateLimiter(cluster_r, f"api:{index}", rate=20, burst=2) for index in range(6)]
    for limiter in limiters:
        assert await limiter.acquire(blocking=False)
        stale = RedisRateLimiter(cluster_r, limiter.name, rate=20, burst=2)
        both = [Limit(20, per=1.0, burst=3), Limit(3, per=60.0, burst=3)]
        assert await limiter.set_limits(limits=both) == (Limit(20.0, 1.0, 2),)
        assert await stale.acquire(blocking=False) and stale.limits == tuple(both)
        # 2 taken: the added minute limit starts as full as the other was (half: 1.5 of 3)
        assert not await stale.acquire(blocking=False)


# -- a cancellation storm across processes --------------------------------------------------


@pytest.mark.slow
async def test_a_cancellation_storm_across_four_processes_loses_no_slot_for_nothing(
    r: redis.asyncio.Redis, url: str
) -> None:
    """4 processes x 6 tasks, each task its own limiter, about half of the waits cancelled
    after 0-60 ms, for 3 s (rate 100/s, burst 5): every cancelled reservation whose slot was
    lost had a later reservation made by another task right after it (the state's counter
    + 1: the compare-and-set failed because somebody else reserved, never because of its own
    next try), and the slots used obey the bound on the server's clock."""
    rate, burst, workers, tasks, seconds = 100, 5, 4, 6, 3.0
    results = await arun_workers(
        str(WORKERS / "ratelimit_canceller.py"),
        [[url, "storm", str(rate), str(burst), str(workers), str(tasks), str(seconds), "1"]]
        * workers,
        timeout=60,
    )
    records: list[tuple[int, str, int, str]] = []
    for index, result in enumerate(results):
        assert result.returncode == 0, f"worker {index}: {result.stdout}\n{result.stderr}"
        line = [row for row in result.stdout.splitlines() if row.startswith("reservations ")]
        assert len(line) == 1, result.stdout
        records += [tuple(record) for record in json.loads(line[0].removeprefix("reservations "))]
    by_seq = {seq: who for seq, who, _, _ in records}
    assert len(by_seq) == len(records), "a reservation counter seen twice"
    outcomes = {kind: [r for r in records if r[3] == kind] for kind in ("granted", "given", "lost")}
    for seq, who, _, _ in outcomes["lost"]:
        assert seq + 1 in by_seq, (seq, who, "lost with no reservation after it")
        assert by_seq[seq + 1] != who, (seq, who, "lost to its own next reservation")
    slots = [slot for _, _, slot, kind in records if kind == "granted"]
    figures = {
        window_us: _most_in_window(slots, window_us)
        for window_us in (0, 10_000, 100_000, 1_000_000)
    }
    for window_us, most in figures.items():
        assert most <= burst + rate * window_us / 1e6, figures
    counts = {kind: len(found) for kind, found in outcomes.items()}
    print(f"cancellation storm: {counts}; most in windows (µs): {figures}")
    # the storm gave slots back, and lost some to others; the slots kept being used
    assert counts["given"] >= 5 and counts["lost"] >= 5, counts
    assert counts["granted"] >= 0.3 * rate * seconds, counts
