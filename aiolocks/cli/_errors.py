"""What can end a command early, each with its exit status: 1 not found or refused, 2 usage,
3 server unreachable. `main` prints the message (one line, no traceback) and exits."""

from __future__ import annotations

__all__ = [
    "EXIT_LEASE_LOST",
    "EXIT_NOT_ACQUIRED",
    "EXIT_OK",
    "CliError",
    "NotFound",
    "Refused",
    "Unreachable",
    "UsageError",
]

EXIT_OK = 0
# `aiolocks run`: the lock was not acquired within --timeout (EX_TEMPFAIL: try later); CMD
# was not started.
EXIT_NOT_ACQUIRED = 75
# `aiolocks run`: the lease was lost while CMD ran. Not one of sysexits' 64-78 (which
# programs do use), nor 1, 2, 126, 127 or 128 + a signal number.
EXIT_LEASE_LOST = 79


class CliError(Exception):
    """A command could not do what was asked; `str()` is the message for the user."""

    status = 1


class NotFound(CliError):
    """Nothing by that name (or no such holder) on the server."""


class Refused(CliError):
    """Declined: not confirmed, a holder that changed meanwhile, the server said no, or an
    optional dependency missing."""


class UsageError(CliError):
    """The command line asks for something impossible (e.g. an ambiguous name)."""

    status = 2


class Unreachable(CliError):
    """The server could not be reached, did not answer in time, or is not a Redis server."""

    status = 3
