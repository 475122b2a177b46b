"""User-facing errors.

A `UserError` is a problem with what the user gave us (a config key, a file, a layout). The CLI prints
its message as one line and exits with code 2, without a traceback. Everything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""

    exit_code = 2
    every_rank = False
    """True when every rank of a launched run raises the same error (so only the main rank prints it)."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, file too large, permission denied); every rank raises
    it after agreeing on the first failure, and nothing half-written was published."""

    every_rank = True
