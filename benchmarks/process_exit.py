"""How long a shardlight process takes to exit once its work is done: ``shardlight.cli.main.leave`` (the heap
frozen before interpreter shutdown) against a plain ``sys.exit``, after the imports every rank makes.

Each run is a fresh process that imports what a training rank imports (``shardlight.train``, which brings
torch, Lightning, transformers and datasets), prints the wall clock, and exits one way or the other; the
parent takes the time from that print to the process's end (``exit_s``, the primary metric, target <= 0.5)
and the whole process (``process_s``). Every rank of every run pays this once.

    python benchmarks/process_exit.py [--budget-s S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import compare, emit  # noqa: E402

CHILD = ("import sys, time, shardlight.train\n"
         "from shardlight.cli.main import leave\n"
         "print(time.time(), flush=True)\n"
         "leave(0) if sys.argv[1] == 'leave' else sys.exit(0)\n")


def run(how: str) -> dict:
    started = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    ended = time.time()
    return {"exit_s": ended - float(out.split()[-1]), "process_s": ended - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=180.0, help="time budget (s)")
    args = parser.parse_args(argv)
    result = compare("process_exit", baseline=lambda: run("sys.exit"), candidate=lambda: run("leave"),
                     metric="exit_s", target=0.5, bound="upper", budget_s=args.budget_s)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
