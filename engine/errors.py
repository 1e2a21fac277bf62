"""The one exception type whose message is shown to the user as a single line (no traceback)."""


class UserFacingError(Exception):
    """Bad input or a failed run, explained in one line that says what to do.

    The entry scripts catch it, print ``error: <message>`` to stderr and exit with status 2.
    """
