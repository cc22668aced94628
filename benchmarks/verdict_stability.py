"""Does the same recipe get the same verdict? The default recipe run ``--runs`` times back to back (2 gloo ranks,
its own settings; W&B, the progress bar and the final export off), each run's end-of-run label read from its
``diagnosis.json``.

The JSON line's ``ratio`` is the share of runs whose label is the most common one (target 1.0: every run the
same words); ``labels`` lists them in run order, and ``shares`` each class's run-level share as [lowest,
highest] over the runs with its uncertainty (the labels move when a share crosses its band's edge between
runs). A count, not a timing: no pairs, no A/A noise.

    python benchmarks/verdict_stability.py [--runs N] [--timeout-s S] [--keep DIR] [RECIPE OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import cpu_env, emit, exact, run_tree  # noqa: E402


def one_run(out: Path, overrides: list, timeout_s: float) -> dict:
    """One run of the default recipe; its diagnosis (label, certainty, each class's [share, uncertainty])."""
    command = [sys.executable, "-m", "shardlight.cli", "train", f"output_dir={out}", "logging.wandb.enabled=false",
               "trainer.progress_bar=false", "export.at_end=false", *overrides]
    done = run_tree(command, env=cpu_env(dict(os.environ)), cwd=REPO, timeout_s=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    found = sorted(out.glob("*/*/diagnosis.json"))
    if not found:
        raise SystemExit(f"no diagnosis.json under {out}: {done.stdout[-2000:]}")
    return json.loads(found[-1].read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="back-to-back runs (default 5)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the most one run may take")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' directories here (to re-judge them offline); default: a temporary one")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run (key=value)")
    args = parser.parse_args(argv)
    diagnoses = []
    with tempfile.TemporaryDirectory(prefix="verdict_stability_") as scratch:
        tmp = args.keep or scratch
        for n in range(args.runs):
            diagnoses.append(one_run(Path(tmp) / f"run{n}", args.overrides, args.timeout_s))
            print(f"# run {n + 1}/{args.runs}: {diagnoses[-1]['label']}", file=sys.stderr, flush=True)
    labels = [d["label"] for d in diagnoses]
    _, agreeing = Counter(labels).most_common(1)[0]
    shares = {}
    for verdict in diagnoses[0].get("spread", {}):
        values = [d["spread"][verdict] for d in diagnoses if verdict in d.get("spread", {})]
        shares[verdict] = {"share": [round(min(v[0] for v in values), 1), round(max(v[0] for v in values), 1)],
                           "uncertainty": [round(min(v[1] for v in values), 1), round(max(v[1] for v in values), 1)]}
    emit(exact("verdict_stability", value=round(agreeing / len(labels), 3), target=1.0, labels=labels,
               shares=shares, runs=len(labels), overrides=args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
