"""A native synchronous mutex on aiolocks' own scripts: the prototype `aiolocks.sync`'s
design was measured against (docs/architecture.md, "The sync door"). Benchmark only.

Threads call the mutex scripts directly through a blocking redis-py client; a queued thread
sleeps on a `threading.Event` set by one pub/sub listener thread per process (or by a
releaser of the same process, which the script does not publish for), with the owner's
lease as the safety-net timer. It leaves out what a product needs and the hot path does not
pay for on every call (lease renewal, waiter heartbeats, loss reports, cancellation
clean-up): it is the best a second, native engine could do, to compare with the one engine
driven from a background loop.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import redis

from aiolocks._scripts import load
from aiolocks.mutex import mutex_spec

_ACQUIRE = load("mutex_acquire")
_RELEASE = load("mutex_release")


class NativeProcess:
    """One process's client, listener and parked waiters for one name."""

    def __init__(self, url: str, name: str, ttl: float = 30.0) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        spec = mutex_spec("aiolocks", name)
        self.keys = spec.keys
        self.channel = spec.channel
        self.ttl_ms = int(ttl * 1000)
        self.tag = f"n{os.getpid()}"
        self.parked: dict[str, threading.Event] = {}
        for script in (_ACQUIRE, _RELEASE):
            self.client.script_load(script.source)
        self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        sharded = self.client.info("server").get("redis_version", "0") >= "7"
        (self.pubsub.ssubscribe if sharded else self.pubsub.subscribe)(self.channel)
        self.listener = threading.Thread(target=self._listen, args=(sharded,), daemon=True)
        self.listener.start()

    def _listen(self, sharded: bool) -> None:
        read = self.pubsub.get_sharded_message if sharded else self.pubsub.get_message
        while True:
            message: Any = read(timeout=None)
            if message and message["type"] in ("message", "smessage"):
                token = message["data"].split(b" ", 1)[0].decode()
                self._wake(token)

    def _wake(self, token: str) -> None:
        event = self.parked.get(token)
        if event is not None:
            event.set()

    def lock(self) -> NativeMutex:
        return NativeMutex(self)


class NativeMutex:
    """Used by one thread at a time (one token per acquisition)."""

    def __init__(self, process: NativeProcess) -> None:
        self.p = process
        self.member = ""

    def acquire(self) -> int:
        p = self.p
        token = secrets.token_hex(16)
        self.member = member = f"{token}:{p.ttl_ms}:{p.tag}:x"
        event = p.parked[token] = threading.Event()
        try:
            while True:
                reply = p.client.evalsha(_ACQUIRE.sha, 4, *p.keys, member, "wait", p.channel)
                if reply[0] == 1:
                    return int(reply[1])
                event.wait(max(0.001, int(reply[1]) / 1000))  # the lease's end: safety net
                event.clear()
        finally:
            del p.parked[token]

    def release(self) -> None:
        p = self.p
        reply = p.client.evalsha(_RELEASE.sha, 4, *p.keys, self.member, p.channel)
        if len(reply) >= 4:  # handed on: a waiter of this process is not published to
            p._wake(reply[1].decode() if isinstance(reply[1], bytes) else reply[1])
