"""The simulated network and server.

Each connection a client opens is a `Conn`: a `SimTransport` on the client side (what
redis-py's stream, and the auto-pipeline's direct reads, see) and a fakeredis socket on the
server side, which parses the RESP bytes and runs the commands (the real Lua scripts, by
lupa) on a `FakeServer` whose clock is the loop's virtual time (`ServerClock`). Bytes
travel each way in order (FIFO per connection and direction) after a delay the simulator
chooses per connection, so connections reorder among themselves, never within one. The
simulator can stall a connection, reset it, delay or lose a pub/sub message (a loss resets
the connection, as Redis does to a subscriber whose output buffer overflows), expire keys
actively (publishing `expired` keyspace events when they are on) and restart the server
empty.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import redis
from fakeredis._core import FakeServer
from fakeredis._helpers import SimpleError, SimpleString
from fakeredis._socket._fakesocket import FakeSocket

from ._loop import Proc, VirtualLoop, in_process

EPOCH = 1_790_000_000.0  # the server's wall clock at virtual monotonic time 0
# The scripts that renew a lease (the keeper's batch, and each single renewal).
RENEWALS = ("renew_batch", "renew_owner", "renew_member", "election_renew")


class Observer(Protocol):
    """Told of every command the server runs (the oracle): `before` returns what `after`
    is given back."""

    def before(self, conn: Any, fields: list[bytes]) -> Any: ...

    def after(self, conn: Any, fields: list[bytes], seen: Any) -> None: ...


class ServerClock:
    """Stands in for the `time` module in fakeredis: its `time()` is virtual."""

    def __init__(self, loop: VirtualLoop) -> None:
        import time as real

        self._real = real
        self._loop = loop

    def time(self) -> float:
        # `server_offset`: how far the server's clock was stepped (back) by a fault.
        return EPOCH + self._loop.time() + getattr(self._loop, "server_offset", 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _encode(reply: Any, out: list[bytes]) -> None:
    """`reply` (a fakeredis result) as RESP2."""
    if isinstance(reply, bytes):
        out.append(b"$%d\r\n%s\r\n" % (len(reply), reply))
    elif isinstance(reply, SimpleString):
        out.append(b"+%s\r\n" % reply.value)
    elif isinstance(reply, SimpleError):
        out.append(b"-%s\r\n" % reply.value.replace("\r", " ").replace("\n", " ").encode())
    elif isinstance(reply, bool):
        out.append(b":%d\r\n" % int(reply))
    elif isinstance(reply, int):
        out.append(b":%d\r\n" % reply)
    elif reply is None:
        out.append(b"$-1\r\n")
    elif isinstance(reply, (list, tuple)):
        out.append(b"*%d\r\n" % len(reply))
        for item in reply:
            _encode(item, out)
    elif isinstance(reply, str):
        _encode(reply.encode(), out)
    elif isinstance(reply, float):
        _encode(repr(reply).encode(), out)
    else:
        raise TypeError(f"cannot encode {reply!r}")


def _is_push(reply: Any) -> bool:
    return isinstance(reply, list) and bool(reply) and reply[0] in (b"message", b"smessage")


class SimSocket(FakeSocket):
    """A fakeredis socket whose replies stay raw (encoded to RESP by `Conn`), and which
    tells the network what each command was, for the trace."""

    conn: Conn

    def _decode_result(self, result: Any) -> Any:
        return result

    def _process_command(self, fields: list[bytes]) -> None:
        net = self.conn.net
        net.command(self.conn, fields)
        if net.intercept is not None and net.intercept(self.conn, fields):
            self.conn.reset(f"injected at {fields[0].decode()} {fields[1:2]!r}")
            return
        if len(fields) == 3 and fields[0].upper() == b"CONFIG" and fields[1].upper() == b"GET":
            # fakeredis has no CONFIG GET: answer the one the engine asks, from the config.
            value = self._server.config.get(fields[2].lower())
            self.put_response([] if value is None else [fields[2], value])
            return
        observer = net.observer
        seen = None if observer is None else observer.before(self.conn, fields)
        slow = net.renewal_delay(self.conn, fields)
        if slow:
            self.conn.flush_replies()  # what came before goes at the usual pace
        super()._process_command(fields)
        if slow:
            self.conn.flush_replies(extra=slow)
        if observer is not None:
            observer.after(self.conn, fields, seen)


class Net:
    """The server and every connection to it, with the faults the simulator injects."""

    def __init__(self, loop: VirtualLoop, rng: random.Random, keyspace_events: bool) -> None:
        self.loop = loop
        self.rng = rng
        self.keyspace_events = keyspace_events
        self.sim = in_process(None)
        self.server = self._new_server()
        self.down_until = 0.0
        self.conns: list[Conn] = []
        self.next_id = 1
        self.trace: deque[str] = deque(maxlen=500_000)
        self.restarts: list[float] = []
        self.restart_starts: list[float] = []  # when each restart emptied the server
        self.commands = 0
        self._expiry: asyncio.TimerHandle | None = None
        self.on_change: Callable[[], None] | None = None
        self.scripts: dict[bytes, str] = {}
        # Scenarios: called with each command before it runs; True drops the connection.
        self.intercept: Callable[[Conn, list[bytes]], bool] | None = None
        self.paused_until = 0.0
        # The oracle on the server's truth (`_oracle.Oracle`): told of every command run.
        self.observer: Observer | None = None
        # Slow replies to lease renewals: (until, extra delay), per process (None: all).
        self.slow_renewals: dict[Proc | None, tuple[float, float]] = {}
        self.clock_steps: list[tuple[float, float]] = []  # (when, seconds back)
        # A waiter queued behind a cohort's token (the acquire script's `tell_cohort`): when
        # the news reached each subscribed process, by (process, token): the message's
        # arrival, or, when it was lost, the arrival of the reset that lost it (the oracle's
        # EXTRA WAIT counts the cohort's time bound from there).
        self.announced: dict[tuple[Proc, str], list[float]] = {}

    def server_time(self) -> float:
        """The server's clock now (seconds since the epoch): virtual time, as stepped."""
        return EPOCH + self.loop.time() + getattr(self.loop, "server_offset", 0.0)

    def step_clock_back(self, seconds: float) -> None:
        """The server's clock jumps back (a failover to a replica whose clock is behind,
        the data kept): every later TIME, expiry and deadline is on the stepped clock."""
        self.log(f"SERVER CLOCK BACK {seconds:.3f} s")
        self.loop.server_offset = getattr(self.loop, "server_offset", 0.0) - seconds  # type: ignore[attr-defined]
        self.clock_steps.append((self.loop.time(), seconds))
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._arm_expiry()

    def renewal_delay(self, conn: Conn, fields: list[bytes]) -> float:
        """The extra delay of this command's reply: a lease renewal during a slow-renewal
        fault of its process (0 for anything else)."""
        if not self.slow_renewals or fields[0].upper() not in (b"EVALSHA", b"EVAL"):
            return 0.0
        slow = self.slow_renewals.get(conn.proc) or self.slow_renewals.get(None)
        if slow is None or slow[0] <= self.loop.time():
            return 0.0
        name = fields[0].upper() == b"EVALSHA" and self.scripts.get(fields[1])
        if not name and len(fields) > 1:
            name = self.scripts.get(_sha1(fields[1]))
        if name not in RENEWALS:
            return 0.0
        self.log(f"{conn.proc.name} c{conn.id} SLOW RENEWAL REPLY +{slow[1]:.3f} s")
        return slow[1]

    def pause(self, seconds: float) -> None:
        """Like `CLIENT PAUSE`: no command is answered for `seconds` (every connection,
        new ones too, holds its traffic until then)."""
        self.log(f"SERVER PAUSE {seconds:.3f} s")
        self.paused_until = self.loop.time() + seconds
        for conn in self.conns:
            conn.stall(seconds)

    def run_command(self, *args: bytes) -> Any:
        """Run one command on the server now, as an operator would (not traced as a
        client's)."""
        sock = SimSocket(self.server, 0, None, redis.Redis)
        sock.conn = _Operator(self)  # type: ignore[assignment]
        out: list[bytes] = []
        _encode([*args], out)
        sock.sendall(b"".join(out))
        assert sock.responses is not None
        reply = sock.responses.get_nowait()
        sock.close()
        self.deliver_all()
        return reply

    def _new_server(self) -> FakeServer:
        config = {b"notify-keyspace-events": b"KEA" if self.keyspace_events else b""}
        return FakeServer(version=(7,), config=config)

    @property
    def db(self) -> Any:
        return self.server.dbs[0]

    def log(self, text: str) -> None:
        self.trace.append(f"{self.loop.time() - 1000:10.4f} {text}")

    # -- connections -------------------------------------------------------------------

    async def connect(self, proc: Proc, pubsub_hint: bool = False) -> Conn:
        await asyncio.sleep(self.rng.uniform(0.0002, 0.001))
        if self.loop.time() < self.down_until:
            raise ConnectionRefusedError(111, "Connection refused (server restarting)")
        conn = Conn(self, proc, self.next_id)
        self.next_id += 1
        self.conns.append(conn)
        self.log(f"{proc.name} c{conn.id} connected")
        return conn

    def command(self, conn: Conn, fields: list[bytes]) -> None:
        self.commands += 1
        if self.trace.maxlen:
            self.log(f"{conn.proc.name} c{conn.id} > {self._describe(fields)}")

    def _describe(self, fields: list[bytes]) -> str:
        """A command for the trace: a script by name, with the names its keys are of and
        its arguments (each shortened)."""
        name = fields[0].upper()
        if name in (b"EVALSHA", b"EVAL") and len(fields) > 2 and fields[2].isdigit():
            script = (
                self.scripts.get(fields[1], fields[1][:8].decode())
                if name == b"EVALSHA"
                else f"EVAL({self.scripts.get(_sha1(fields[1]), '?')})"
            )
            count = int(fields[2])
            keys = fields[3 : 3 + count]
            tags = sorted({k.split(b"{", 1)[-1].split(b"}", 1)[0].decode() for k in keys})
            args = " ".join(_short(a, 48) for a in fields[3 + count : 3 + count + 6])
            more = " ..." if len(fields) > 3 + count + 6 else ""
            return f"{script} {{{','.join(tags)}}} {args}{more}"
        text = " ".join(_short(f) for f in fields[:8])
        return text + (" ..." if len(fields) > 8 else "")

    def deliver_all(self) -> None:
        """Send every socket's pending replies and messages down its connection."""
        for conn in self.conns:
            conn.flush_replies()
        self._arm_expiry()
        if self.on_change is not None:
            self.on_change()

    # -- faults ------------------------------------------------------------------------

    def restart(self, down_for: float) -> None:
        """The server restarts without persistence: every connection drops, every key and
        cached script is gone; connections are refused for `down_for` seconds."""
        self.log(f"SERVER RESTART (down {down_for:.3f} s)")
        self.restarts.append(self.loop.time() + down_for)  # when it answers again
        self.restart_starts.append(self.loop.time())
        for conn in list(self.conns):
            conn.reset("server restart")
        self.server = self._new_server()
        self.down_until = self.loop.time() + down_for

    def crash(self, proc: Proc) -> None:
        for conn in list(self.conns):
            if conn.proc is proc:
                conn.vanish()

    # -- active expiry -----------------------------------------------------------------

    def _arm_expiry(self) -> None:
        heap = self.db._expiry_heap
        if not heap:
            return
        at = heap[0][0] - EPOCH - getattr(self.loop, "server_offset", 0.0)
        if self._expiry is not None and not self._expiry.cancelled():
            if self._expiry.when() <= at + 0.1:
                return
            self._expiry.cancel()
        # Redis expires keys actively within about 100 ms of their time.
        when = max(at, self.loop.time()) + self.rng.uniform(0.001, 0.1)
        self._expiry = self.loop.call_at(when, self._expire, context=self.sim)

    def _expire(self) -> None:
        self._expiry = None
        db = self.db
        db.time = self.server_time()
        gone: list[bytes] = []
        while db._expiry_heap and db._expiry_heap[0][0] < db.time:
            _, key = db._expiry_heap[0]
            item = db._dict.get(key)
            if item is not None and db.expired(item):
                gone.append(key)
                del db._dict[key]
            import heapq

            heapq.heappop(db._expiry_heap)
        if gone and self.keyspace_events:
            for key in gone:
                self.log(f"server: expired {_short(key)}")
                channel = b"__keyspace@0__:" + key
                for sock in list(self.server.subscribers.get(channel, ())):
                    sock.put_response([b"message", channel, b"expired"])
        self.deliver_all()

    # -- reading the server's state (for the invariants; nothing is sent) ---------------

    def now_ms(self) -> float:
        return self.server_time() * 1000

    def value(self, key: bytes) -> Any:
        """The live value at `key` (None if missing or past its expiry)."""
        item = self.db._dict.get(key)
        if item is None:
            return None
        if item.expireat is not None and item.expireat <= self.server_time():
            return None
        return item.value

    def live_items(self) -> Iterable[tuple[bytes, Any]]:
        now = self.server_time()
        for key, item in self.db._dict.items():
            if item.expireat is None or item.expireat > now:
                yield key, item


