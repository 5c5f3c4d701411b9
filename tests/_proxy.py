"""A loopback TCP proxy in front of one server, for fault injection in tests.

Clients connect to `Proxy.url` instead of the server. The test can then stall all traffic
(nothing is forwarded either way until `resume`), add one-way latency, drop every
connection at once, or drop the connection that carries a matching request, either before
the server sees it or after the server ran it but before the reply gets back, or hold a
matching request back for a while (the later traffic of its connection waits behind it;
other connections overtake it). Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Drop", "Proxy"]

HOST = "127.0.0.1"
_CHUNK = 65536

# Decides, from a client->server chunk, whether the armed drop fires on it.
Match = Callable[[bytes], bool]


@dataclass
class Drop:
    """An armed drop (see `Proxy.drop_on`) or delay (`Proxy.delay_on`): `fired` is set, and
    `at` (monotonic) noted, when it happened; for a delay, `answered` is set when the server
    has answered the request (its reply came back to the proxy, whether or not the client
    still reads it)."""

    match: Match
    point: str  # "request": drop instead of forwarding; "reply": drop when the reply comes;
    # "delay": forward `delay` seconds late
    fired: asyncio.Event = field(default_factory=asyncio.Event)
    at: float | None = None
    delay: float = 0.0
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def fire(self) -> None:
        self.at = time.monotonic()
        self.fired.set()


class _Link:
    """One client connection and its connection to the server."""

    def __init__(
        self,
        proxy: Proxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.drop_on_reply: Drop | None = None
        self.delayed: Drop | None = None  # a delayed request, until its reply comes
        self.tasks: list[asyncio.Task[None]] = []
        # Set while it forwards; cleared by `Proxy.blackhole_open` for good (a peer gone
        # without a reset: nothing comes back, nothing fails).
        self.alive = asyncio.Event()
        self.alive.set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [
            loop.create_task(self._pump(self.client_reader, self.server_writer, upstream=True)),
            loop.create_task(self._pump(self.server_reader, self.client_writer, upstream=False)),
        ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    if upstream and self.delayed is not None:
                        # The client left while its delayed request was on its way: the
                        # server still gets it, then the end (as the network delivers what
                        # was sent before a close); the reply ends the link.
                        self.server_writer.write_eof()
                        return
                    break
                if self.proxy.latency > 0:
                    await asyncio.sleep(self.proxy.latency)  # one-way delay, order kept
                await self.proxy._flowing.wait()  # stalled: hold everything back
                await self.alive.wait()  # blackholed: never again
                if upstream:
                    trigger = self.proxy._take_trigger(data)
                    if trigger is not None and trigger.point == "request":
                        trigger.fire()
                        break  # the server never sees it
                    if trigger is not None and trigger.point == "delay":
                        trigger.fire()
                        self.delayed = trigger
                        await asyncio.sleep(trigger.delay)
                    elif trigger is not None:
                        self.drop_on_reply = trigger
                elif self.delayed is not None:
                    self.delayed.answered.set()
                    self.delayed = None
                if not upstream and self.drop_on_reply is not None:
                    self.drop_on_reply.fire()
                    break  # the server ran it; the client never sees the reply
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        self.close()

    def close(self) -> None:
        for writer in (self.client_writer, self.server_writer):
            with contextlib.suppress(Exception):
                writer.transport.abort()  # an RST-like close, as a broken link looks
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.proxy._links.discard(self)


class Proxy:
    """Forwards 127.0.0.1:`port` to the server on `target_port`, with fault controls."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.latency = 0.0  # seconds added to every chunk, each direction
        self.connections = 0  # accepted so far
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._triggers: list[Drop] = []

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not started"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(self, (reader, writer), upstream)
        self._links.add(link)
        link.start()

    # -- controls ----------------------------------------------------------------------

    def stall(self) -> None:
        """Stop forwarding, both ways, on every connection (data waits in the proxy)."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward again, starting with what was held back."""
        self._flowing.set()

    def blackhole_open(self) -> int:
        """Stop forwarding, for good, on every connection open now (the peer is gone without
        a reset: writes are taken, nothing comes back); later connections work. Returns how
        many."""
        links = list(self._links)
        for link in links:
            link.alive.clear()
        return len(links)

    def drop_all(self) -> int:
        """Close every connection now (clients see a reset); returns how many."""
        links = list(self._links)
        for link in links:
            link.close()
        return len(links)

    def drop_on(self, match: Match, point: str) -> Drop:
        """Drop the connection of the next request chunk that `match`es, once.

        point "request": the chunk is not forwarded (the server never runs it);
        "reply": it is forwarded, and the connection is dropped when the reply comes
        back (the server ran it, the client never learns the result).
        """
        if point not in ("request", "reply"):
            raise ValueError(f"point must be 'request' or 'reply', not {point!r}")
        trigger = Drop(match, point)
        self._triggers.append(trigger)
        return trigger

    def delay_on(self, match: Match, delay: float) -> Drop:
        """Hold the next request chunk that `match`es back `delay` seconds, once, before
        forwarding it; what follows it on its connection waits behind it. It reaches the
        server even if the client closes the connection meanwhile."""
        trigger = Drop(match, "delay", delay=delay)
        self._triggers.append(trigger)
        return trigger

    def disarm(self) -> None:
        self._triggers.clear()

    def _take_trigger(self, data: bytes) -> Drop | None:
        for trigger in self._triggers:
            if trigger.match(data):
                self._triggers.remove(trigger)
                return trigger
        return None

    async def aclose(self) -> None:
        self.resume()
        if self._server is not None:
            self._server.close()
        tasks = [task for link in list(self._links) for task in link.tasks]
        self.drop_all()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
