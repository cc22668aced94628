"""``shardlight``: one parser, one module per command (each has ``add_parsers(subparsers)``)."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
from typing import List, NoReturn, Optional

from shardlight.cli import (
    analyze_command,
    checkpoint_command,
    diagnose_command,
    launch_command,
    planner_command,
    recipes_command,
    train_command,
)
from shardlight.errors import ShardlightError

# A new command: one module in shardlight/cli/ and one entry here.
COMMANDS = (train_command, recipes_command, analyze_command, diagnose_command, checkpoint_command, planner_command,
            launch_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlight",
        description="Recipe-driven FSDP fine-tuning of Hugging Face models, measuring where the bottleneck went.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.add_parsers(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    # Overrides may come after options (train R --summary-json S a.b=1); argparse can't intermix
    # positionals with subcommands, so leftover key=value words are handed to the command's items here.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or getattr(args, "items", None) is None]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.items = list(args.items) + extra
    try:
        return args.func(args)
    except ShardlightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def leave(code: int) -> NoReturn:
    """Exit a ``shardlight`` process (every rank's) with ``code``. Interpreter shutdown collects garbage over
    every object torch, Lightning and transformers created, several times: about 1.2 s of a 2-core machine
    per process, on every rank of every run. Frozen, those objects are left to the process's exit (atexit
    handlers still run; what CPython never promises, finalizers of objects alive at exit, is all that is
    skipped).

    Once torch is loaded the process ends as multiprocessing's children do: exit handlers, flushed streams,
    ``os._exit``. gloo's threads (its run loops and TCP loop, rank 0's TCPStore server) outlive
    ``destroy_process_group``, because torch keeps the group referenced (DeviceMesh's registry, DTensor's
    caches, DCP); interpreter finalization and the C++ static destructors running beside them now and then
    abort the rank ("terminate called without an active exception", pytorch#190489), and under srun one
    aborted task fails the whole job."""
    gc.freeze()
    if "torch" in sys.modules:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def run() -> NoReturn:
    """The ``shardlight`` script and ``python -m shardlight.cli``."""
    leave(main())


if __name__ == "__main__":
    run()