class _Operator:
    """The `conn` of a socket the simulator itself uses."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.id = 0
        self.proc = Proc("operator")

    def reset(self, why: str) -> None:
        pass


def _sha1(source: bytes) -> bytes:
    import hashlib

    return hashlib.sha1(source).hexdigest().encode()


def _short(value: bytes, limit: int = 60) -> str:
    text = value.decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Conn:
    """One connection: the client's transport, the server's socket, and the wire between."""

    def __init__(self, net: Net, proc: Proc, ident: int) -> None:
        self.net = net
        self.proc = proc
        self.id = ident
        self.loop = net.loop
        self.client_context = contextvars.copy_context()  # the process's (delivery dies with it)
        self.transport = SimTransport(self)
        self.sock: SimSocket | None = SimSocket(net.server, 0, None, redis.Redis)
        self.sock.conn = self
        self.server = net.server
        self.closed = False
        # The wire: FIFO each way, with a latency the simulator sets (and may change).
        self.latency = net.rng.choice((0.0002, 0.0005, 0.001, 0.003))
        self.jitter = self.latency / 2
        self.base_latency = self.latency  # what a latency fault returns it to
        self.latency_faults = 0  # latency faults in progress (they may overlap)
        self.up_at = 0.0  # when the last client -> server bytes arrive
        self.down_at = 0.0
        self.stalled_until = net.paused_until
        self.push_delay = 0.0  # extra delay of pub/sub messages (a slow subscriber link)
        self.push_loss = 0.0  # probability a message is lost (and the connection reset)
        self.subscriber = False
        self.sent_at = 0.0  # when the bytes being read now were written by the client

    def __repr__(self) -> str:
        return f"<Conn c{self.id} of {self.proc.name}>"

    def _arrival(self, last: float, extra: float = 0.0) -> float:
        rng = self.net.rng
        at = self.loop.time() + self.latency + rng.uniform(0, self.jitter) + extra
        return max(at, last, self.stalled_until) + 1e-7

    # client -> server
    def send_up(self, data: bytes) -> None:
        if self.closed:
            return
        self.up_at = self._arrival(self.up_at)
        self.loop.call_at(self.up_at, self._arrive_up, data, self.loop.time(), context=self.net.sim)

    def _arrive_up(self, data: bytes, sent_at: float) -> None:
        if self.closed or self.sock is None or self.server is not self.net.server:
            return
        self.sent_at = sent_at  # when the commands now run were written (the oracle's)
        try:
            self.sock.sendall(data)
        except Exception as exc:  # a parse error: the server closes the connection
            self.net.log(f"{self.proc.name} c{self.id} server error {exc!r}")
            self.reset(f"protocol error {exc!r}")
            return
        self.net.deliver_all()

    # server -> client
    def flush_replies(self, extra: float = 0.0) -> None:
        sock = self.sock
        if sock is None or self.closed:
            return
        responses = sock.responses
        while responses is not None and not responses.empty():
            reply = responses.get_nowait()
            if isinstance(reply, list) and reply and reply[0] in (b"subscribe", b"ssubscribe"):
                self.subscriber = True
            push = _is_push(reply)
            told = push and bytes(reply[1]).endswith(b":queued")
            if push and self.push_loss and self.net.rng.random() < self.push_loss:
                self.net.log(f"{self.proc.name} c{self.id} LOST {_summary(reply)}")
                if told:
                    self._told(bytes(reply[2]), max(self.down_at, self.loop.time()) + 1e-7)
                self.reset("a pub/sub message was lost")
                return
            out: list[bytes] = []
            _encode(reply, out)
            data = b"".join(out)
            if self.net.trace.maxlen:
                what = "push" if push else "<"
                self.net.log(f"{self.proc.name} c{self.id} {what} {_summary(reply)}")
            self.down_at = self._arrival(self.down_at, self.push_delay if push else extra)
            if told:
                self._told(bytes(reply[2]), self.down_at)
            self.loop.call_at(self.down_at, self._arrive_down, data, context=self.client_context)

    def _told(self, token: bytes, at: float) -> None:
        self.net.announced.setdefault((self.proc, token.decode()), []).append(at)

    def _arrive_down(self, data: bytes) -> None:
        if self.transport.lost:
            return
        protocol = self.transport.protocol
        if isinstance(protocol, asyncio.Protocol):
            protocol.data_received(data)

    # faults
    def stall(self, seconds: float) -> None:
        """Nothing moves either way for `seconds` (what is in flight arrives after)."""
        self.net.log(f"{self.proc.name} c{self.id} STALL {seconds:.3f} s")
        self.stalled_until = max(self.stalled_until, self.loop.time() + seconds)
        self.up_at = max(self.up_at, self.stalled_until)
        self.down_at = max(self.down_at, self.stalled_until)

    def reset(self, why: str) -> None:
        """The connection drops: the server forgets it, the client learns it in order
        (after what was already on its way down)."""
        if self.closed:
            return
        self.net.log(f"{self.proc.name} c{self.id} RESET ({why})")
        self._close_server_side()
        at = max(self.down_at, self.loop.time()) + 1e-7
        self.loop.call_at(
            at,
            self.transport.lose,
            ConnectionResetError(104, "Connection reset by peer"),
            context=self.client_context,
        )

    def vanish(self) -> None:
        """The process died: the server sees the connection close."""
        self._close_server_side()

    def client_closed(self) -> None:
        self.net.log(f"{self.proc.name} c{self.id} closed by client")
        # The server reads what was sent before the close, then the close.
        at = max(self.up_at, self.loop.time()) + 1e-7
        self.loop.call_at(at, self._close_server_side, context=self.net.sim)

    def _close_server_side(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.sock is not None:
            sock, self.sock = self.sock, None
            if sock._server is not None:
                sock.close()
                with self.server.lock:
                    sock._cleanup(self.server)
        if self in self.net.conns:
            self.net.conns.remove(self)


def _summary(reply: Any, limit: int = 120) -> str:
    if isinstance(reply, SimpleError):
        text = "ERR:" + reply.value
    elif isinstance(reply, SimpleString):
        text = reply.value.decode()
    elif isinstance(reply, bytes):
        text = _short(reply, limit)
    elif isinstance(reply, list):
        text = "[" + ", ".join(_summary(r, 40) for r in reply) + "]"
    else:
        text = repr(reply)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _settle_close_waiter(protocol: asyncio.BaseProtocol) -> None:
    """Mark the loss kept in a stream protocol's close waiter as seen, as the protocol's own
    `__del__` does. asyncio's `StreamReaderProtocol` stores a reset in that future and marks
    it retrieved only when the protocol is deleted; a write after the reset raises the same
    exception from `StreamWriter.drain`, whose frame (in the exception's traceback) holds the
    writer and so the protocol: a reference cycle. The collector may finalize the future
    first, and the loop logs "Future exception was never retrieved" (seed 883, once in 1,000
    seeds, at the run's closing collection). asyncio's, with any reset connection, not the
    engine's: the engine never awaits that future."""
    inner = getattr(protocol, "inner", protocol)  # the stream's protocol behind `Replies`
    if isinstance(inner, asyncio.StreamReaderProtocol):
        closed = getattr(inner, "_closed", None)
        if isinstance(closed, asyncio.Future) and closed.done() and not closed.cancelled():
            closed.exception()


class SimTransport(asyncio.Transport):
    """The client's end of a `Conn`: an in-memory stream transport."""

    def __init__(self, conn: Conn) -> None:
        super().__init__()
        self.conn = conn
        self.protocol: asyncio.BaseProtocol | None = None
        self.closing = False
        self.lost = False
        self._reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peername":
            return ("127.0.0.1", 6379)
        if name == "sockname":
            return ("127.0.0.1", 40000 + self.conn.id)
        return default

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol  # type: ignore[return-value]  # None once lost, as asyncio's

    def is_closing(self) -> bool:
        return self.closing or self.lost

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing or self.lost:
            return
        self.conn.send_up(bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (0, 0)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.closing or self.lost:
            return
        self.closing = True
        self.conn.client_closed()
        asyncio.get_running_loop().call_soon(self.lose, None, context=self.conn.client_context)

    def abort(self) -> None:
        self.close()

    def lose(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        self.closing = True
        if exc is not None:
            self.conn._close_server_side()
        protocol, self.protocol = self.protocol, None  # as asyncio's transports drop theirs
        if protocol is not None:
            protocol.connection_lost(exc)
            _settle_close_waiter(protocol)
