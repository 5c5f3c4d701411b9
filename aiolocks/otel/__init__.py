"""Opt-in OpenTelemetry metrics and spans for every aiolocks primitive.

Off unless asked for: install the extra (`pip install 'aiolocks[otel]'`) and call
`instrument()` once at start-up; `uninstrument()` turns it off again. Importing this module
does not import OpenTelemetry; `instrument()` does. See docs/observability.md for the
instruments, their units and attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base import _telemetry

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

__all__ = ["instrument", "is_instrumented", "uninstrument"]


def instrument(
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
    name_attribute: bool = True,
    hold_spans: bool = False,
) -> None:
    """Record metrics and spans for every primitive in this process, from now on.

    `meter_provider` / `tracer_provider` default to OpenTelemetry's global ones.
    `name_attribute=False` leaves the lock's name out of metric attributes (one time series
    per name can be too many when names carry ids); spans keep it. `hold_spans=True` adds a
    span per holding, from acquisition to release. Calling it again replaces the previous
    set-up. Raises `ImportError` when OpenTelemetry is not installed.
    """
    for option, value in (("name_attribute", name_attribute), ("hold_spans", hold_spans)):
        if not isinstance(value, bool):
            raise TypeError(f"{option} must be a bool, not {type(value).__name__}")
    try:
        from . import _recorder as _otel
    except ImportError as exc:
        raise ImportError(
            "aiolocks.otel.instrument() needs OpenTelemetry, which is not installed: "
            "pip install 'aiolocks[otel]' (it brings opentelemetry-api; add an SDK or "
            f"exporter to send the data somewhere). The import failed with: {exc}",
            name=exc.name,
        ) from exc
    _telemetry.recorder = _otel.OtelRecorder(
        meter_provider, tracer_provider, name_attribute=name_attribute, hold_spans=hold_spans
    )


def uninstrument() -> None:
    """Stop recording: every hook is a no-op again (statistics() keeps counting)."""
    _telemetry.recorder = None


def is_instrumented() -> bool:
    """True between `instrument()` and `uninstrument()`."""
    return _telemetry.recorder is not None
