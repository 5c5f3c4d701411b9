"""`python -m aiolocks.cli`: the same as the `aiolocks` script."""

import sys

from ._main import main

sys.exit(main())
