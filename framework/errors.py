"""The one error type users see: a clear one-line message, exit code 2, no traceback."""


class ShardlightError(Exception):
    """Bad input or an unusable environment; the CLI prints ``error: <message>`` and exits 2."""

    exit_code = 2
