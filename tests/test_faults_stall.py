"""A server that stops answering (a stalled link through `tests/_proxy.py`, or `CLIENT
PAUSE`): the documented bounds hold whatever the server does (issue 13, section 1).

- `acquire(timeout=t)` returns, and `async with` raises, within t + 0.2 s;
- `acquire(blocking=False)` is one try bounded by the client's socket_timeout (or
  `TRY_BOUND`), then `ServerUnavailable`;
- a lease lost on a stalled link reaches the `async with` caller within its validity + 0.3 s,
  the release on the way out never delaying it;
- the abandoned attempt is withdrawn in the background once the server answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from _faultreport import record
from _faults import close_client, leftovers, make_sides
from _proxy import Proxy
from _servers import ServerProcess

from aiolocks import LockLost, LockTimeout, RedisMutex, ServerUnavailable
from aiolocks._engine._acquire import TRY_BOUND
from aiolocks._engine._leasedlock import LeasedLock
from aiolocks._engine._release import _BACKGROUND

pytestmark = pytest.mark.faults

# The promises (docs/mutex.md "Timeouts"), asserted as stated.
ACQUIRE_SLACK = 0.2
LOSS_SLACK = 0.3


async def _background_done(timeout: float) -> None:
    """Wait (bounded) for the clean-ups left to finish in the background."""
    pending = list(_BACKGROUND)
    if pending:
        await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout)


@pytest.fixture
async def proxied(proxy: Proxy) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(proxy.url)
    try:
        yield client
    finally:
        proxy.resume()
        await close_client(client)


async def _nothing_left_past_ttl(client: redis.asyncio.Redis, name: str, ttl_ms: int) -> None:
    """No key of mutex `name` is left but one that ends by the ttl: a call the stalled link
    delivered after the clean-up gave up (a socket_timeout cut it) may still have taken it."""
    for part in await leftovers(client, "mutex", name):
        pttl = int(await client.pttl(f"aiolocks:mutex:{{{name}}}:{part}"))
        assert 0 < pttl <= ttl_ms, (part, pttl)


async def _warm(lock: LeasedLock) -> None:
    """One acquisition before the stall, so the link is open and the scripts loaded."""
    assert await lock.acquire()
    await lock.release()


@pytest.mark.parametrize("timeout", [0.5, 1.0])
@pytest.mark.parametrize("socket_timeout", [None, 2.0])
async def test_acquire_timeout_bounds_the_call_on_a_stalled_link(
    proxy: Proxy, direct: redis.asyncio.Redis, timeout: float, socket_timeout: float | None
) -> None:
    client = redis.asyncio.Redis.from_url(proxy.url, socket_timeout=socket_timeout)
    try:
        lock = RedisMutex(client, "stall-acquire", ttl=2)
        await _warm(lock)
        proxy.stall()
        started = time.monotonic()
        got = await lock.acquire(timeout=timeout)
        elapsed = time.monotonic() - started
        assert got is False
        assert elapsed <= timeout + ACQUIRE_SLACK, elapsed

        started = time.monotonic()
        with pytest.raises(LockTimeout) as raised:
            async with RedisMutex(client, "stall-acquire", ttl=2, timeout=timeout):
                pass
        aenter = time.monotonic() - started
        assert aenter <= timeout + ACQUIRE_SLACK, aenter
        assert "did not answer" in str(raised.value), str(raised.value)

        proxy.resume()
        await _background_done(10)
        await _nothing_left_past_ttl(direct, "stall-acquire", 2000)
        record(
            "13 stall: acquire(timeout=t) returns",
            trials=2,
            recover=[elapsed - timeout, aenter - timeout],
            note=f"t={timeout:g} socket_timeout={socket_timeout}: acquire {elapsed:.3f} s, "
            f"async with {aenter:.3f} s",
        )
    finally:
        proxy.resume()
        await close_client(client)


async def test_contention_timeout_names_the_situation(
    direct: redis.asyncio.Redis,
) -> None:
    holder = RedisMutex(direct, "contended-timeout", ttl=5)
    assert await holder.acquire()
    try:
        with pytest.raises(LockTimeout) as raised:
            async with RedisMutex(direct, "contended-timeout", timeout=0.1):
                pass
        message = str(raised.value)
        assert "held by another holder" in message and "did not answer" not in message, message
    finally:
        await holder.release()


@pytest.mark.parametrize("socket_timeout", [None, 0.5])
async def test_a_try_is_bounded_on_a_stalled_link(
    proxy: Proxy, direct: redis.asyncio.Redis, socket_timeout: float | None
) -> None:
    client = redis.asyncio.Redis.from_url(proxy.url, socket_timeout=socket_timeout)
    try:
        lock = RedisMutex(client, "stall-try", ttl=2)
        await _warm(lock)
        proxy.stall()
        bound = TRY_BOUND if socket_timeout is None else socket_timeout
        started = time.monotonic()
        with pytest.raises(ServerUnavailable) as raised:
            await lock.acquire(blocking=False)
        elapsed = time.monotonic() - started
        assert elapsed <= bound + ACQUIRE_SLACK, elapsed
        if socket_timeout is None:
            assert "did not answer" in str(raised.value)
        proxy.resume()
        await _background_done(10)
        await _nothing_left_past_ttl(direct, "stall-try", 2000)
        record(
            "13 stall: acquire(blocking=False) raises",
            trials=1,
            recover=[elapsed - bound],
            note=f"socket_timeout={socket_timeout}: {elapsed:.3f} s (bound {bound:g} s)",
        )
    finally:
        proxy.resume()
        await close_client(client)


@pytest.mark.parametrize("notify", [True, False], ids=["notify", "plain"])
async def test_client_pause_keeps_the_bounds_and_leaves_nothing(
    server_factory: Any, notify: bool
) -> None:
    """`CLIENT PAUSE 3000 ALL` on a private server: the acquirer's calls wait in the server;
    the bounds hold, and once the pause ends the background clean-up undoes what they did
    (the try would have been granted)."""
    server: ServerProcess = server_factory(notify=notify)
    client = redis.asyncio.Redis.from_url(server.url, socket_timeout=1.0)
    admin = redis.asyncio.Redis.from_url(server.url)
    try:
        lock = RedisMutex(client, "paused", ttl=2)
        await _warm(lock)
        await admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")  # type: ignore[no-untyped-call]
        started = time.monotonic()
        assert await lock.acquire(timeout=0.5) is False
        timed = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            await RedisMutex(client, "paused", ttl=2).acquire(blocking=False)
        tried = time.monotonic() - started
        assert timed <= 0.5 + ACQUIRE_SLACK, timed
        assert tried <= 1.0 + ACQUIRE_SLACK, tried
        await _background_done(15)
        assert await leftovers(admin, "mutex", "paused") == {}
        assert not await RedisMutex(admin, "paused").locked()
        record(
            "13 stall: CLIENT PAUSE",
            trials=2,
            note=f"notify={notify}: acquire(timeout=0.5) {timed:.3f} s, "
            f"blocking=False (socket_timeout 1) {tried:.3f} s",
        )
    finally:
        await close_client(client)
        await admin.aclose()


def _side(client: redis.asyncio.Redis, kind: str, name: str, **options: Any) -> LeasedLock:
    if kind in ("read", "write"):
        return make_sides(client, "rwlock", name, **options)[0 if kind == "read" else 1].lock
    return make_sides(client, kind, name, limit=1, **options)[0].lock  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["mutex", "semaphore", "read"])
@pytest.mark.parametrize("body", ["waits", "returns"])
async def test_a_lease_lost_on_a_stalled_link_is_reported_in_time(
    proxy: Proxy, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis, kind: str, body: str
) -> None:
    """ttl 1 s, the link stalls in the body: `LockLost` leaves the `async with` within the
    lease's validity + 0.3 s, whether the body waits (cancelled by the loss) or returns
    during the stall (its release cannot be answered)."""
    name = f"stall-lost-{kind}-{body}"
    lock = _side(proxied, kind, name, ttl=1.0)
    valid_until: list[float] = []

    async def hold() -> None:
        async with lock:
            holding = lock._current()
            assert holding is not None and holding.lease is not None
            proxy.stall()
            valid_until.append(holding.lease.valid_until)
            if body == "waits":
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(0.05)

    with pytest.raises(LockLost):
        await asyncio.wait_for(hold(), 10)
    late = time.monotonic() - valid_until[0]
    assert late <= LOSS_SLACK, late
    proxy.resume()
    await _background_done(10)
    record(
        "13 stall: LockLost after the validity",
        trials=1,
        recover=[late],
        note=f"{kind}, body {body}: {late * 1000:.0f} ms after the validity ended",
    )
