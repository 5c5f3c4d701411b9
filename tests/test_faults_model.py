"""A model-based test (hypothesis stateful testing): random sequences of acquire (waiting
or not), release, cancel, expire (the lease forced away on the server) and renew, by four
actors on two clients, against a real server, each step checked against a small model of
the primitive, fencing tokens included.

The model: live holders, a FIFO queue and the fence counter. Whenever a script runs
(an arrival, a release, a withdrawal), the queue head enters while it can ("fill"), each
grant taking the next fence; an arrival then enters only if nobody waits ahead of it and
there is room, else it queues (or, not waiting, gets False). A lease forced away stops
counting at once; its holder's release raises `LockLost` and its renewal answers 0.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import hypothesis.strategies as st
import pytest
import redis.asyncio
from _faultreport import record
from _faults import Kind, leftovers
from _probes import QueueProbe
from _servers import ServerProcess
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from aiolocks import LockLost, ReadLock, RedisMutex, RedisReadWriteLock, RedisSemaphore
from aiolocks._engine import _release
from aiolocks._engine._context import context_for
from aiolocks._engine._leasedlock import LeasedLock

pytestmark = pytest.mark.faults

T = TypeVar("T")
ACTORS = 4
LIMIT = 2  # the semaphore's permits
TTL = 10.0  # long: leases end only when a step forces them away
BOUND = 5.0  # longest wait for anything a step expects to happen


@dataclass
class Actor:
    index: int
    sides: dict[str, LeasedLock]  # "x" (mutex, semaphore) or "r" / "w" (RW lock)
    probe: QueueProbe
    state: str = "idle"  # idle, waiting, holding
    side: str = "x"
    lost: bool = False
    fence: int = 0  # expected while holding
    task: asyncio.Task[bool] | None = None

    @property
    def lock(self) -> LeasedLock:
        return self.sides[self.side]

    def token(self) -> str:
        assert self.task is not None
        return self.lock._holdings[self.task].token


_STEPS: list[int] = []


class LockModel(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.url = url
        self.clients: list[redis.asyncio.Redis] = []
        self.kind: Kind = "mutex"
        self.name = ""
        self.actors: list[Actor] = []
        self.queue: list[Actor] = []
        self.fence = 0  # grants made so far (each actor.fence is its grant's number)
        self.observed: dict[int, int] = {}  # grant number -> the fence it got
        self.steps = 0

    def run(self, awaitable: Awaitable[T]) -> T:
        async def bounded() -> T:
            return await asyncio.wait_for(awaitable, 3 * BOUND)

        return self.loop.run_until_complete(bounded())

    # -- set-up ---------------------------------------------------------------------------

    @initialize(kind=st.sampled_from(["mutex", "semaphore", "rwlock"]))
    def start(self, kind: Kind) -> None:
        self.kind = kind
        self.name = f"model-{secrets.token_hex(4)}"
        self.run(self._start())

    async def _start(self) -> None:
        self.clients = [redis.asyncio.Redis.from_url(self.url) for _ in range(2)]
        for index in range(ACTORS):
            client = self.clients[index % 2]
            sides: dict[str, LeasedLock]
            if self.kind == "mutex":
                # Strict FIFO: the model is of the server's queue, one entry per acquire.
                sides = {"x": RedisMutex(client, self.name, ttl=TTL, local_handoff=0)}
            elif self.kind == "semaphore":
                sides = {"x": RedisSemaphore(client, self.name, limit=LIMIT, ttl=TTL)}
            else:
                rw = RedisReadWriteLock(client, self.name, ttl=TTL)
                sides = {"r": rw.read(), "w": rw.write()}
            self.actors.append(Actor(index, sides, QueueProbe(client)))

    # -- the model ------------------------------------------------------------------------

    def live(self) -> list[Actor]:
        return [a for a in self.actors if a.state == "holding" and not a.lost]

    def can_enter(self, side: str) -> bool:
        live = self.live()
        if self.kind == "semaphore":
            return len(live) < LIMIT
        if side == "r":
            return not any(a.side == "w" for a in live)
        return not live

    def fill(self) -> list[Actor]:
        """Let the queue head in while it can; returns who got in, in order."""
        granted = []
        while self.queue and self.can_enter(self.queue[0].side):
            actor = self.queue.pop(0)
            self.grant(actor)
            granted.append(actor)
        return granted

    def grant(self, actor: Actor) -> None:
        self.fence += 1
        actor.state, actor.lost, actor.fence = "holding", False, self.fence

    async def settle(self, granted: list[Actor]) -> None:
        """Wait until each actor the model let in knows it holds, with the expected fence."""
        for actor in granted:
            assert actor.task is not None
            assert await asyncio.wait_for(asyncio.shield(actor.task), BOUND) is True
            # actor.fence is the grant's place in the model's order; fences are a hybrid
            # logical clock, so the model checks their order, not their values.
            self.observed[actor.fence] = actor.lock._holdings[actor.task].fence

    def eligible(self, state: str) -> list[int]:
        return [a.index for a in self.actors if a.state == state]

    def pick(self, data: st.DataObject, state: str) -> Actor:
        """One of the actors in `state`, chosen by hypothesis; counts the step."""
        self.steps += 1
        return self.actors[data.draw(st.sampled_from(self.eligible(state)))]

    # -- rules ----------------------------------------------------------------------------

    @rule(data=st.data(), blocking=st.booleans(), read=st.booleans())
    @precondition(lambda self: bool(self.eligible("idle")))
    def acquire(self, data: st.DataObject, blocking: bool, read: bool) -> None:
        actor = self.pick(data, "idle")
        actor.side = ("r" if read else "w") if self.kind == "rwlock" else "x"
        self.run(self._acquire(actor, blocking))

    async def _acquire(self, actor: Actor, blocking: bool) -> None:
        granted = self.fill()
        enters = not self.queue and self.can_enter(actor.side)
        queued_before = len(actor.probe.queued)
        actor.task = asyncio.ensure_future(actor.lock.acquire(blocking=blocking))
        if enters:
            self.grant(actor)
            granted.append(actor)
        elif blocking:
            actor.state = "waiting"
            self.queue.append(actor)
            await actor.probe.wait_queued(queued_before + 1, BOUND)  # queued on the server
        else:
            assert await asyncio.wait_for(asyncio.shield(actor.task), BOUND) is False
            actor.task = None
        await self.settle(granted)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.eligible("holding")))
    def release(self, data: st.DataObject) -> None:
        actor = self.pick(data, "holding")
        self.run(self._release(actor))

    async def _release(self, actor: Actor) -> None:
        lost, actor.state = actor.lost, "idle"
        granted = self.fill()
        if lost:
            with pytest.raises(LockLost):
                await actor.lock.release()
        else:
            await actor.lock.release()
        actor.task = None
        await self.settle(granted)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.eligible("waiting")))
    def cancel(self, data: st.DataObject) -> None:
        actor = self.pick(data, "waiting")
        self.run(self._cancel(actor))

    async def _cancel(self, actor: Actor) -> None:
        assert actor.task is not None
        self.queue.remove(actor)
        actor.state = "idle"
        granted = self.fill()
        actor.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(actor.task, BOUND)
        actor.task = None
        await self.settle(granted)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.live()))
    def expire(self, data: st.DataObject) -> None:
        actor = data.draw(st.sampled_from(self.live()))
        self.steps += 1
        self.run(self._expire(actor))

    async def _expire(self, actor: Actor) -> None:
        spec = actor.lock._spec
        direct = self.clients[0]
        if spec.renew_keys[0].endswith((b":owner", b":writer")):
            await direct.pexpireat(spec.renew_keys[0], 1)  # in the past: gone at once
        else:
            await direct.zadd(spec.renew_keys[0], {actor.token(): 1}, xx=True)
        actor.lost = True
        granted = self.fill()
        # A script passing by (any other client's call would do) lets the queue head in.
        context = context_for(direct)
        await _release.release(context, spec, secrets.token_hex(16), 1000)
        await self.settle(granted)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.eligible("holding")))
    def renew(self, data: st.DataObject) -> None:
        actor = self.pick(data, "holding")
        self.run(self._renew(actor))

    async def _renew(self, actor: Actor) -> None:
        spec = actor.lock._spec
        context = context_for(self.clients[0])
        reply = await context.run(spec.renew, spec.renew_keys, (actor.token(), int(TTL * 1000)))
        assert int(reply) == (0 if actor.lost else 1)

    # -- the server agrees with the model after every step --------------------------------

    @invariant()
    def server_matches_model(self) -> None:
        if self.actors:
            self.run(self._check())

    async def _check(self) -> None:
        for actor in self.actors:
            if actor.state == "waiting":
                assert actor.task is not None and not actor.task.done(), actor
        live = self.live()
        some = self.actors[0]
        if self.kind == "rwlock":
            reader = some.sides["r"]
            assert isinstance(reader, ReadLock)
            rw_info = await reader.inspect()
            writers = [a.token() for a in live if a.side == "w"]
            assert rw_info.writer == (writers[0] if writers else None)
            assert rw_info.readers == sum(1 for a in live if a.side == "r")
            queue_length, fence = rw_info.queue_length, rw_info.fence
        elif self.kind == "semaphore":
            sem = some.sides["x"]
            assert isinstance(sem, RedisSemaphore)
            sem_info = await sem.inspect()
            assert sem_info.holders == len(live)
            queue_length, fence = sem_info.queue_length, sem_info.fence
        else:
            mutex = some.sides["x"]
            assert isinstance(mutex, RedisMutex)
            mutex_info = await mutex.inspect()
            assert mutex_info.owner == (live[0].token() if live else None)
            queue_length, fence = mutex_info.queue_length, mutex_info.fence
        assert queue_length == len(self.queue)
        # Fences rise in the order the model granted, and the counter is at the last one.
        in_order = [self.observed[seq] for seq in sorted(self.observed)]
        assert in_order == sorted(set(in_order)), in_order
        if self.fence in self.observed:
            assert fence == self.observed[self.fence]
        assert fence >= max(in_order, default=0)

    def teardown(self) -> None:
        if self.clients:
            self.run(self._teardown())
        self.loop.close()
        _STEPS.append(self.steps)

    async def _teardown(self) -> None:
        for actor in self.actors:
            if actor.state == "waiting" and actor.task is not None:
                actor.task.cancel()
                await asyncio.gather(actor.task, return_exceptions=True)
        for actor in self.actors:
            if actor.state == "holding":
                try:
                    await actor.lock.release()
                except LockLost:
                    assert actor.lost
        orphans = await leftovers(self.clients[0], self.kind, self.name)
        for client in self.clients:
            for context in list(getattr(client, "_aiolocks_contexts", {}).values()):
                await context.aclose()
            await client.aclose()
        assert orphans == {}, orphans


def test_model_based_acquire_release_cancel_expire_renew(valkey_notify: ServerProcess) -> None:
    def machine() -> Any:
        return LockModel(valkey_notify.url)

    _STEPS.clear()
    # Typed as a plain callable: hypothesis < 6.170 leaves it unannotated (an untyped call
    # under --strict), 6.170+ asks for the class although any factory works; this line
    # type-checks against both.
    run: Callable[..., None] = run_state_machine_as_test
    run(
        machine,
        settings=settings(
            max_examples=200,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,  # the same examples on every run: CI stays reproducible
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    record("6 model-based (hypothesis stateful)", trials=sum(_STEPS),
           note=f"{len(_STEPS)} examples, {sum(_STEPS)} steps, each checked")  # fmt: skip
