"""`locked()` answers by asking Redis, so it is a coroutine: `if await m.locked():`. Written
`if m.locked():` (as with `asyncio.Lock` or redis-py's `Lock`) a plain coroutine is always
true, and Python only warns, later, that it was never awaited. The coroutine `locked()`
returns here says so at once instead: its truth value raises `TypeError`. Type checkers
see a plain coroutine, so mypy's opt-in `truthy-bool` error code flags `if m.locked():`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Concatenate, NoReturn, ParamSpec, TypeVar

__all__ = ["AsyncWithOnly", "Query", "query"]

T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")


class Query(Coroutine[Any, Any, T]):
    """A coroutine (awaitable, and accepted by `asyncio.create_task`) that refuses to be
    used as a truth value."""

    __slots__ = ("_coroutine", "_what")

    def __init__(self, coroutine: Coroutine[Any, Any, T], what: str) -> None:
        self._coroutine = coroutine
        self._what = what

    def __await__(self) -> Generator[Any, None, T]:
        return self._coroutine.__await__()

    def send(self, value: Any) -> Any:
        return self._coroutine.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coroutine.throw(*args)

    def close(self) -> None:
        self._coroutine.close()

    if not TYPE_CHECKING:
        # Hidden from type checkers: with no `__bool__` in its type, mypy's `truthy-bool`
        # error code names the mistake ("returns Coroutine[...] which does not implement
        # __bool__ ... could always be true"), where a `NoReturn` one would only make the
        # rest of the function unreachable.

        def __bool__(self) -> NoReturn:
            self._coroutine.close()  # never to be awaited: no "never awaited" warning too
            raise TypeError(
                f"{self._what} is a coroutine (it asks Redis): write `await {self._what}`; "
                "as a truth value it would always be true"
            )

    def __repr__(self) -> str:
        return f"<Query {self._what} {self._coroutine!r}>"


def query(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Query[T]]:
    """Make the coroutine method `method` return a `Query` (see the module docstring)."""

    @functools.wraps(method)
    def asking(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Query[T]:
        return Query(method(self, *args, **kwargs), f"{type(self).__name__}.{method.__name__}()")

    return asking


class AsyncWithOnly:
    """A base for what is entered with `async with` only: `with lock:` (as with
    `threading.Lock`) raises a `TypeError` that says what to write, as `if lock.locked():`
    does, instead of Python's generic one. Hidden from type checkers, so that mypy still
    reports `with lock:` (no `__enter__`)."""

    __slots__ = ()

    if not TYPE_CHECKING:

        def __enter__(self) -> NoReturn:
            name = type(self).__name__
            raise TypeError(
                f"{name} is an async context manager (it waits on Redis): write "
                f"`async with`, not `with`"
            )

        def __exit__(self, *exc_info: Any) -> None:  # `with` looks it up before __enter__
            return None
