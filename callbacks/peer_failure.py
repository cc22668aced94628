"""PeerFailureCallback: a collective that failed because another rank died or hung, as one clear line.

A dead rank (SIGKILL, the OOM killer, a crash) or a stopped one (hung, SIGSTOPped, swapped out) reaches the
others as whatever error the collective they are in raises, and which collective that is is timing. gloo
raises ``Timed out waiting 15000ms for recv operation`` in the op that times out and closes every pair of
its context, so each later op fails at once with ``Application timeout caused pair closure``; and Lightning
broadcasts a SIGTERM flag before every training batch, swallowing any exception that broadcast raises. A
rank that stops while the other waits in that broadcast therefore shows up as *only* the pair closure, in
the next batch's first FSDP all-gather. A process that is gone shows up as ``Connection reset by peer`` /
``closed by peer``, ``Connection refused`` (the store) or a broken pipe; NCCL adds its watchdog and
remote-error messages; torch raises ``DistError`` subclasses; any of them may come wrapped in another
exception. ``peer_failure`` recognizes all of them, by type and by one table of messages (``PATTERNS``).

For such a failure the user sees one line, ``error: rank R: a collective failed, ...``, and exit status 1,
without the traceback: the callback prints the line in ``on_exception`` (the first moment Lightning lets
us, before teardown and before Lightning's child-process observer may SIGKILL this rank) and, for the
uncaught exception that follows at the top of the process, prints nothing instead of the traceback
(``sys.excepthook``; ``shardlight.cli.main`` only catches ``ShardlightError``). Lightning still runs its whole
exception path (the other callbacks' ``on_exception``, loggers' ``finalize("failed")``, teardown) and
re-raises; a caller that catches the exception (a test calling the CLI's ``main``) gets it as before. Not
recipe-configured: ``shardlight.build`` always adds it, whether or not checkpoints are enabled.

A rank's own exception (a bug in a training step, a bad batch on one rank) is the other half: its peers see
only a dead peer. On a run of several ranks, the rank that raised prints ``error: rank R: Type: message (at
file:line in function)``, writes its traceback to ``run_dir/flight_recorder/exception_rank_<R>.txt`` and keeps
it off the console; a peer that then fails in a collective finds that file and prints nothing, so the run's
one line is the exception. The exceptions that already end a run in one line of their own (``ShardlightError``,
``NonFiniteStop``, a keyboard interrupt) are left alone.

The callback covers whatever Lightning runs (``fit``, and ``validate`` after it: both call ``on_exception``).
The collectives a run makes outside Lightning (the export's reference forward and full-weights gather after
fit) run inside :func:`peer_failures_reported`, which reports the same way (:func:`report_peer_failure`).
"""

from __future__ import annotations

import builtins
import re
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Tuple

import lightning.pytorch as pl
import torch
from typing_extensions import override

from shardlight.causal_lm import NonFiniteStop
from shardlight.errors import ShardlightError, first_line
from shardlight.run_context import RunContext

