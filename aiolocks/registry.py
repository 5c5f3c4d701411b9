"""`RedisRegistry`: atomic, idempotent name -> dense integer id registration on Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

from ._base._clients import AnyRedis, ensure_async_client
from ._base._errors import map_redis_errors
from ._base._keys import DEFAULT_PREFIX, KeySpace, validate_name, validate_prefix
from ._engine._context import context_for
from ._engine._settings import validate_int
from ._scripts import load

__all__ = ["MAX_NAME_BYTES", "RedisRegistry", "RegistryStatistics"]

_REGISTER = load("registry_register", prelude=False)

MAX_NAME_BYTES = 1024
"""Default longest name, in bytes once encoded (UTF-8 for a `str`)."""

# Most names one coalesced script call carries; more wait for the next call.
_COALESCE_BATCH = 1000
# Ids one `HMGET` of the iterator asks for at most.
_SCAN_BATCH = 1000
# How names and stored bytes map to each other: a `str` is UTF-8, and bytes that are not
# UTF-8 come back as lone surrogates (as `os.fsdecode` does), so every name round-trips.
_ENCODING = "utf-8"
_ERRORS = "surrogateescape"


@dataclass(frozen=True, slots=True)
class RegistryStatistics:
    """A cheap local snapshot of one `RedisRegistry` instance (no Redis call)."""

    name: str
    requested: int  # names asked for through register() / register_many() (cumulative)
    waiting: int  # register() / register_many() calls waiting for their ids now


@final
class RedisRegistry:
    """Names -> ids 1, 2, 3, ...: the same name always gets the same id, for ever.

    - Atomic: the whole get-or-create runs in one script, so concurrent registrations of
      one name, from any number of processes, return one id and never burn a number.
    - Dense: ids are 1..count() with no gaps, in order of first registration.
    - Batched: `register_many()` is one round trip; concurrent `register()` calls on one
      client are joined into shared script calls.
    - Names are `str` (stored as UTF-8) or `bytes`, 1 to `max_name_bytes` bytes long; a
      `str` and its UTF-8 bytes are the same name.
    """

    __slots__ = (
        "_client",
        "_counter",
        "_ids",
        "_max_name_bytes",
        "_name",
        "_names",
        "_requested",
        "_waiting",
    )

    def __init__(
        self,
        client: AnyRedis,
        name: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_name_bytes: int = MAX_NAME_BYTES,
    ) -> None:
        self._client = ensure_async_client(client)
        self._name = validate_name(name)
        keys = KeySpace(validate_prefix(prefix), "registry", self._name)
        self._ids = keys.key("ids")  # HASH name -> id
        self._names = keys.key("names")  # HASH id -> name
        self._counter = keys.key("counter")  # STRING highest id handed out
        self._max_name_bytes = validate_int(max_name_bytes, "max_name_bytes", 1)
        self._requested = 0
        self._waiting = 0

    @property
    def name(self) -> str:
        """The registry's name (not an entry's)."""
        return self._name

    def __repr__(self) -> str:
        return f"<RedisRegistry {self._name!r}>"

    def statistics(self) -> RegistryStatistics:
        """A cheap local snapshot of this instance; `count()` asks the server."""
        return RegistryStatistics(name=self._name, requested=self._requested, waiting=self._waiting)

    async def register(self, name: str | bytes) -> int:
        """The id of `name`, registering it first if it is new."""
        encoded = self._encode(name)
        context = context_for(self._client)
        coalescers: dict[bytes, Coalescer[bytes, int]] = context.keep("registry calls", dict)
        coalescer = coalescers.get(self._ids)
        if coalescer is None:
            coalescer = coalescers[self._ids] = Coalescer(self._register, _COALESCE_BATCH)
        self._requested += 1
        self._waiting += 1
        try:
            return await coalescer.submit(encoded)
        finally:
            self._waiting -= 1

    async def register_many(self, names: Iterable[str | bytes]) -> list[int]:
        """The ids of `names`, in order, registering the new ones: one round trip.

        A name given twice gets one id; new names are numbered in the order they first
        appear. The batch is atomic: no other registration interleaves with it.
        """
        encoded = self._encode_all(names, "names")
        if not encoded:
            return []
        self._requested += len(encoded)
        self._waiting += 1
        try:
            return await self._register(encoded)
        finally:
            self._waiting -= 1

    async def id_of(self, name: str | bytes) -> int | None:
        """The id of `name`, or None if it was never registered (registers nothing)."""
        encoded = self._encode(name)
        found = await self._call("HGET", self._ids, encoded)
        return None if found is None else int(found)

    async def ids_of(self, names: Iterable[str | bytes]) -> list[int | None]:
        """The ids of `names` in order (None for unregistered ones): one round trip."""
        encoded = self._encode_all(names, "names")
        if not encoded:
            return []
        found = await self._call("HMGET", self._ids, *encoded)
        return [None if value is None else int(value) for value in found]

    async def name_of(self, id: int) -> str | None:
        """The name registered with `id`, or None if no name has that id yet.

        Names registered as bytes that are not UTF-8 come back with lone surrogates for
        the undecodable bytes (as `os.fsdecode` does); `name_bytes_of()` gives the bytes.
        """
        found = await self.name_bytes_of(id)
        return None if found is None else found.decode(_ENCODING, _ERRORS)

    async def name_bytes_of(self, id: int) -> bytes | None:
        """The name registered with `id` exactly as stored, or None."""
        _validate_id(id)
        found: bytes | None = await self._call("HGET", self._names, id)
        return found

    async def names_of(self, ids: Iterable[int]) -> list[str | None]:
        """The names of `ids` in order (None for ids not handed out yet): one round trip."""
        wanted = list(_iterate(ids, "ids"))
        for id in wanted:
            _validate_id(id)
        if not wanted:
            return []
        found = await self._call("HMGET", self._names, *wanted)
        return [None if value is None else value.decode(_ENCODING, _ERRORS) for value in found]

    async def count(self) -> int:
        """How many names are registered (the highest id, as ids are dense)."""
        return int(await self._call("HLEN", self._ids))

    async def items(self, *, batch: int = _SCAN_BATCH) -> AsyncIterator[tuple[str, int]]:
        """Every (name, id) pair in id order, `batch` ids per round trip.

        Each step is one small `HMGET` by id (ids are dense), so a registry of millions
        never blocks the server the way `HGETALL` would; unlike `HSCAN`, no pair is seen
        twice. Names registered while iterating are included.
        """
        validate_int(batch, "batch", 1)
        first = 1
        while True:
            last = first + batch - 1
            with map_redis_errors(self._name):
                counter, found = await context_for(self._client).call_many(
                    [("GET", self._counter), ("HMGET", self._names, *range(first, last + 1))]
                )
            for id, value in enumerate(found, start=first):
                if value is not None:
                    yield value.decode(_ENCODING, _ERRORS), id
            if last >= int(counter or 0):
                return
            first = last + 1

    def __aiter__(self) -> AsyncIterator[tuple[str, int]]:
        return self.items()

    async def _call(self, *args: Any) -> Any:
        with map_redis_errors(self._name):
            return await context_for(self._client).call(*args)

    async def _register(self, names: list[bytes]) -> list[int]:
        keys = (self._ids, self._names, self._counter)
        with map_redis_errors(self._name):
            ids: list[Any] = await context_for(self._client).run(_REGISTER, keys, tuple(names))
        return [int(id) for id in ids]

    def _encode(self, name: object, what: str = "name") -> bytes:
        if isinstance(name, str):
            try:
                encoded = name.encode(_ENCODING, _ERRORS)
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"registry {self._name!r}: {what} {name!r} cannot be encoded as UTF-8 ({exc})"
                ) from None
        elif isinstance(name, bytes):
            encoded = name
        else:
            raise TypeError(
                f"registry {self._name!r}: {what} must be str or bytes, not {type(name).__name__}"
            )
        if not encoded:
            raise ValueError(f"registry {self._name!r}: {what} must not be empty")
        if len(encoded) > self._max_name_bytes:
            raise ValueError(
                f"registry {self._name!r}: {what} is {len(encoded)} bytes long, more than "
                f"max_name_bytes={self._max_name_bytes}"
            )
        return encoded

    def _encode_all(self, names: Iterable[str | bytes], what: str) -> list[bytes]:
        return [
            self._encode(name, f"{what}[{index}]")
            for index, name in enumerate(_iterate(names, what))
        ]


def _iterate(values: object, what: str) -> Iterable[Any]:
    # A lone str/bytes is iterable too, and its characters are never what is meant.
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be an iterable (a list, say), not {type(values).__name__}")
    return values


def _validate_id(id: object) -> int:
    if isinstance(id, bool) or not isinstance(id, int):
        raise TypeError(f"an id must be an int, not {type(id).__name__}")
    if id < 1:
        raise ValueError(f"ids start at 1, got {id!r}")
    return id


# -- concurrent register() calls joined into batched script calls --------------------------
# One call in flight per registry and client: while a batch is on its way to Redis, new
# requests gather in the next, so under load batches grow by themselves (10,000 concurrent
# `register()` calls become a handful of script calls and never exhaust the connection
# pool), and a lone request costs one call, as before.

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalescer(Generic[K, V]):
    """Serve `submit(key)` calls through `flush(keys) -> values` in batches of `max_batch`.

    Requests for the same key that are pending together share one answer. A caller that is
    cancelled stops waiting; its key is still sent (the call is idempotent by contract).
    """

    def __init__(self, flush: Callable[[list[K]], Awaitable[list[V]]], max_batch: int) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: dict[K, asyncio.Future[V]] = {}
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, key: K) -> V:
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = asyncio.get_running_loop().create_future()
            if self._runner is None:
                # Started now, it first runs on the next loop iteration: every request made
                # in this iteration is in its first batch.
                self._runner = asyncio.create_task(self._run())
        return await asyncio.shield(future)

    async def _run(self) -> None:
        batch: dict[K, asyncio.Future[V]] = {}
        try:
            while self._pending:
                keys = list(self._pending)[: self._max_batch]
                batch = {key: self._pending.pop(key) for key in keys}
                try:
                    values = await self._flush(keys)
                except Exception as exc:  # handed to every caller of the batch
                    for future in batch.values():
                        if not future.done():
                            future.set_exception(exc)
                            future.exception()  # retrieved: callers that left must not log it
                    continue
                for future, value in zip(batch.values(), values, strict=True):
                    if not future.done():
                        future.set_result(value)
        except asyncio.CancelledError:  # the batch in flight and those not sent yet
            pending, self._pending = self._pending, {}
            for future in (*batch.values(), *pending.values()):
                future.cancel()
            raise
        finally:
            self._runner = None
