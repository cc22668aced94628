"""The one error type users see (a clear one-line message, exit code 2, no traceback) and the one way to
warn without stopping a run."""

import warnings


class ShardlightError(Exception):
    """Bad input or an unusable environment; the CLI prints ``error: <message>`` and exits 2."""

    exit_code = 2


def warn(message: str) -> None:
    """A visible warning that never stops training (prefixed so it is easy to grep for)."""
    warnings.warn(f"shardlight: {message}", RuntimeWarning, stacklevel=2)


def first_line(exc: BaseException) -> str:
    """An exception's first line (or its type's name): enough for a one-line error, never a traceback."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
