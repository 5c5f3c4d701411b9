"""The OpenTelemetry recorder: turns the engine's events into metrics and spans.

Imported only by `aiolocks.otel.instrument()`, so OpenTelemetry is loaded only when asked
for. Instruments are made once per `instrument()` call, from the providers given (or the
global ones); attributes are the primitive's kind and, unless turned off, its name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from opentelemetry import metrics, trace
from opentelemetry.util.types import AttributeValue

from .. import __version__
from .._base._telemetry import (
    ACQUIRED,
    ERROR,
    TIMEOUT,
    LeaseView,
    LimitCall,
    LockView,
    SpecView,
    describe,
)

__all__ = ["OtelRecorder"]

SCOPE = "aiolocks"
KIND, NAME, OUTCOME = "aiolocks.lock.kind", "aiolocks.lock.name", "aiolocks.acquire.outcome"
RENEWAL_OUTCOME, FENCE, WAIT = "aiolocks.renewal.outcome", "aiolocks.fence", "aiolocks.acquire.wait"
LOCAL = "aiolocks.handoff.local"
# A rate limiter's: its limits (spans: one array each, a limit per item; metrics: one
# string), and the limit that set the slot (its index in them) and how far the slot was.
RATES, PERIODS, BURSTS = (
    "aiolocks.ratelimit.rate",
    "aiolocks.ratelimit.per",
    "aiolocks.ratelimit.burst",
)
LIMITS, BINDING = "aiolocks.ratelimit.limits", "aiolocks.ratelimit.binding"
DELAY = "aiolocks.ratelimit.delay"
ERROR_TYPE = "error.type"  # the semantic-conventions attribute for a failure's class
# Waits and holds range from a hand-off on loopback (under a millisecond) to minutes.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 300.0)  # fmt: skip
BATCH_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


class _Acquiring:
    """One acquire() call in flight: when it began, its span, its attributes."""

    __slots__ = ("attributes", "kind", "span", "started")

    def __init__(self, kind: str, span: trace.Span, attributes: dict[str, AttributeValue]) -> None:
        self.kind = kind
        self.span = span
        self.attributes = attributes
        self.started = time.perf_counter()


class _Hold:
    """One holding acquired while instrumented: when it began, its span if any."""

    __slots__ = ("attributes", "span", "started")

    def __init__(
        self, started: float, span: trace.Span | None, attributes: dict[str, AttributeValue]
    ) -> None:
        self.started = started
        self.span = span
        self.attributes = attributes


class OtelRecorder:
    """A `_telemetry.Recorder` that records to OpenTelemetry instruments and spans."""

    def __init__(
        self,
        meter_provider: metrics.MeterProvider | None,
        tracer_provider: trace.TracerProvider | None,
        *,
        name_attribute: bool,
        hold_spans: bool,
    ) -> None:
        for option, value, expected in (
            ("meter_provider", meter_provider, metrics.MeterProvider),
            ("tracer_provider", tracer_provider, trace.TracerProvider),
        ):
            if value is not None and not isinstance(value, expected):
                raise TypeError(
                    f"{option} must be an opentelemetry {expected.__name__} or None, "
                    f"not {type(value).__name__}"
                )
        meter = metrics.get_meter(SCOPE, __version__, meter_provider)
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider)
        self._name_attribute = name_attribute
        self._hold_spans = hold_spans
        self._holds: dict[str, _Hold] = {}
        self._wait = _histogram(
            meter, "aiolocks.acquire.wait", "s",
            "Time an acquire() call took, by outcome (acquired, timeout, busy, cancelled, "
            "error)",
            SECONDS_BUCKETS,
        )  # fmt: skip
        self._hold = _histogram(
            meter, "aiolocks.hold.duration", "s",
            "Time from a successful acquire() to its release()", SECONDS_BUCKETS,
        )  # fmt: skip
        self._batch = _histogram(
            meter, "aiolocks.lease.renewal.batch", "{lease}",
            "Leases renewed together in one pipeline by a client's lease keeper", BATCH_BUCKETS,
        )  # fmt: skip
        self._handoffs = meter.create_counter(
            "aiolocks.handoffs", "{grant}", "Waiters let in by a release (direct hand-offs)"
        )
        self._renewals = meter.create_counter(
            "aiolocks.lease.renewals", "{renewal}", "Lease renewals, by outcome"
        )
        self._lost = meter.create_counter("aiolocks.lease.lost", "{lease}", "Leases lost")
        self._timeouts = meter.create_counter(
            "aiolocks.acquire.timeouts", "{timeout}", "acquire() calls whose timeout ran out"
        )

    def _metric_attributes(self, key: bytes) -> dict[str, AttributeValue]:
        kind, name = describe(key)
        return {KIND: kind, NAME: name} if self._name_attribute else {KIND: kind}

    # -- acquire -----------------------------------------------------------------------

    def acquire_started(self, lock: LockView) -> object:
        kind, name = describe(lock._spec.renew_keys[0])
        span = self._tracer.start_span(
            f"aiolocks.acquire {kind}", attributes={KIND: kind, NAME: name}
        )
        return _Acquiring(kind, span, self._metric_attributes(lock._spec.renew_keys[0]))

    def acquire_ended(
        self,
        handle: object,
        lock: LockView,
        outcome: str,
        error: BaseException | None,
        limit: LimitCall | None,
    ) -> None:
        assert isinstance(handle, _Acquiring)
        now = time.perf_counter()
        wait = now - handle.started
        span_attributes: dict[str, AttributeValue] = {OUTCOME: outcome, WAIT: wait}
        if limit is not None:
            _limit_attributes(limit, handle.attributes, span_attributes)
        attributes = {**handle.attributes, OUTCOME: outcome}
        span = handle.span
        if outcome == ERROR and error is not None:
            attributes[ERROR_TYPE] = span_attributes[ERROR_TYPE] = type(error).__qualname__
            span.record_exception(error)
            span.set_status(trace.StatusCode.ERROR, str(error))
        self._wait.record(wait, attributes)
        if outcome == TIMEOUT:
            self._timeouts.add(1, handle.attributes)
        holding = lock._current() if outcome == ACQUIRED else None
        if holding is not None:
            span_attributes[FENCE] = holding.fence
            hold_span = None
            if self._hold_spans:
                hold_span = self._tracer.start_span(
                    f"aiolocks.hold {handle.kind}",
                    attributes={KIND: handle.kind, NAME: lock.name, FENCE: holding.fence},
                )
            self._holds[holding.token] = _Hold(now, hold_span, handle.attributes)
        span.set_attributes(span_attributes)
        span.end()

    # -- holding -----------------------------------------------------------------------

    def released(self, spec: SpecView, token: str) -> None:
        hold = self._holds.pop(token, None)
        if hold is None:
            return  # acquired before instrument() was called
        self._hold.record(time.perf_counter() - hold.started, hold.attributes)
        if hold.span is not None:
            hold.span.end()

    def handed_off(self, spec: SpecView, count: int, local: bool) -> None:
        attributes = self._metric_attributes(spec.renew_keys[0])
        self._handoffs.add(count, {**attributes, LOCAL: local})

    def lease_lost(self, spec: SpecView, token: str) -> None:
        self._lost.add(1, self._metric_attributes(spec.renew_keys[0]))
        hold = self._holds.get(token)
        if hold is not None and hold.span is not None:
            hold.span.add_event("aiolocks.lease.lost")
            hold.span.set_status(trace.StatusCode.ERROR, "lease lost")

    def renewed(self, leases: Sequence[LeaseView], results: Sequence[object]) -> None:
        self._batch.record(len(leases))
        for lease, result in zip(leases, results, strict=True):
            if isinstance(result, BaseException):
                outcome = "failed"
            else:
                outcome = "renewed" if result == 1 else "lost"
            self._renewals.add(
                1, {**self._metric_attributes(lease.keys[0]), RENEWAL_OUTCOME: outcome}
            )


def _limit_attributes(
    limit: LimitCall,
    metric: dict[str, AttributeValue],
    span: dict[str, AttributeValue],
) -> None:
    """A rate limiter's call: its limits on the span (rate, per, burst: an array each) and
    in the metrics (one string, "350/10s burst 17, 10000/3600s burst 500"); the limit that
    set the slot (its index) on both, and the seconds to the slot on the span."""
    span[RATES] = [rate for rate, _, _ in limit.limits]
    span[PERIODS] = [per for _, per, _ in limit.limits]
    span[BURSTS] = [burst for _, _, burst in limit.limits]
    metric[LIMITS] = ", ".join(
        f"{rate:g}/{per:g}s burst {burst}" for rate, per, burst in limit.limits
    )
    if limit.binding is not None:
        metric[BINDING] = span[BINDING] = limit.binding
        span[DELAY] = limit.delay


def _histogram(
    meter: metrics.Meter, name: str, unit: str, description: str, buckets: Sequence[float]
) -> metrics.Histogram:
    try:
        return meter.create_histogram(
            name, unit, description, explicit_bucket_boundaries_advisory=buckets
        )
    except TypeError:  # opentelemetry-api < 1.30 takes no advice: the SDK's default buckets
        return meter.create_histogram(name, unit, description)