# One row per form a dead or stopped peer takes: (what it is, a case-insensitive regex on one exception's
# message). Deliberately specific: a bare "timeout" or "connection" would also match, say, a data download.
PATTERNS: Tuple[Tuple[str, str], ...] = (
    ("gloo: an op timed out waiting for the peer", r"timed out waiting \d+ ?ms for (send|recv)"),
    ("gloo: a pair closed by an earlier op's timeout", r"application timeout caused pair closure"),
    ("the peer's socket went away", r"connection (reset|closed) by peer"),
    ("no one listens where the peer was", r"connection refused"),
    ("the peer's end of a socket is closed", r"broken pipe"),
    ("NCCL's watchdog: a collective ran past its timeout",
     r"watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out"),
    ("NCCL's watchdog or heartbeat monitor gave up", r"watchdog thread terminated|heartbeat monitor timed out"),
    ("NCCL: the remote rank failed", r"ncclremoteerror|remote process exited|communicator was aborted"),
    ("the store timed out waiting for other ranks", r"socket timeout|wait timeout after \d+ ?ms"),
)
_COMPILED = tuple((what, re.compile(pattern, re.IGNORECASE)) for what, pattern in PATTERNS)
_DIST_ERRORS = tuple(t for t in (getattr(torch.distributed, "DistError", None),) if isinstance(t, type))
_GROUPS = tuple(t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t)  # Python >= 3.11
_MAX_DETAIL = 300
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*:\d+\] ")


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it wraps (``__cause__``, ``__context__``, an ExceptionGroup's members),
    each once, nearest first."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        members = current.exceptions if isinstance(current, _GROUPS) else ()
        todo.extend([current.__cause__, current.__context__, *members])


def peer_failure(exc: BaseException) -> Optional[str]:
    """``"Type: gist"`` of the exception in ``exc``'s chain that says another rank died or hung (a
    ``DistError``, or a message ``PATTERNS`` matches); None for every other error."""
    for link in exception_chain(exc):
        message = str(link)
        if isinstance(link, _DIST_ERRORS) or any(regex.search(message) for _, regex in _COMPILED):
            return f"{type(link).__name__}: {_gist(link)}"
    return None


def _gist(exc: BaseException) -> str:
    """The first sentence of the first line, without gloo's ``[/path/to/pair.cc:537] `` source prefix and the
    advice it appends ("This is typically caused by ... GLHF!")."""
    line = _SOURCE_PREFIX.sub("", first_line(exc))
    return line.split(". ", 1)[0][:_MAX_DETAIL]


def peer_failure_message(rank: int, detail: str) -> str:
    return (f"error: rank {rank}: a collective failed, another rank probably died or hung ({detail}); "
            "stopping this rank")


class _QuietExit:
    """``sys.excepthook`` for the uncaught exception a reported peer failure becomes: its one line is already
    out, so print nothing (the interpreter then exits with status 1). Any other uncaught exception goes to the
    hook that was there before (torch's, which prefixes each traceback line with the rank)."""

    def __init__(self, reported: BaseException, previous: Any) -> None:
        self.reported = reported
        self.previous = previous

    def __call__(self, kind: type, value: BaseException, traceback: Any) -> None:
        if not any(link is self.reported for link in exception_chain(value)):
            self.previous(kind, value, traceback)


EXCEPTION_PREFIX = "exception_rank_"
_OWN_LINES = (ShardlightError, NonFiniteStop)  # exceptions that end a run in one line of their own


def _quiet(exception: BaseException, line: Optional[str]) -> None:
    """Print ``line`` (unless None, or this exception was already reported) and keep ``exception``'s traceback
    off the console when it reaches the top uncaught."""
    hook = sys.excepthook
    if isinstance(hook, _QuietExit):
        if line and not any(link is hook.reported for link in exception_chain(exception)):
            print(line, file=sys.stderr, flush=True)
        hook.reported = exception
    else:
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.excepthook = _QuietExit(exception, hook)


def report_peer_failure(rank: int, exception: BaseException, folder: Optional[Path] = None) -> bool:
    """If ``exception`` says another rank died or hung: print its one line (once, however often it is
    reported; not at all when another rank's own exception in ``folder`` explains it) and keep its traceback
    off the console when it reaches the top uncaught. False, and nothing done, for any other error."""
    detail = peer_failure(exception)
    if detail is None:
        return False
    explained = folder is not None and any(folder.glob(f"{EXCEPTION_PREFIX}*.txt"))
    _quiet(exception, None if explained else peer_failure_message(rank, detail))
    return True


def report_own_exception(rank: int, exception: BaseException, folder: Path) -> bool:
    """This rank raised ``exception`` itself, on a run of several ranks: its one ``error:`` line, its traceback
    to ``folder/exception_rank_<R>.txt`` (where the peers look before saying a peer died). False, and nothing
    done, for the exceptions that have their own line or are no error."""
    if isinstance(exception, _OWN_LINES) or not isinstance(exception, Exception):
        return False
    path = folder / f"{EXCEPTION_PREFIX}{rank}.txt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exception)))
    except OSError:
        return False  # nowhere to put the traceback: the console keeps it
    frames = traceback.extract_tb(exception.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    _quiet(exception, f"error: rank {rank}: {type(exception).__name__}: {first_line(exception)}{where}; "
                      f"traceback in {path}")
    return True


@contextmanager
def peer_failures_reported(rank: int) -> Iterator[None]:
    """Collectives outside Lightning's ``fit``/``validate``: a dead or hung peer is reported as
    :func:`report_peer_failure` does, and the exception propagates unchanged."""
    try:
        yield
    except BaseException as exc:
        report_peer_failure(rank, exc)
        raise


class PeerFailureCallback(pl.Callback):
    """Prints the one clear line for a collective another rank's death or hang broke, or for this rank's own
    exception on a run of several ranks, and keeps the traceback of the exception Lightning re-raises off the
    console.

    Arguments:
        folder: where a rank's own exception leaves its traceback for the others (``run_dir/flight_recorder``);
            None: every exception keeps its traceback.
    """

    def __init__(self, folder: Optional[Path] = None) -> None:
        self.folder = folder

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if report_peer_failure(trainer.global_rank, exception, self.folder):
            return
        if self.folder is not None and trainer.world_size > 1:
            report_own_exception(trainer.global_rank, exception, self.folder)


def build(ctx: RunContext) -> PeerFailureCallback:
    return PeerFailureCallback(ctx.flight_recorder_dir() if ctx.run_dir is not None else None)
