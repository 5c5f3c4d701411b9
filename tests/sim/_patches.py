"""What the simulation changes in the code it runs, all by monkeypatching (aiolocks itself
is not edited): the engine's clock (`aiolocks._base._clock`) on virtual time with tokens
from the seed, auto-pipelining per process, and a record of what the engine believes
(lease validity, loss reports)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ._loop import PROCESS, VirtualLoop


class _Secrets:
    """Stands in for `secrets.token_hex` in aiolocks' clock: tokens from the run's seed."""

    def __init__(self, rng: random.Random, recorder: Recorder) -> None:
        self._rng = rng
        self._recorder = recorder

    def token_hex(self, nbytes: int | None = 32) -> str:
        nbytes = 32 if nbytes is None else nbytes
        token = f"{self._rng.getrandbits(nbytes * 8):0{nbytes * 2}x}"
        self._recorder.tokens[token] = PROCESS.get()
        return token


class Recorder:
    """What the engine believes, as the invariants need it: each lease's validity over
    time, and when each holding's loss was reported."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop
        self.validity: dict[int, list[tuple[float, float]]] = {}  # id(lease) -> (at, until)
        self.keep: list[Any] = []  # the leases (so ids stay unique for the run)
        self.tokens: dict[str, Any] = {}  # token -> the process that made it
        self.lost_at: dict[int, float] = {}  # id(holding) -> when its loss was first recorded
        # Told of each validity set and loss report (the oracle checks at those steps).
        self.on_validity: Callable[[Any], None] | None = None
        self.on_lost: Callable[[], None] | None = None


def install(loop: VirtualLoop, rng: random.Random) -> Recorder:
    """Patch the engine (and fakeredis' clock) for one run on `loop`; returns the recorder."""
    import fakeredis._socket._base as fr_base
    import fakeredis.commands_mixins.server_mixin as fr_server

    import aiolocks._base._clock
    import aiolocks._leases._keeper
    import aiolocks._transport._runner

    from ._net import ServerClock

    fr_base.time = ServerClock(loop)  # type: ignore[attr-defined,assignment]
    fr_server.time = ServerClock(loop)  # type: ignore[attr-defined,assignment]
    recorder = Recorder(loop)
    # The engine's one clock seam: virtual time, and tokens from the seed.
    aiolocks._base._clock.monotonic = loop.time
    aiolocks._base._clock.token_hex = _Secrets(rng, recorder).token_hex

    def autopipelining() -> bool:
        proc = PROCESS.get()
        return bool(getattr(proc, "autopipe", True))

    aiolocks._transport._runner.autopipelining = autopipelining

    lease_cls = aiolocks._leases._keeper.Lease
    slot = lease_cls.__dict__.get("valid_until")
    if not isinstance(slot, _ValidUntil):
        slot = _ValidUntil(slot)
        setattr(lease_cls, "valid_until", slot)  # noqa: B010 (a slot: mypy refuses the plain form)
    slot.recorder = recorder

    holding_cls = aiolocks._leases._keeper.Holding
    mark_lost: Callable[..., None] = getattr(holding_cls.mark_lost, "__wrapped_mark__", None) or (
        holding_cls.mark_lost
    )

    def recording_mark_lost(self: Any, reason: str) -> None:
        recorder.lost_at.setdefault(id(self), loop.time())
        mark_lost(self, reason)
        if recorder.on_lost is not None:
            recorder.on_lost()

    recording_mark_lost.__wrapped_mark__ = mark_lost  # type: ignore[attr-defined]
    holding_cls.mark_lost = recording_mark_lost  # type: ignore[method-assign]
    return recorder


class _ValidUntil:
    """`Lease.valid_until` (a slot), recording every value it takes and when."""

    recorder: Recorder | None = None

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return self.inner.__get__(obj, owner)

    def __set__(self, obj: Any, value: float) -> None:
        self.inner.__set__(obj, value)
        recorder = self.recorder
        if recorder is not None:
            history = recorder.validity.get(id(obj))
            if history is None:
                history = recorder.validity[id(obj)] = []
                recorder.keep.append(obj)
            history.append((recorder.loop.time(), value))
            if recorder.on_validity is not None:
                recorder.on_validity(obj)


def lapse(recorder: Recorder, lease: Any, until: float) -> float | None:
    """When `lease`'s validity ran out for good before `until` (None if it did not): its
    holder believes it holds nothing from then on. A renewal sent before the validity ended
    but answered just after it extends it again (the engine counts validity from the
    renewal's send time), so a lapse it repairs is not the end."""
    history = recorder.validity.get(id(lease))
    if not history:
        return None
    current = history[0][1]
    for at, value in history[1:]:
        if at >= until:
            break
        if at > current and value <= at:
            return current  # ran out, and what came after did not bring it back
        current = value
    return current if current < until else None
