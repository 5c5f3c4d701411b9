"""One notifier per client: grant messages and keyspace events wake the local waiters.

What the subscriptions read (`_subscriptions`) means here: a grant unparks the waiter
holding its token, a "holder gone" event wakes the first waiter of the name, and messages
that may have been lost make every waiter of the channel re-check. Messages are an
optimisation of latency only: every waiter also has a timer, and re-running acquire is
idempotent. Whoever must see every event of a channel (an election's observers) listens.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from .._base._clients import AnyRedis
from .._base._errors import pending_cancels, redeliver_cancel
from ._serverfacts import RunScript
from ._subscriptions import Subscriptions
from ._waitqueue import WaitQueue

__all__ = ["Hint", "Listener", "Notifier"]

log = logging.getLogger("aiolocks")


class Hint(enum.Enum):
    """What a listener of a channel is told (see `Notifier.listen`)."""

    MESSAGE = "message"  # a message on the channel (its payload is given)
    GONE = "gone"  # a keyspace del/expired/evicted event on the channel's watched key
    RESYNC = "resync"  # messages may have been lost (a reconnect, a slot move): re-read


Listener = Callable[[Hint, bytes], None]


class Notifier:
    """Routes pub/sub messages for one client into its `WaitQueue`, and to listeners."""

    def __init__(self, client: AnyRedis, waitqueue: WaitQueue, run: RunScript) -> None:
        self._waitqueue = waitqueue
        self._subscriptions = Subscriptions(client, run, self)
        # Besides waiters, whoever must see every event of a channel (election observers).
        self._listeners: dict[bytes, list[Listener]] = {}

    def listen(self, wake: bytes, listener: Listener) -> None:
        """Call `listener` on every event of `wake` (it must also `retain` the channel)."""
        self._listeners.setdefault(wake, []).append(listener)

    def unlisten(self, wake: bytes, listener: Listener) -> None:
        listeners = self._listeners.get(wake, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            self._listeners.pop(wake, None)

    def watching(self, wake: bytes) -> bool:
        """True when grants on `wake` are known to reach this process."""
        return self._subscriptions.watching(wake)

    async def retain(self, wake: bytes, watch_key: bytes | None) -> None:
        """Hold a reference to `wake` (and the keyspace channel of `watch_key`).

        Returns once the subscription is confirmed, or after a short bound: a waiter whose
        subscription is not confirmed yet still wakes on its timer. A cancellation that
        redis-py or `wait_for` swallowed meanwhile is raised (see `_errors.redeliver_cancel`).
        """
        before = pending_cancels()
        await self._subscriptions.retain(wake, watch_key)  # holds no reference if it raises
        try:
            redeliver_cancel(before)
        except asyncio.CancelledError:
            self.release(wake)
            raise

    def release(self, wake: bytes) -> None:
        """Drop a reference taken by `retain`; the channel lingers before unsubscribing."""
        self._subscriptions.release(wake)

    async def aclose(self) -> None:
        await self._subscriptions.aclose()

    # -- what the subscriptions read (`_subscriptions.Events`) --------------------------

    def message(self, wake: bytes, payload: bytes) -> None:
        self._on_grant(wake, payload)
        self._tell(wake, Hint.MESSAGE, payload)

    def gone(self, wake: bytes) -> None:
        """The holder may be gone: the first local waiter re-runs acquire."""
        self._waitqueue.recheck_first(wake)
        self._tell(wake, Hint.GONE)

    def resync(self, wake: bytes) -> None:
        """Messages of `wake` may have been lost: waiters re-check, listeners re-read."""
        self._waitqueue.recheck_all(wake)
        self._tell(wake, Hint.RESYNC)

    def _on_grant(self, wake: bytes, payload: bytes) -> None:
        # "<token> <fence> <ttl_ms>", maybe followed by more for listeners (an election's).
        parts = payload.split(b" ", 3)
        if len(parts) < 3:
            return
        token, fence, ttl = parts[0].decode(), int(parts[1]), int(parts[2])
        if self._waitqueue.stale(token, fence):
            return  # ended since: a later answer found the token not holding (issue 24)
        lot = self._waitqueue.lot(wake)
        if lot is not None:
            lot.note_lease(ttl, grant=True)
        self._waitqueue.unpark(token, fence, channel=wake)

    def _tell(self, wake: bytes, hint: Hint, payload: bytes = b"") -> None:
        for listener in list(self._listeners.get(wake, ())):
            try:
                listener(hint, payload)
            except Exception:  # a listener must never stop the reader
                log.exception("aiolocks: a listener of %r failed", wake)
