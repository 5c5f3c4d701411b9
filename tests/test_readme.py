"""The README's quickstart runs as written (against a test server instead of localhost)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs(url: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python snippet"
    code = blocks[0].replace("redis://localhost:6379", url)
    assert url in code
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"charging, fence \d+\n", done.stdout), done.stdout
