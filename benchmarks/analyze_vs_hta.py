"""Wall time of ``shardlight analyze`` vs HTA 0.5.0, and vs ``gzip -dc``, on the shared NCCL/RCCL trace sets.

Two lines on the shared harness (:mod:`_harness`: ABBA pairs, bootstrap interval, A/A noise):

* ``analyze_vs_hta``: shardlight (candidate) over HTA (baseline), target ratio <= 0.15 (a few hundred
  ms of an offline command traded for one plain reader, issue 34). HTA (``holistictraceanalysis==0.5.0``,
  pandas-based) is installed into its own virtual environment under a cache directory on first use
  (about 20 s); it is never a shardlight dependency. Both do
  the same work per trace set: load every rank, then communication/computation overlap and the
  temporal breakdown (HTA: ``TraceAnalysis(trace_dir)``, ``get_comm_comp_overlap``,
  ``get_temporal_breakdown``; shardlight: ``analyze_traces``, which also computes per-step and
  per-collective metrics and the cross-rank split). Their numbers are compared rank by rank:
  ``numbers_match`` (overlap within 0.01 points, times within 1 us).
* ``analyze_vs_gunzip``: shardlight over ``gzip -dc`` of the same files to /dev/null (the decode
  floor: one ``gzip`` process over all files; the uncompressed ones it copies), target <= 1.5.

Each arm run is one subprocess over all trace sets, each set read once. Shardlight and HTA time
their work inside the subprocess, after their imports (interpreter start-up and imports
excluded); the gzip arm is the wall time of its process (start-up included, about 1 ms).

    python benchmarks/analyze_vs_hta.py [--traces DIR] [--cache-dir DIR] [--pairs N] [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import compare, emit  # noqa: E402

HTA_REQUIREMENTS = [
    # HTA's declared requirements pull in jupyterlab; these are the ones its analysis imports.
    "numpy==2.2.6", "pandas==2.2.3", "plotly", "networkx", "pydot", "psutil", "ijson", "pyyaml",
]

HTA_RUNNER = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
out, total = {}, 0.0
for set_dir in json.loads(sys.argv[1]):
    start = time.perf_counter()
    analysis = TraceAnalysis(trace_dir=set_dir)
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    total += time.perf_counter() - start
    ranks = {}
    for row in overlap.to_dict("records"):
        ranks[str(int(row["rank"]))] = {"overlap_pct": float(row["comp_comm_overlap_pctg"])}
    for row in breakdown.to_dict("records"):
        ranks[str(int(row["rank"]))].update(
            idle_us=float(row["idle_time(us)"]), compute_us=float(row["compute_time(us)"]),
            non_compute_us=float(row["non_compute_time(us)"]), span_us=float(row["kernel_time(us)"]))
    out[set_dir] = ranks
print("RESULT " + json.dumps({"seconds": total, "sets": out}))
"""

SHARDLIGHT_RUNNER = r"""
import json, sys, time
from shardlight.trace import analyze_traces
out, total = {}, 0.0
for set_dir in json.loads(sys.argv[1]):
    start = time.perf_counter()
    analysis = analyze_traces([set_dir])
    total += time.perf_counter() - start
    out[set_dir] = {rank: {key: r[key] for key in ("overlap_pct", "idle_us", "compute_us", "non_compute_us",
                                                   "span_us")} for rank, r in analysis["ranks"].items()}
print("RESULT " + json.dumps({"seconds": total, "sets": out}))
"""


def default_traces_dir() -> Path:
    override = os.environ.get("SHARDLIGHT_SHARED_TRACES")
    return Path(override) if override else REPO.parent / "shared" / "traces"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "shardlight" / "hta-0.5.0-venv"


def ensure_hta_venv(cache_dir: Path) -> Path:
    python = cache_dir / "bin" / "python"
    marker = cache_dir / ".shardlight-ready"
    if marker.exists() and python.exists():
        return python
    print(f"installing holistictraceanalysis==0.5.0 into {cache_dir} ...", file=sys.stderr)
    venv.EnvBuilder(with_pip=True, clear=True).create(cache_dir)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + HTA_REQUIREMENTS, check=True, stdout=sys.stderr)
    subprocess.run(pip + ["--no-deps", "holistictraceanalysis==0.5.0"], check=True, stdout=sys.stderr)
    marker.write_text("ok\n")
    return python


