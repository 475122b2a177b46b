"""User-facing errors.

A `UserError` is a problem with what the user gave us (a config key, a file, a layout). The CLI prints
its message as one line and exits with code 2, without a traceback. Everything else is a bug and keeps
its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, on one line."""

    exit_code = 2
