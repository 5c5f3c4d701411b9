"""aiolocks.otel: metrics and spans recorded through the OpenTelemetry SDK's in-memory
reader and exporter, against a real server; off (and not even imported) by default."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio
from _probes import QueueProbe
from _proxy import Proxy
from _servers import ServerProcess
from opentelemetry.metrics import Histogram, NoOpMeter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import aiolocks
import aiolocks.otel
from aiolocks import (
    Limit,
    LockLost,
    LockReentry,
    LockTimeout,
    RedisMutex,
    RedisRateLimiter,
    RedisReadWriteLock,
    RedisSemaphore,
)
from aiolocks._base import _telemetry
from aiolocks.otel import _recorder as _otel
from aiolocks.testing import expire_lease

KIND, NAME = "aiolocks.lock.kind", "aiolocks.lock.name"
OUTCOME = "aiolocks.acquire.outcome"
Point = NumberDataPoint | HistogramDataPoint


class Telemetry:
    """What the SDK recorded: metric points by instrument name, finished spans."""

    def __init__(self, reader: InMemoryMetricReader, exporter: InMemorySpanExporter) -> None:
        self.reader = reader
        self.exporter = exporter

    def points(self, name: str, **match: object) -> list[Point]:
        """The points of instrument `name` whose attributes include `match` (keys with `_`
        for `.`: `aiolocks_lock_kind="mutex"`)."""
        wanted = {key.replace("_", "."): value for key, value in match.items()}
        data = self.reader.get_metrics_data()
        found: list[Point] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        assert isinstance(point, NumberDataPoint | HistogramDataPoint)
                        attributes = dict(point.attributes or {})
                        if all(attributes.get(k) == v for k, v in wanted.items()):
                            found.append(point)
        return found

    def count(self, name: str, **match: object) -> float:
        """A counter's total, or a histogram's number of recordings, over matching points."""
        return sum(
            point.count if isinstance(point, HistogramDataPoint) else point.value
            for point in self.points(name, **match)
        )

    def spans(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


def _attributes(span: ReadableSpan) -> Mapping[str, Any]:
    return dict(span.attributes or {})


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    aiolocks.otel.instrument(meter_provider=meters, tracer_provider=tracers, hold_spans=True)
    try:
        yield Telemetry(reader, exporter)
    finally:
        aiolocks.otel.uninstrument()
        meters.shutdown()
        tracers.shutdown()


@pytest.fixture
async def client(valkey_notify: ServerProcess) -> AsyncIterator[redis.asyncio.Redis]:
    made = redis.asyncio.Redis.from_url(valkey_notify.url)
    try:
        await made.flushall()
        yield made
    finally:
        await made.aclose()


async def _hold_while_queued(lock: Any, probe: QueueProbe, count: int) -> list[asyncio.Task[None]]:
    """Start `count` tasks that each acquire and release `lock` once, and return when every
    one of them is queued behind the current task's holding (on the server, or behind the
    local hand-off cohort's)."""

    async def cycle() -> None:
        async with lock:
            pass

    started = [asyncio.create_task(cycle()) for _ in range(count)]
    await probe.wait_queued(count, 5.0)
    return started


