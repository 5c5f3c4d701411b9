"""The server-side operations, one `.lua` file each, with the shared prelude prepended.

A `Script` is immutable text plus its SHA1: nothing here is bound to a client. Loading
into a server happens per client, lazily, when EVALSHA answers NOSCRIPT (see `_runner`).
"""

from __future__ import annotations

import hashlib
import re
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

# A top-level definition of the prelude: `local function NAME` or `local NAME, ... =`.
_DEFINES = re.compile(r"^local (?:function )?(\w+(?:\s*,\s*\w+)*)", re.MULTILINE)


# Where one top-level item of the prelude ends and the next begins: a blank line followed by
# an unindented comment or `local`. A blank line inside a function (whose body is indented)
# does not cut it; its closing `end` is checked below.
_ITEM_START = re.compile(r"\n\n(?=--|local )")


def _blocks(prelude: str) -> list[tuple[frozenset[str], str]]:
    """The prelude's top-level items that define something, each with the names it
    defines; comment-only items are left out. Raises ValueError for an item holding a
    function that does not end at its last line (it would lose its tail)."""
    blocks = []
    for text in _ITEM_START.split(prelude):
        if "local function " in text and not text.rstrip("\n").endswith("\nend"):
            raise ValueError(f"prelude item does not end with its function's end: {text[:60]!r}")
        names = {name.strip() for found in _DEFINES.findall(text) for name in found.split(",")}
        if names:
            blocks.append((frozenset(names), text))
    return blocks


_PRELUDE_BLOCKS = _blocks(_PRELUDE)
_WORDS = re.compile(r"\w+")
# A Lua comment, to its line's end (no aiolocks script has `--` inside a string).
_COMMENT = re.compile(r"--.*")


def _code_words(text: str) -> frozenset[str]:
    """The words of `text`'s code: a helper named in a comment only is not used."""
    return frozenset(_WORDS.findall(_COMMENT.sub("", text)))


_BLOCK_WORDS = [_code_words(block) for _, block in _PRELUDE_BLOCKS]


def _needed_blocks(body: str) -> list[int]:
    """The indexes of the prelude's definitions that `body` uses, directly or through each
    other, in the prelude's order: a script call runs its whole text, so every helper it
    defines costs the server time on every call (about 1,000 instructions each, callgrind),
    used or not. (Words compared as sets: a regex search per name per script cost every
    import ~0.5 s.)"""
    words = set(_code_words(body))
    used = [False] * len(_PRELUDE_BLOCKS)
    changed = True
    while changed:
        changed = False
        for index, (names, _) in enumerate(_PRELUDE_BLOCKS):
            if not used[index] and not names.isdisjoint(words):
                used[index] = changed = True
                words |= _BLOCK_WORDS[index]
    return [index for index, keep in enumerate(used) if keep]


def _prelude_text(indexes: list[int]) -> str:
    return "\n\n".join(_PRELUDE_BLOCKS[index][1] for index in indexes)


# A script may mark, with this line, where its hot path (which returns) ends: the helpers the
# code above the line uses are defined before the script, the others at the line, so a call
# that returns above it never defines them.
REST_OF_PRELUDE = "-- (the prelude's other helpers are defined here)\n"


def _script(name: str, body: str, prelude: bool = True) -> Script:
    if not prelude:
        source = body
    else:
        head, mark, tail = body.partition(REST_OF_PRELUDE)
        first = _needed_blocks(head)
        source = f"{_prelude_text(first)}\n{head}"
        if mark:
            rest = [index for index in _needed_blocks(body) if index not in first]
            source += f"{_prelude_text(rest)}\n{tail}"
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def load(name: str, *libraries: str, prelude: bool = True) -> Script:
    """Build the script `name`.lua: the prelude's definitions it uses (none if `prelude` is
    false: scripts that touch no wait queue), then `libraries` (each `_<lib>.lua`, Lua
    shared by one primitive's scripts), then the script itself."""
    parts = [*(_read(f"_{library}.lua") for library in libraries), _read(f"{name}.lua")]
    return _script(name, "\n".join(parts), prelude)


def load_batch(name: str, operations: Sequence[str]) -> Script:
    """Build `name`.lua, which runs many calls of `operations` in one script call: the
    prelude, then each operation's own script as it stands, wrapped as a function of
    (KEYS, ARGV) in `OPS[i]` (1-based, in the order given), then `name`.lua, which calls
    them. One file per operation stays the truth; the batch cannot drift from it."""
    wrapped = [
        f"OPS[{index}] = function(KEYS, ARGV)\n{_read(f'{operation}.lua')}\nend"
        for index, operation in enumerate(operations, start=1)
    ]
    return _script(name, "\n".join(["local OPS = {}", *wrapped, _read(f"{name}.lua")]))
