"""`python -m aiolocks`: the same as the `aiolocks` command."""

import sys

from .cli import main

sys.exit(main())
