"""The prelude is cut into its top-level items, never inside a function."""

from __future__ import annotations

import pytest

from aiolocks._scripts import REST_OF_PRELUDE, _blocks, _script

PRELUDE = """-- header

local function first(x)
  local y = x

  return y
end

-- second
local function second()
  return first(1)
end
"""


def test_a_blank_line_inside_a_function_keeps_its_tail() -> None:
    blocks = dict(_blocks(PRELUDE))
    assert blocks[frozenset({"first"})].endswith("  return y\nend")
    assert frozenset({"second"}) in blocks


def test_an_item_cut_inside_its_function_is_refused() -> None:
    with pytest.raises(ValueError, match="end"):
        _blocks("local function f()\n  local a = 1\n\nlocal b = 2\nend\n")


def test_helpers_only_the_code_past_the_mark_uses_are_defined_at_the_mark() -> None:
    head = "local token = split_member(ARGV[1])\nif token then\n  return 1\nend\n"
    tail = "return pop_live(KEYS[1], KEYS[2], nil, 0)\n"
    source = _script("marked", head + REST_OF_PRELUDE + tail).source
    hot_path = source.index(head)
    assert source.index("local function split_member") < hot_path
    assert source.index("local function pop_live") > hot_path
    assert source.count("local function split_member") == 1  # pop_live uses it: not twice
    assert REST_OF_PRELUDE not in source
    unmarked = _script("unmarked", head + tail).source
    assert unmarked.index("local function pop_live") < unmarked.index(head)
