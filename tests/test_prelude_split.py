"""The prelude is cut into its top-level items, never inside a function."""

from __future__ import annotations

import pytest

from aiolocks._scripts import _blocks

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
