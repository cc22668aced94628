"""Wall time of ``shardlight analyze`` vs HTA 0.5.0 on the shared NCCL/RCCL trace sets.

HTA (``holistictraceanalysis==0.5.0``, pandas-based) is installed into its own virtual
environment under a cache directory on first use; it is never a shardlight dependency. Both
sides do the same work per trace set: load every rank, then communication/computation overlap
and the temporal breakdown (HTA: ``TraceAnalysis(trace_dir)``, ``get_comm_comp_overlap``,
``get_temporal_breakdown``; shardlight: ``analyze_traces``, which also computes per-step and
per-collective metrics). Times exclude interpreter start-up and imports; each set's best of
``--repeat`` runs is summed. The numbers of both are compared rank by rank.

Prints one JSON line, e.g. ``{"ratio": 0.03, "numbers_match": true, ...}`` (target: ratio <= 0.1).

    python benchmarks/analyze_vs_hta.py [--traces DIR] [--cache-dir DIR] [--repeat N]
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
sys.path.insert(0, str(REPO))

from shardlight.trace import analyze_traces  # noqa: E402

HTA_REQUIREMENTS = [
    # HTA's declared requirements pull in jupyterlab; these are the ones its analysis imports.
    "numpy==2.2.6", "pandas==2.2.3", "plotly", "networkx", "pydot", "psutil", "ijson", "pyyaml",
]

HTA_RUNNER = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
sets, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for set_dir in sets:
    best = None
    for _ in range(repeat):
        start = time.perf_counter()
        analysis = TraceAnalysis(trace_dir=set_dir)
        overlap = analysis.get_comm_comp_overlap(visualize=False)
        breakdown = analysis.get_temporal_breakdown(visualize=False)
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    ranks = {}
    for row in overlap.to_dict("records"):
        ranks[str(int(row["rank"]))] = {"overlap_pct": float(row["comp_comm_overlap_pctg"])}
    for row in breakdown.to_dict("records"):
        ranks[str(int(row["rank"]))].update(
            idle_us=float(row["idle_time(us)"]), compute_us=float(row["compute_time(us)"]),
            non_compute_us=float(row["non_compute_time(us)"]), span_us=float(row["kernel_time(us)"]))
    out[set_dir] = {"seconds": best, "ranks": ranks}
print("HTA_RESULT " + json.dumps(out))
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


def time_shardlight(sets: list[Path], repeat: int) -> dict[str, dict]:
    results = {}
    for set_dir in sets:
        best, analysis = None, None
        for _ in range(repeat):
            start = time.perf_counter()
            analysis = analyze_traces([set_dir])
            elapsed = time.perf_counter() - start
            best = elapsed if best is None else min(best, elapsed)
        results[str(set_dir)] = {"seconds": best, "ranks": analysis["ranks"]}
    return results


def time_hta(python: Path, sets: list[Path], repeat: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as scratch:
        runner = Path(scratch) / "run_hta.py"
        runner.write_text(HTA_RUNNER)
        done = subprocess.run(
            [str(python), str(runner), json.dumps([str(s) for s in sets]), str(repeat)],
            capture_output=True, text=True, check=False,
        )
    for line in done.stdout.splitlines():
        if line.startswith("HTA_RESULT "):
            return json.loads(line[len("HTA_RESULT "):])
    raise SystemExit(f"HTA run failed (exit {done.returncode}): {done.stderr[-2000:]}")


def compare(ours: dict, theirs: dict) -> dict:
    worst_us, worst_pct, mismatches = 0.0, 0.0, []
    for set_dir, hta in theirs.items():
        for rank, want in hta["ranks"].items():
            got = ours[set_dir]["ranks"][rank]
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
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"error: trace sets not found at {args.traces} (set SHARDLIGHT_SHARED_TRACES)", file=sys.stderr)
        return 2
    sets = trace_sets(args.traces)
    python = ensure_hta_venv(args.cache_dir)
    ours = time_shardlight(sets, args.repeat)
    theirs = time_hta(python, sets, args.repeat)
    ours_s = sum(r["seconds"] for r in ours.values())
    theirs_s = sum(r["seconds"] for r in theirs.values())
    line = {
        "benchmark": "analyze_vs_hta",
        "sets": len(sets),
        "ranks": sum(len(r["ranks"]) for r in ours.values()),
        "shardlight_s": round(ours_s, 3),
        "hta_s": round(theirs_s, 3),
        "ratio": round(ours_s / theirs_s, 4),
        "target_ratio": 0.1,
        "hta_version": "0.5.0",
        "repeat": args.repeat,
    }
    line.update(compare(ours, theirs))
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
