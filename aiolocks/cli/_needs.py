"""Optional dependencies of some commands, checked before any work so that a missing one
is one clear line naming the extra to install."""

from __future__ import annotations

import importlib

from ._errors import Refused

__all__ = ["require"]


def require(module: str, extra: str, what: str) -> None:
    """Raise `Refused` naming `pip install 'aiolocks[<extra>]'` if `module` cannot be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise Refused(f"{what} needs {module}: pip install 'aiolocks[{extra}]'") from None