def trace_sets(traces: Path) -> list[Path]:
    return sorted(
        p for p in traces.iterdir()
        if p.is_dir() and any(f.name.endswith((".json", ".json.gz")) for f in p.iterdir())
    )


def trace_files(sets: list[Path]) -> list[Path]:
    return [f for s in sets for f in sorted(s.iterdir()) if f.name.endswith((".json", ".json.gz"))]


def run_runner(python: str, runner: str, args: list[str]) -> dict:
    """One arm run: the runner's RESULT line (its seconds and per-set, per-rank numbers)."""
    with tempfile.TemporaryDirectory() as scratch:
        script = Path(scratch) / "runner.py"
        script.write_text(runner)
        done = subprocess.run([python, str(script), *args], capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{runner.split()[0]} run failed (exit {done.returncode}): {done.stderr[-2000:]}")


def time_gunzip(files: list[Path]) -> float:
    """Wall seconds of one ``gzip -dc -f`` over all files into /dev/null (``-f`` copies plain JSON)."""
    with open(os.devnull, "wb") as sink:
        start = time.perf_counter()
        subprocess.run(["gzip", "-dc", "-f", *map(str, files)], stdout=sink, check=True)
        return time.perf_counter() - start


def numbers_match(ours: dict, theirs: dict) -> dict:
    """Rank by rank, shardlight's numbers against HTA's."""
    worst_us, worst_pct, mismatches = 0.0, 0.0, []
    for set_dir, ranks in theirs.items():
        for rank, want in ranks.items():
            got = ours[set_dir].get(rank)
            if got is None:
                mismatches.append(f"{Path(set_dir).name}/{rank}/missing")
                continue
            pct = abs(got["overlap_pct"] - want["overlap_pct"])
            worst_pct = max(worst_pct, pct)
            if pct > 0.01:
                mismatches.append(f"{Path(set_dir).name}/{rank}/overlap_pct")
            for key in ("idle_us", "compute_us", "non_compute_us", "span_us"):
                diff = abs(got[key] - want[key])
                worst_us = max(worst_us, diff)
                if diff > 1:
                    mismatches.append(f"{Path(set_dir).name}/{rank}/{key}")
    return {"numbers_match": not mismatches, "max_abs_diff_us": worst_us,
            "max_abs_diff_overlap_pct": round(worst_pct, 4), "mismatches": mismatches}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=default_traces_dir())
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--pairs", type=int, default=8, help="pairs at least (the harness' min_pairs)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="time budget of each line (s)")
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"error: trace sets not found at {args.traces} (set SHARDLIGHT_SHARED_TRACES)", file=sys.stderr)
        return 2
    sets = trace_sets(args.traces)
    files = trace_files(sets)
    set_args = [json.dumps([str(s) for s in sets])]
    hta_python = str(ensure_hta_venv(args.cache_dir))
    last: dict[str, dict] = {}

    def shardlight() -> dict:
        last["shardlight"] = run_runner(sys.executable, SHARDLIGHT_RUNNER, set_args)
        return {"wall_s": last["shardlight"]["seconds"]}

    def hta() -> dict:
        last["hta"] = run_runner(hta_python, HTA_RUNNER, set_args)
        return {"wall_s": last["hta"]["seconds"]}

    def gunzip() -> dict:
        return {"wall_s": time_gunzip(files)}

    limits = {"min_pairs": max(args.pairs, 2), "max_pairs": max(args.pairs, 40), "budget_s": args.budget_s}
    common = {"sets": len(sets), "files": len(files), "imports": "excluded (gzip: its process start included)"}
    result = compare("analyze_vs_hta", baseline=hta, candidate=shardlight, metric="wall_s", target=0.15,
                     bound="upper", **limits)
    ranks = sum(len(r) for r in last["shardlight"]["sets"].values())
    result.update(common, ranks=ranks, hta_version="0.5.0",
                  **numbers_match(last["shardlight"]["sets"], last["hta"]["sets"]))
    emit(result)
    result = compare("analyze_vs_gunzip", baseline=gunzip, candidate=shardlight, metric="wall_s", target=1.5,
                     bound="upper", **limits)
    result.update(common, ranks=ranks)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
