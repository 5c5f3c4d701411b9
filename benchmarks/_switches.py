"""Each optimization of aiolocks as a switch the benchmark flips from outside the engine.

`bench_optimizations.py` measures aiolocks with and without each one. A switch patches a
module constant or function, or sets an environment variable, in the process it runs in;
nothing in `aiolocks/` is edited. Every process of a run (the 4-process workers, uvicorn's
workers) calls `apply()` at start-up, which reads `AIOLOCKS_BENCH_FLIP` (a switch's name,
or nothing: aiolocks as shipped). An optimization that is on by default is turned off; a
user option that is off by default (`local_handoff`) is turned on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiolocks import mutex, registry
from aiolocks._base import _clock
from aiolocks._engine import _acquire, _leasedlock
from aiolocks._leases import _keeper
from aiolocks._transport import _runner
from aiolocks._waiting import _notifier

ENV = "AIOLOCKS_BENCH_FLIP"
# The local_handoff a "cohorts" run gives every RedisMutex made without one.
LOCAL_HANDOFF = 16


@dataclass(frozen=True)
class Switch:
    """One optimization: what it is, what the flip patches, and the patch."""

    what: str
    target: str  # module.attribute (or environment variable) the flip changes
    flip: Callable[[], None]
    shipped: bool = True  # on in aiolocks as shipped (the flip turns it off)


def _set(module: Any, attribute: str, value: object) -> Callable[[], None]:
    """A flip setting `module.attribute` to `value`; the attribute must exist (a switch
    pointing at a name the engine no longer reads would measure nothing)."""

    def flip() -> None:
        if not hasattr(module, attribute):
            raise AttributeError(f"{module.__name__} has no {attribute}: re-point the switch")
        setattr(module, attribute, value)

    return flip


def _no_autopipelining() -> None:
    os.environ["AIOLOCKS_AUTOPIPELINE"] = "0"  # read when a client's context is made


def _cohorts() -> None:
    init = mutex.RedisMutex.__init__

    @functools.wraps(init)
    def with_cohort(self: mutex.RedisMutex, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("local_handoff", LOCAL_HANDOFF)
        init(self, *args, **kwargs)

    mutex.RedisMutex.__init__ = with_cohort  # type: ignore[method-assign]


def _no_registry_coalescing() -> None:
    async def register(self: registry.RedisRegistry, name: str | bytes) -> int:
        ids = await self._register([self._encode(name)])  # one script call per name
        return ids[0]

    registry.RedisRegistry.register = register  # type: ignore[method-assign]


def _no_renewal_batch() -> None:
    _keeper.BATCH = 1  # leases per script call
    _set(_keeper, "BATCH", 1)()  # its imported copy (a round: 8 calls' worth)


def _no_long_quiet_passes() -> None:
    bound = _leasedlock.CHAIN_BOUND
    may_pass = _leasedlock.Cohort._may_pass

    def held_rule(self: _leasedlock.Cohort) -> bool:  # the rule before issue 45's change
        if _clock.monotonic() - self._held_since >= bound:
            return False
        return may_pass(self)

    _leasedlock.Cohort._may_pass = held_rule  # type: ignore[method-assign]


SWITCHES: dict[str, Switch] = {
    "autopipelining": Switch(
        "script calls of one loop iteration go out as one pipeline on one connection",
        "env AIOLOCKS_AUTOPIPELINE=0 (read in aiolocks._engine._context)",
        _no_autopipelining,
    ),
    "direct_reads": Switch(
        "the auto-pipeline's replies parsed in the transport's callback, no reader task",
        "aiolocks._transport._runner.DIRECT_READS = False",
        _set(_runner, "DIRECT_READS", False),
    ),
    "pubsub_direct_reads": Switch(
        "pub/sub messages parsed in the transport's callback, no reader task per message",
        "aiolocks._waiting._notifier.DIRECT_READS = False",
        _set(_notifier, "DIRECT_READS", False),
    ),
    "subscription_linger": Switch(
        "a name's channel stays subscribed 30 s after its last waiter",
        "aiolocks._waiting._notifier._LINGER = 0.0",
        _set(_notifier, "_LINGER", 0.0),
    ),
    "late_grant": Switch(
        "a grant read with less than half its ttl left is confirmed with the server",
        "aiolocks._engine._acquire._MAX_CONFIRMS = 0",
        _set(_acquire, "_MAX_CONFIRMS", 0),
    ),
    "registry_coalescing": Switch(
        "concurrent register() calls of a client share script calls (the Coalescer)",
        "aiolocks.registry.RedisRegistry.register -> one script call per name",
        _no_registry_coalescing,
    ),
    "renewal_coalescing": Switch(
        "the keeper renews, with the lease due, every lease due within a tenth of a period",
        "aiolocks._leases._keeper._COALESCE = 0.0",
        _set(_keeper, "_COALESCE", 0.0),
    ),
    "renewal_batch": Switch(
        "one renew_batch script call renews up to 250 leases",
        "aiolocks._leases._keeper.BATCH = 1 (its round: 8 calls)",
        _no_renewal_batch,
    ),
    "long_quiet_passes": Switch(
        "a cohort nobody waits behind elsewhere passes on after a holding of 10 ms or more",
        "aiolocks._engine._leasedlock.Cohort._may_pass -> never after a holding of CHAIN_BOUND",
        _no_long_quiet_passes,
    ),
    "cohorts": Switch(
        f"RedisMutex(local_handoff={LOCAL_HANDOFF}): the process's tasks pass the lease on",
        f"aiolocks.mutex.RedisMutex.__init__ -> local_handoff={LOCAL_HANDOFF} by default",
        _cohorts,
        shipped=False,
    ),
}


def apply() -> str | None:
    """Flip the switch named by `AIOLOCKS_BENCH_FLIP` in this process; its name, or None."""
    name = os.environ.get(ENV) or None
    if name is not None:
        SWITCHES[name].flip()
    return name
