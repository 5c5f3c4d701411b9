"""The server-side operations, one `.lua` file each, with the shared prelude prepended.

A `Script` is immutable text plus its SHA1: nothing here is bound to a client. Loading
into a server happens per client, lazily, when EVALSHA answers NOSCRIPT (see `_runner`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files

__all__ = ["Script", "load", "load_batch"]


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: its file name, full source and SHA1 (the EVALSHA handle)."""

    name: str
    source: str
    sha: str


def _read(filename: str) -> str:
    return files(__name__).joinpath(filename).read_text(encoding="utf-8")


_PRELUDE = _read("_prelude.lua")


def load(name: str, *libraries: str, prelude: bool = True) -> Script:
    """Build the script `name`.lua: the prelude (unless `prelude` is false: scripts that
    touch no wait queue), then `libraries` (each `_<lib>.lua`, Lua shared by one
    primitive's scripts), then the script itself."""
    head = [_PRELUDE] if prelude else []
    parts = [*head, *(_read(f"_{library}.lua") for library in libraries), _read(f"{name}.lua")]
    source = "\n".join(parts)
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def load_batch(name: str, operations: Sequence[str]) -> Script:
    """Build `name`.lua, which runs many calls of `operations` in one script call: the
    prelude, then each operation's own script as it stands, wrapped as a function of
    (KEYS, ARGV) in `OPS[i]` (1-based, in the order given), then `name`.lua, which calls
    them. One file per operation stays the truth; the batch cannot drift from it."""
    wrapped = [
        f"OPS[{index}] = function(KEYS, ARGV)\n{_read(f'{operation}.lua')}\nend"
        for index, operation in enumerate(operations, start=1)
    ]
    parts = [_PRELUDE, "local OPS = {}", *wrapped, _read(f"{name}.lua")]
    source = "\n".join(parts)
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())