async def test_contended_mutex_acquisitions_waits_holds_and_handoffs(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    mutex = RedisMutex(client, "orders:42", ttl=5)
    probe = QueueProbe(client, local=True)
    waiters = 4
    assert await mutex.acquire()
    started = await _hold_while_queued(mutex, probe, waiters)
    await mutex.release()  # hands to the first; each release hands to the next
    await asyncio.wait_for(asyncio.gather(*started), 5.0)

    mine = {"aiolocks_lock_kind": "mutex", "aiolocks_lock_name": "orders:42"}
    assert (
        telemetry.count("aiolocks.acquire.wait", **mine, aiolocks_acquire_outcome="acquired") == 5
    )
    assert telemetry.count("aiolocks.hold.duration", **mine) == 5
    assert telemetry.count("aiolocks.handoffs", **mine) == waiters  # the last had nobody
    waits = telemetry.points("aiolocks.acquire.wait", **mine)
    assert all(isinstance(p, HistogramDataPoint) and p.sum > 0 for p in waits)

    spans = telemetry.spans("aiolocks.acquire mutex")
    assert len(spans) == 5
    fences = [_attributes(span)["aiolocks.fence"] for span in spans]
    assert fences == sorted(fences) and len(set(fences)) == 5
    assert {_attributes(span)[OUTCOME] for span in spans} == {"acquired"}
    assert all(_attributes(span)[NAME] == "orders:42" for span in spans)
    assert len(telemetry.spans("aiolocks.hold mutex")) == 5

    stats = mutex.statistics()
    assert (stats.acquisitions, stats.handoffs, stats.timeouts, stats.leases_lost) == (5, 4, 0, 0)


async def test_local_handoffs_of_a_cohort_are_counted_apart(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    mutex = RedisMutex(client, "cohort", ttl=5, local_handoff=8)
    assert await mutex.acquire()

    async def cycle() -> None:
        async with mutex:
            pass

    started = [asyncio.create_task(cycle()) for _ in range(4)]
    await asyncio.sleep(0)  # each has queued in the cohort: no Redis state to wait for
    assert mutex.statistics().tasks_waiting == 4
    await mutex.release()  # passes the lease on, task to task, without Redis
    await asyncio.wait_for(asyncio.gather(*started), 5.0)

    assert telemetry.count("aiolocks.handoffs", aiolocks_handoff_local=True) == 4
    assert telemetry.count("aiolocks.handoffs", aiolocks_handoff_local=False) == 0
    assert telemetry.count("aiolocks.acquire.wait", aiolocks_acquire_outcome="acquired") == 5
    assert telemetry.count("aiolocks.hold.duration", aiolocks_lock_name="cohort") == 5
    fences = [_attributes(s)["aiolocks.fence"] for s in telemetry.spans("aiolocks.acquire mutex")]
    assert len(set(fences)) == 5
    assert len(telemetry.spans("aiolocks.hold mutex")) == 5
    assert (mutex.statistics().acquisitions, mutex.statistics().handoffs) == (5, 4)


async def test_timeouts_are_counted_and_a_refused_try_is_not_one(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    holder = RedisMutex(client, "busy", ttl=5)
    other = RedisMutex(client, "busy", ttl=5, timeout=0.05)
    assert await holder.acquire()

    async def contend() -> None:
        assert not await other.acquire(timeout=0.05)
        with pytest.raises(LockTimeout):
            async with other:
                pass
        assert not await other.acquire(blocking=False)
        assert not await other.acquire(timeout=0)

    await asyncio.create_task(contend())
    await holder.release()

    assert telemetry.count("aiolocks.acquire.timeouts", aiolocks_lock_name="busy") == 2
    assert telemetry.count("aiolocks.acquire.wait", aiolocks_acquire_outcome="timeout") == 2
    assert telemetry.count("aiolocks.acquire.wait", aiolocks_acquire_outcome="busy") == 2
    outcomes = sorted(_attributes(s)[OUTCOME] for s in telemetry.spans("aiolocks.acquire mutex"))
    assert outcomes == ["acquired", "busy", "busy", "timeout", "timeout"]
    stats = other.statistics()
    assert (stats.acquisitions, stats.timeouts) == (0, 2)


async def test_errors_and_cancellations_have_their_outcome(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    mutex = RedisMutex(client, "errors", ttl=5)
    assert await mutex.acquire()
    with pytest.raises(LockReentry):
        await mutex.acquire()
    waiter = asyncio.create_task(RedisMutex(client, "errors", ttl=5).acquire())
    await QueueProbe(client, local=True).wait_queued(1, 5.0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await mutex.release()

    spans = {_attributes(s)[OUTCOME]: s for s in telemetry.spans("aiolocks.acquire mutex")}
    assert set(spans) == {"acquired", "error", "cancelled"}
    failed = spans["error"]
    assert failed.status.status_code is StatusCode.ERROR
    assert _attributes(failed)["error.type"] == "LockReentry"
    assert [event.name for event in failed.events] == ["exception"]
    assert spans["cancelled"].status.status_code is StatusCode.UNSET
    assert telemetry.count("aiolocks.acquire.wait", **{"error.type": "LockReentry"}) == 1
    assert telemetry.count("aiolocks.acquire.timeouts") == 0


async def test_a_lost_lease_is_counted_and_marks_the_hold_span(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    mutex = RedisMutex(client, "lost", ttl=5)
    with pytest.raises(LockLost):
        async with mutex:
            await expire_lease(mutex)

    assert telemetry.count("aiolocks.lease.lost", aiolocks_lock_name="lost") == 1
    assert telemetry.count("aiolocks.lease.renewals", aiolocks_renewal_outcome="lost") == 1
    (hold,) = telemetry.spans("aiolocks.hold mutex")
    assert [event.name for event in hold.events] == ["aiolocks.lease.lost"]
    assert hold.status.status_code is StatusCode.ERROR
    assert mutex.statistics().leases_lost == 1


async def test_renewals_are_counted_in_batches(
    telemetry: Telemetry, client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _telemetry.recorder
    assert isinstance(recorder, _otel.OtelRecorder)
    batches = asyncio.Queue[int]()
    renewed = recorder.renewed

    def spy(leases: Sequence[Any], results: Sequence[object]) -> None:
        renewed(leases, results)
        batches.put_nowait(len(leases))

    monkeypatch.setattr(recorder, "renewed", spy)
    mutex = RedisMutex(client, "renewed", ttl=0.3)  # renewed every 0.1 s
    permit = RedisSemaphore(client, "renewed", limit=2, ttl=0.3)
    async with mutex, permit:
        leases = 0
        while leases < 6:  # at least three renewals of each
            leases += await asyncio.wait_for(batches.get(), 5.0)

    renewals = telemetry.count("aiolocks.lease.renewals", aiolocks_renewal_outcome="renewed")
    assert renewals >= 6
    assert telemetry.count("aiolocks.lease.renewals", aiolocks_lock_kind="semaphore") >= 3
    (batch,) = telemetry.points("aiolocks.lease.renewal.batch")
    assert isinstance(batch, HistogramDataPoint)
    assert batch.sum == renewals  # every renewal went out in some batch


async def test_failed_renewals_then_the_loss_are_counted(
    telemetry: Telemetry, valkey_notify: ServerProcess
) -> None:
    proxy = await Proxy(valkey_notify.port).start()
    through = redis.asyncio.Redis.from_url(proxy.url)
    try:
        mutex = RedisMutex(through, "stalled", ttl=0.3)
        assert await mutex.acquire()
        proxy.stall()  # renewals time out until the lease's validity runs out
        await asyncio.wait_for(mutex.lost.wait(), 5.0)
        proxy.resume()
        with pytest.raises(LockLost):
            await mutex.release()
    finally:
        await through.aclose()
        await proxy.aclose()
    assert telemetry.count("aiolocks.lease.renewals", aiolocks_renewal_outcome="failed") >= 1
    assert telemetry.count("aiolocks.lease.lost", aiolocks_lock_name="stalled") == 1


async def test_semaphore_and_rwlock_kinds(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    async with RedisSemaphore(client, "slots", limit=2, ttl=5):
        pass
    rw = RedisReadWriteLock(client, "catalog", ttl=5)
    probe = QueueProbe(client, local=True)
    assert await rw.write().acquire()
    readers = await _hold_while_queued(rw.read(), probe, 2)
    await rw.write().release()  # lets both readers in at once: two hand-offs
    await asyncio.wait_for(asyncio.gather(*readers), 5.0)

    def acquired(kind: str, name: str) -> float:
        return telemetry.count(
            "aiolocks.acquire.wait",
            aiolocks_lock_kind=kind,
            aiolocks_lock_name=name,
            aiolocks_acquire_outcome="acquired",
        )

    assert acquired("semaphore", "slots") == 1
    assert acquired("rwlock_write", "catalog") == 1
    assert acquired("rwlock_read", "catalog") == 2
    assert telemetry.count("aiolocks.handoffs", aiolocks_lock_kind="rwlock_write") == 2
    assert telemetry.count("aiolocks.hold.duration", aiolocks_lock_kind="rwlock_read") == 2
    for kind, spans in (("semaphore", 1), ("rwlock_read", 2), ("rwlock_write", 1)):
        assert len(telemetry.spans(f"aiolocks.acquire {kind}")) == spans
        assert len(telemetry.spans(f"aiolocks.hold {kind}")) == spans
    assert rw.write().statistics().handoffs == 2 and rw.read().statistics().handoffs == 0


async def test_a_rate_limiter_reports_its_limits_and_the_one_that_bound(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    """Spans carry the limits (rate, per, burst: an array each) and, when a limit set the
    slot, which (its index) and how far; metrics the limits as one string and the index."""
    limits = [Limit(20, per=1.0, burst=2), Limit(3, per=60.0, burst=3)]
    limiter = RedisRateLimiter(client, "api", limits=limits)
    assert await limiter.acquire(blocking=False) and await limiter.acquire(blocking=False)
    assert await limiter.acquire(timeout=1)  # ~50 ms: the first limit sets the slot
    assert not await limiter.acquire(blocking=False)  # the minute's: 3 taken, ~20 s away
    spans = [_attributes(span) for span in telemetry.spans("aiolocks.acquire ratelimit")]
    assert len(spans) == 4, spans
    for span in spans:
        assert span["aiolocks.ratelimit.rate"] == (20.0, 3.0), span
        assert span["aiolocks.ratelimit.per"] == (1.0, 60.0)
        assert span["aiolocks.ratelimit.burst"] == (2, 3)
    assert (
        "aiolocks.ratelimit.binding" not in spans[0] and "aiolocks.ratelimit.delay" not in spans[1]
    )
    assert spans[2]["aiolocks.ratelimit.binding"] == 0, spans[2]
    assert 0 < spans[2]["aiolocks.ratelimit.delay"] <= 0.05, spans[2]
    assert spans[3]["aiolocks.ratelimit.binding"] == 1, spans[3]
    assert 15 < spans[3]["aiolocks.ratelimit.delay"] <= 20, spans[3]
    shown = "20/1s burst 2, 3/60s burst 3"
    wait = "aiolocks.acquire.wait"
    assert (
        telemetry.count(wait, aiolocks_ratelimit_limits=shown, aiolocks_acquire_outcome="acquired")
        == 3
    )
    busy = telemetry.points(wait, aiolocks_acquire_outcome="busy")
    assert len(busy) == 1 and dict(busy[0].attributes or {}) == {
        KIND: "ratelimit",
        NAME: "api",
        OUTCOME: "busy",
        "aiolocks.ratelimit.limits": shown,
        "aiolocks.ratelimit.binding": 1,
    }
    # an instance that adopts a change reports the limits it used
    await limiter.set_limits(rate=50, burst=5)
    assert await RedisRateLimiter(client, "api", rate=1, burst=1).acquire(blocking=False)
    last = _attributes(telemetry.spans("aiolocks.acquire ratelimit")[-1])
    assert last["aiolocks.ratelimit.rate"] == (50.0,) and last["aiolocks.ratelimit.burst"] == (5,)


async def test_name_attribute_off_keeps_names_out_of_metrics_only(
    client: redis.asyncio.Redis,
) -> None:
    reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    aiolocks.otel.instrument(
        meter_provider=MeterProvider(metric_readers=[reader]),
        tracer_provider=tracers,
        name_attribute=False,
    )
    try:
        async with RedisMutex(client, "user:1234"):
            pass
    finally:
        aiolocks.otel.uninstrument()
    seen = Telemetry(reader, exporter)
    (point,) = seen.points("aiolocks.acquire.wait")
    assert dict(point.attributes or {}) == {KIND: "mutex", OUTCOME: "acquired"}
    (span,) = seen.spans("aiolocks.acquire mutex")
    assert _attributes(span)[NAME] == "user:1234"
    assert seen.spans("aiolocks.hold mutex") == []  # hold spans are opt-in


async def test_uninstrument_restores_the_no_op(
    telemetry: Telemetry, client: redis.asyncio.Redis
) -> None:
    assert aiolocks.otel.is_instrumented()
    mutex = RedisMutex(client, "toggle", ttl=5)
    async with mutex:
        pass
    aiolocks.otel.uninstrument()
    assert not aiolocks.otel.is_instrumented() and _telemetry.recorder is None
    async with mutex:
        pass
    assert telemetry.count("aiolocks.acquire.wait") == 1
    assert len(telemetry.spans("aiolocks.acquire mutex")) == 1
    assert mutex.statistics().acquisitions == 2  # local counters do not depend on it


async def test_statistics_count_without_telemetry(client: redis.asyncio.Redis) -> None:
    assert not aiolocks.otel.is_instrumented()
    mutex = RedisMutex(client, "local", ttl=5)
    assert await mutex.acquire()
    started = await _hold_while_queued(mutex, QueueProbe(client, local=True), 2)
    await mutex.release()
    await asyncio.wait_for(asyncio.gather(*started), 5.0)
    with pytest.raises(LockLost):
        async with mutex:
            assert not await asyncio.create_task(mutex.acquire(timeout=0.01))
            await expire_lease(mutex)
    stats = mutex.statistics()
    assert (stats.acquisitions, stats.handoffs, stats.timeouts, stats.leases_lost) == (4, 2, 1, 1)
    assert (stats.held_here, stats.tasks_waiting, stats.lost) == (0, 0, False)

    permit = RedisSemaphore(client, "local", limit=1, ttl=5)
    async with permit:
        pass
    await permit.set_limit(2)  # a new limit keeps the counts
    assert permit.statistics().acquisitions == 1


async def test_a_failing_recorder_is_logged_and_never_breaks_a_lock(
    client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            def fail(*args: Any) -> None:
                raise RuntimeError(f"recorder {name} broke")

            return fail

    monkeypatch.setattr(_telemetry, "recorder", Broken())
    mutex = RedisMutex(client, "broken", ttl=5)
    with caplog.at_level(logging.ERROR, logger="aiolocks"):
        async with mutex:
            pass
        assert await mutex.acquire(timeout=1)
        await mutex.release()
    assert mutex.statistics().acquisitions == 2
    assert "telemetry recorder failed" in caplog.text


def test_off_by_default_aiolocks_never_imports_opentelemetry(
    valkey_notify: ServerProcess,
) -> None:
    """redis-py 8 imports OpenTelemetry itself when it is installed, so the check is on who
    imports it: every import statement (cached or not) naming `opentelemetry*` that an
    aiolocks module runs is recorded."""
    code = textwrap.dedent(
        f"""
        import asyncio, builtins, sys

        by_aiolocks = []
        real_import = builtins.__import__

        def watch(name, globals=None, locals=None, fromlist=(), level=0):
            importer = (globals or {{}}).get("__name__", "")
            if level == 0 and name.partition(".")[0] == "opentelemetry":
                if importer.partition(".")[0] == "aiolocks":
                    by_aiolocks.append((importer, name))
            return real_import(name, globals, locals, fromlist, level)

        builtins.__import__ = watch
        import redis.asyncio
        import aiolocks, aiolocks.otel
        from aiolocks import RedisMutex, RedisSemaphore

        async def main():
            r = redis.asyncio.Redis.from_url({valkey_notify.url!r})
            async with RedisMutex(r, "off"), RedisSemaphore(r, "off", limit=1):
                pass
            await r.aclose()

        asyncio.run(main())
        recorder = "aiolocks.otel._recorder" in sys.modules
        print(aiolocks.otel.is_instrumented(), recorder, by_aiolocks)
        aiolocks.otel.instrument()  # the hook does see aiolocks' own import when asked
        print(sorted(set(by_aiolocks))[0])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False False []\n('aiolocks.otel._recorder', 'opentelemetry')\n"


def test_missing_extra_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in [m for m in sys.modules if m.startswith("opentelemetry")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # `import opentelemetry` fails
    monkeypatch.delitem(sys.modules, "aiolocks.otel._recorder", raising=False)
    monkeypatch.delattr(aiolocks.otel, "_recorder", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'aiolocks\[otel\]'"):
        aiolocks.otel.instrument()
    assert not aiolocks.otel.is_instrumented()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"meter_provider": "otlp"}, "meter_provider must be an opentelemetry MeterProvider"),
        ({"tracer_provider": 1}, "tracer_provider must be an opentelemetry TracerProvider"),
        ({"name_attribute": "no"}, "name_attribute must be a bool, not str"),
        ({"hold_spans": None}, "hold_spans must be a bool, not NoneType"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        aiolocks.otel.instrument(**options)
    assert not aiolocks.otel.is_instrumented()


def test_histograms_without_bucket_advice_on_an_older_api() -> None:
    class OldMeter(NoOpMeter):  # opentelemetry-api < 1.30: no explicit_bucket_... keyword
        def create_histogram(  # type: ignore[override]
            self, name: str, unit: str = "", description: str = ""
        ) -> Histogram:
            return super().create_histogram(name, unit, description)

    made = _otel._histogram(OldMeter("old"), "aiolocks.acquire.wait", "s", "d", (1.0,))
    assert isinstance(made, Histogram)
