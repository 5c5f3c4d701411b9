"""The curated public surface: `__all__` is exactly what users import, shown as `aiolocks.X`."""

from __future__ import annotations

import types

import aiolocks


def test_all_lists_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(aiolocks).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(aiolocks.__all__) == public
    assert isinstance(aiolocks.__all__, tuple)


def test_every_public_name_says_aiolocks() -> None:
    for name in aiolocks.__all__:
        obj = getattr(aiolocks, name)
        assert obj.__module__ == "aiolocks", name
        assert obj.__doc__, f"{name} has no docstring"


def test_limit_is_public_with_its_fields() -> None:
    limit = aiolocks.Limit(350, per=10.0)
    assert (limit.rate, limit.per, limit.burst) == (350, 10.0, None)
    assert "Limit" in aiolocks.__all__


def test_error_tree() -> None:
    assert issubclass(aiolocks.LockTimeout, TimeoutError)
    for name in ("LockTimeout", "LockNotOwned", "LockLost", "LockReentry", "ServerUnavailable"):
        assert issubclass(getattr(aiolocks, name), aiolocks.LockError)
    error = aiolocks.LockNotOwned("orders:42", "the current task does not hold it")
    assert "orders:42" in str(error) and error.name == "orders:42"
