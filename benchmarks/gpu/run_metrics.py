"""gpu_check.sh's 8b step, after its training run: the run's summary with the latest value of each memory,
throughput, comm, step and diagnosis metric of its metrics.csv added under "metrics", written back to the same
file and printed as one JSON line (the device tool brings back a few files; the run directory stays there).

    python3 benchmarks/gpu/run_metrics.py OUT/summary-8b.json
"""

import csv
import json
import sys
from pathlib import Path

path = Path(sys.argv[1])
summary = json.loads(path.read_text())
metrics = {}
for row in csv.DictReader(open(Path(summary["run_dir"]) / "csv" / "metrics.csv")):
    for key, value in row.items():
        if value and key.startswith(("memory/", "throughput/", "comm/", "step/", "diagnosis/")):
            try:
                metrics[key] = float(value)  # the latest value of each key
            except ValueError:
                metrics[key] = value
summary["metrics"] = metrics
path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
print(json.dumps(summary, sort_keys=True))
missing = [k for k in ("memory/peak_gb", "throughput/tokens_per_sec_per_device", "throughput/mfu") if k not in metrics]
sys.exit(f"run_metrics: missing {missing}" if missing else 0)
