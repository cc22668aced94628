"""gpu_check.sh's analyze step: the GPU run's CUDA memory metrics, MFU, verdict and the comm callback's kernel
classification of its last trace window; writes OUT/check.json and a gzipped copy of that window's rank-0
trace.

    python3 benchmarks/gpu/analyze_run.py OUT_DIR      # OUT_DIR/summary.json from `shardlight train`

Exit status 1 when the trace is not a GPU trace, has no computation kernels, a memory/MFU metric is missing
or not positive, MFU >= 1, or the run has no verdict.
"""

import csv
import gzip
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

from shardlight.trace import analyze_trace_file
from shardlight.trace.events import COMMUNICATION, COMPUTATION
from shardlight.trace.sources.nccl import kernel_type, nccl_collective

out = Path(sys.argv[1])
summary = json.loads((out / "summary.json").read_text())
run_dir = Path(summary["run_dir"])
rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
metrics = {}
for row in rows:
    for key, value in row.items():
        if value and key.startswith(("memory/", "throughput/", "comm/", "step/", "diagnosis/")):
            try:
                metrics[key] = float(value)  # the latest value of each key
            except ValueError:
                metrics[key] = value

print("\n== CUDA memory (rank 0, GB) ==")
for key in ("peak", "reserved", "capacity", "headroom", "params", "grads", "optim"):
    print(f"  memory/{key}_gb = {metrics.get(f'memory/{key}_gb')}")
print("\n== throughput ==")
for key in ("tokens_per_sec_per_device", "flops_per_token", "tflops_per_device", "mfu"):
    print(f"  throughput/{key} = {metrics.get(f'throughput/{key}')}")
print(f"\n== verdict: {summary.get('verdict')}")

windows = sorted((run_dir / "traces").glob("step_*"))
assert windows, "no comm window traces were written"
trace = windows[-1] / "rank0.pt.trace.json"
dest = out / f"trace_{windows[-1].name}_rank0.pt.trace.json.gz"  # gzipped: the device tool brings back <= 16 MB
with open(trace, "rb") as src, gzip.open(dest, "wb") as gz:
    shutil.copyfileobj(src, gz)
data = json.loads(trace.read_text())
kernels = [e for e in data["traceEvents"] if isinstance(e.get("args"), dict) and "stream" in e["args"]
           and e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
kinds = Counter(kernel_type(e["name"]) for e in kernels)
collectives = Counter(nccl_collective(e["name"]) for e in kernels
                      if kernel_type(e["name"]) == COMMUNICATION)
result = analyze_trace_file(trace)
print(f"\n== comm callback's classification of {dest.name} ==")
print(f"  mode: {result['mode']}; kernels by type: {dict(kinds)}; NCCL kernels by collective: {dict(collectives)}")
names = Counter(e["name"] for e in kernels if kernel_type(e["name"]) == COMMUNICATION)
for name, count in names.most_common(5):
    print(f"    {count:5d} x {name}")
print(f"  comm_us={result['comm_us']} compute_us={result['compute_us']} overlap_pct={result['overlap_pct']} "
      f"exposed_comm_us={result['exposed_comm_us']}")
print(f"  logged: comm/total_ms={metrics.get('comm/total_ms')} comm/compute_ms={metrics.get('comm/compute_ms')} "
      f"step/time_ms={metrics.get('step/time_ms')}")
(out / "check.json").write_text(json.dumps(
    {"metrics": metrics, "verdict": summary.get("verdict"),
     "classification": {"trace": dest.name, "kernels_by_type": kinds, "nccl_by_collective": collectives,
                        "analysis": {k: v for k, v in result.items() if k != "steps"}}},
    indent=2, sort_keys=True, default=dict) + "\n")
if not collectives:
    print("  note: no NCCL kernels at world size 1 (NCCL may run single-rank collectives as copies)")

problems = []
if result["mode"] != "gpu":
    problems.append(f"trace mode is {result['mode']}, not gpu")
if not kinds.get(COMPUTATION):
    problems.append("no computation kernels in the trace")
for key in ("memory/peak_gb", "memory/capacity_gb", "memory/headroom_gb", "throughput/mfu"):
    if not (isinstance(metrics.get(key), float) and metrics[key] > 0):
        problems.append(f"{key} missing or not positive")
if isinstance(metrics.get("throughput/mfu"), float) and metrics["throughput/mfu"] >= 1:
    problems.append("MFU >= 1")
if not summary.get("verdict"):
    problems.append("the run has no verdict")
print(f"\nwrote {out}/check.json, {dest.name}")
if problems:
    print("ANALYZE FAILED: " + "; ".join(problems))
    sys.exit(1)
print("ANALYZE OK")
