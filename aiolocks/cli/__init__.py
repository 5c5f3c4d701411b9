"""The `aiolocks` command line: inspect, list and force-release locks on a server, run the
demo.

Installed as the `aiolocks` script (also `python -m aiolocks.cli`). Tables need `rich`
(`pip install 'aiolocks[cli]'`); `--json` output needs nothing beyond aiolocks itself.
"""

from ._main import main as main

__all__ = ["main"]
