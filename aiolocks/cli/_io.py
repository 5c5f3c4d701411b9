"""The streams a command reads and writes (injectable, so `main(argv)` runs in tests), and
JSON output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["Streams", "write_json"]


@dataclass(frozen=True, slots=True)
class Streams:
    stdin: TextIO
    stdout: TextIO
    stderr: TextIO

    def say(self, text: str) -> None:
        """A line of plain output."""
        print(text, file=self.stdout, flush=True)


def write_json(out: TextIO, value: Any) -> None:
    json.dump(value, out, indent=2, ensure_ascii=False)
    out.write("\n")
    out.flush()
