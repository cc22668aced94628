"""On a lent GPU (``benchmarks/gpu_check.sh``'s ``compile`` step): the default recipe on one GPU with
``compile: false`` and ``true``, alternately (``--pairs`` pairs), each run's tokens/s per device read from its
metrics.csv (``throughput/tokens_per_sec_per_device``, the median of its logged intervals; the throughput clock
leaves the compile time out) and its ``compile_s`` from its summary. One JSON line (``compile_speed_gpu``): the
medians, their ratio and each run's values; no interval at two pairs.

    python benchmarks/gpu/compile_compare.py [--pairs N] RECIPE_OVERRIDES...
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEY = "throughput/tokens_per_sec_per_device"


def one_run(out: Path, overrides: list) -> dict:
    summary = out / "summary.json"
    result = subprocess.run([sys.executable, "-m", "shardlight.cli", "train", "recipes/tiny-llama-sft.yaml",
                             f"output_dir={out}", "--summary-json", str(summary), *overrides],
                            cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"compile_compare: a run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    done = json.loads(summary.read_text())
    with open(Path(done["run_dir"]) / "csv" / "metrics.csv") as fh:
        rates = [float(r[KEY]) for r in csv.DictReader(fh) if r.get(KEY)]
    if not rates:
        sys.exit(f"compile_compare: no {KEY} in the run's metrics.csv")
    return {"tokens_per_sec": statistics.median(rates), "compile_s": done.get("compile_s")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory(prefix="compile_compare_") as tmp:
        for pair in range(args.pairs):
            order = ("eager", "compiled") if pair % 2 == 0 else ("compiled", "eager")  # ABBA
            for arm in order:
                extra = ["compile=true"] if arm == "compiled" else []
                runs[arm].append(one_run(Path(tmp) / f"{arm}-{pair}", [*args.overrides, *extra]))
                print(f"compile_compare: pair {pair + 1} {arm}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    eager = statistics.median(r["tokens_per_sec"] for r in runs["eager"])
    compiled = statistics.median(r["tokens_per_sec"] for r in runs["compiled"])
    line = {"benchmark": "compile_speed_gpu", "metric": "tokens_per_sec_per_device", "eager": round(eager, 1),
            "compiled": round(compiled, 1), "ratio": round(compiled / eager, 3), "pairs": args.pairs,
            "compile_s": [r["compile_s"] for r in runs["compiled"]], "runs": runs,
            "note": f"{args.pairs} pairs, no interval: a reading, not a claim"}
    print(json.dumps(line))
    results = os.environ.get("SHARDLIGHT_BENCH_RESULTS")
    if results:
        with open(results, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
